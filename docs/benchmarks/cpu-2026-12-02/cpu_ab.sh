#!/usr/bin/env bash
# before/after on this CPU: the embedded default (stoker serve as README), binary V2 c=1,32
set -u
PY=/work/main/.venv/bin/python
out=/tmp/cpu_ab; mkdir -p $out
for round in 1 2 3; do
  for tree in before after; do
    dir=/work/main; [ $tree = before ] && dir=/tmp/before
    (cd $dir && PYTHONPATH=$dir timeout 300 $PY -m app serve --port 8151 > $out/server_${tree}_$round.log 2>&1 &)
    for i in $(seq 120); do curl -sf localhost:8151/v2/health/ready >/dev/null && break; sleep 1; done
    (cd /work/main && $PY -m bench --url http://127.0.0.1:8151 --repository models --payload v2-binary --rows 1 --concurrency 1,32 --duration 6 --warmup 2 --json $out/${tree}_$round.json > $out/${tree}_$round.log 2>&1)
    pkill -TERM -f "port 8151"; sleep 4
    echo "$tree $round: $(grep -E 'c=(1|32) ' $out/${tree}_$round.log | awk '{print $2, $3}' | tr '\n' ' ')"
  done
done
