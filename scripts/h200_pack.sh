# Sourced by a GPU machine's script after it sets OUT (its default folder): the device tool
# brings back at most 8 files of $OUT, so the script writes its files to a work folder
# ($OUT from here on) and `pack` puts them all into one tarball, $RESULT/NAME.tgz (NAME:
# PACK_NAME, or the script's name). Call pack after each load; it runs again on exit, and a
# TERM (a `timeout` around the script) exits through it once the running command returns,
# so a call cut at its limit still brings back what ran.
PACK_NAME=${PACK_NAME:-$(basename "$0" .sh)}
RESULT=$OUT
OUT=/tmp/stoker-work-$PACK_NAME
rm -rf "$OUT"
mkdir -p "$OUT" "$RESULT"
pack() {
    tar -czf "$RESULT/$PACK_NAME.tgz.part" -C "$OUT" . &&
        mv "$RESULT/$PACK_NAME.tgz.part" "$RESULT/$PACK_NAME.tgz"
}
trap pack EXIT
trap 'exit 143' TERM
