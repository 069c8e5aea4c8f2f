#!/usr/bin/env bash
# JPEG uploads to /infer on this CPU: the embedded default in one process against two front ends
set -u
PY=/work/main/.venv/bin/python
out=/tmp/cpu_fe; rm -rf $out; mkdir -p $out
for round in 1 2; do
  for fe in 1 2; do
    (cd /work/main && timeout 300 $PY -m app serve --port 8152 --front-ends $fe > $out/server_${fe}_$round.log 2>&1 &)
    for i in $(seq 120); do curl -sf localhost:8152/v2/health/ready >/dev/null && break; sleep 1; done
    (cd /work/main && $PY -m bench --url http://127.0.0.1:8152 --repository models --payload jpeg --images /work/main/.carry/photos --distinct 48 --rows 1 --concurrency 1,32 --duration 6 --warmup 2 --json $out/fe${fe}_$round.json > $out/fe${fe}_$round.log 2>&1)
    pkill -TERM -f "port 8152"; sleep 4
    echo "front_ends=$fe round $round: $(grep -E 'c=(1|32) ' $out/fe${fe}_$round.log | awk '{print $2, $3, "p99", $7}' | tr '\n' ' ')"
  done
done
