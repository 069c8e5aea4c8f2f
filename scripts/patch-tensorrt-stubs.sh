#!/usr/bin/env bash
# Install the tensorrt-stubs pinned in pyproject.toml (the `tensorrt-stubs` dependency group)
# into DEST as a patched copy that mypy reads through `mypy_path`.
#
# As published (10.13.0.35.1) mypy cannot use the package: it installs plain `tensorrt/` and
# `tensorrt_bindings/` folders without a py.typed marker (so mypy skips them), and
# tensorrt.pyi does not parse (parameters named `in`; a non-default parameter after defaults
# in add_scale_nd). It also depends on tensorrt-cu12-bindings, whose libraries download from
# NVIDIA's index at install time: hence --no-deps, and a folder of its own rather than the
# venv, where a bare `tensorrt/` folder would make `import tensorrt` succeed with no TensorRT.
#
# Usage: scripts/patch-tensorrt-stubs.sh PYTHON DEST   (run from the repository root)
set -euo pipefail
python=${1:?usage: $0 PYTHON DEST}
dest=${2:?usage: $0 PYTHON DEST}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$work/site" --group tensorrt-stubs
mkdir -p "$work/out"
cp -r "$work/site/tensorrt" "$work/site/tensorrt_bindings" "$work/out/"

stub="$work/out/tensorrt_bindings/tensorrt.pyi"
# `in` is a keyword: rename those parameters (only in `def` lines).
sed -i -E '/^ *def /s/([(,] ?)in: /\1in_: /g' "$stub"
# A parameter without a default after parameters with defaults does not parse.
sed -i -E 's/^( *def add_scale_nd\(.*), channel_axis: int\)/\1, channel_axis: int = ...)/' "$stub"
# Names the stub uses without importing them.
sed -i -E '0,/^import typing$/s//import typing\nimport typing_extensions/' "$stub"
# The parser's errors are untyped (`-> ...`); they are ParserError objects.
sed -i -E 's/^( *def get_error\(self, index: int\)) -> \.\.\.:/\1 -> ParserError:/' "$stub"

"$python" - "$work/out" <<'PY'
import ast
import pathlib
import sys

bad = []
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.pyi")):
    try:
        ast.parse(path.read_text(), str(path))
    except SyntaxError as exc:
        bad.append(f"{path}:{exc.lineno}: {exc.msg}")
if bad:
    sys.exit("tensorrt-stubs still do not parse after patching:\n" + "\n".join(bad))
PY

rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$work/out" "$dest"
echo "patched tensorrt-stubs into $dest"
