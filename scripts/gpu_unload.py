"""GPU memory and RSS of a serving Stoker before an unload, after it, and after loading the
model again (its server started with ``models.control: explicit``), and the model's metric
label sets at each point; one table last.

    python3 scripts/gpu_unload.py http://127.0.0.1:8123 --pid SERVER_PID [--model resnet50]

GPU memory is NVML's per process (nvidia-smi's compute apps: the CUDA context included) for
the server and every process under it; RSS is theirs too; "GPU in use" is the whole device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def call(url: str, body: bytes | None = None) -> Any:
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=600) as response:
        text = response.read()
    return json.loads(text) if text else None


def processes(pid: int) -> list[int]:
    """``pid`` and every process under it, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def smi(*args: str) -> str:
    """nvidia-smi's answer; empty where there is none (a dry run on a CPU machine)."""
    try:
        return subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, check=True
        ).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        return ""


def gpu_by_pid() -> dict[int, int]:
    """MiB of GPU memory per process, as NVML reports it."""
    out = smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    used = {}
    for line in out.splitlines():
        if line.strip():
            pid, mib = (part.strip() for part in line.split(","))
            used[int(pid)] = int(mib)
    return used


def gpu_total_used() -> int:
    out = smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0").split()
    return int(out[0]) if out else 0


def labelled(base: str, model: str) -> int:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(1 for line in text.splitlines() if f'model="{model}"' in line)


def state(base: str, model: str) -> str:
    for row in call(f"{base}/v2/repository/index", b"{}"):
        if row.get("name") == model:
            return f"{row.get('state')} {row.get('reason', '')}".strip()
    return "absent"


def snapshot(name: str, base: str, pid: int, model: str) -> dict[str, Any]:
    procs = processes(pid)
    used = gpu_by_pid()
    row = {
        "point": name,
        "state": state(base, model),
        "gpu_mib_server": sum(used.get(p, 0) for p in procs),
        "gpu_mib_device": gpu_total_used(),
        "rss_mib_server": sum(rss_mib(p) for p in procs),
        "metric_lines": labelled(base, model),
    }
    print(json.dumps(row), flush=True)
    return row


def wait_for(base: str, model: str, wanted: str, limit_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if state(base, model).startswith(wanted):
            return time.perf_counter() - started
        time.sleep(0.1)
    raise SystemExit(f"{model} not {wanted} after {limit_s:.0f} s: {state(base, model)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--model", default="resnet50")
    args = parser.parse_args()
    base, model = args.url.rstrip("/"), args.model
    rows = [snapshot("serving", base, args.pid, model)]
    started = time.perf_counter()
    call(f"{base}/v2/repository/models/{model}/unload", b"{}")
    wait_for(base, model, "UNAVAILABLE", 120)
    unload_s = time.perf_counter() - started
    time.sleep(2)  # NVML's per-process figure follows the free a moment later
    rows.append(snapshot(f"unloaded ({unload_s:.1f} s)", base, args.pid, model))
    started = time.perf_counter()
    call(f"{base}/v2/repository/models/{model}/load", b"{}")
    wait_for(base, model, "READY", 400)
    loaded_s = time.perf_counter() - started
    rows.append(snapshot(f"loaded again ({loaded_s:.1f} s)", base, args.pid, model))
    print()
    print("| point | state | GPU MiB, server's processes | GPU MiB, device | RSS MiB | metrics |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['point']} | {row['state']} | {row['gpu_mib_server']:,} | "
            f"{row['gpu_mib_device']:,} | {row['rss_mib_server']:,.0f} | {row['metric_lines']} |"
        )


if __name__ == "__main__":
    main()
