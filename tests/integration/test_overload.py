"""Overload: a real server offered three times the rate it can sustain, open loop (Poisson
arrivals), for ``STOKER_OVERLOAD_SECONDS`` (15 in CI; the README's figures come from a 60 s
run by hand).

The model is the slow test model (``tests/integration/test_hardening_http.py``) at a fixed
``m``, so each row costs the same few milliseconds whatever the batch: batching cannot absorb
the excess and the queue must refuse it. The queue holds ``QUEUE`` requests (``max_queue_size``)
of one row each, batches hold ``BATCH`` rows, one runner.

What must hold:
- the excess is refused with 429 at once (a refusal's p50 under ``REFUSAL_P50_S`` and under
  ``REFUSAL_P50_RATIO`` of an accepted request's p50, its p99,
  on two cores shared with the model's threads and the client, under ``REFUSAL_P99_S`` or,
  where another process's load stretches every tail, under ``REFUSAL_P99_RATIO`` of an
  accepted request's p99);
- an accepted request waits at most for the queue ahead of it plus the running batch, so its
  p99 stays under ``(QUEUE / BATCH + 2) x batch time + HTTP_SLACK_S``, the batch time being the
  server's own mean during the run;
- the accepted throughput holds (at least half the sustainable rate: the refusals cost CPU on
  the same two cores);
- the server's RSS grows by less than ``RSS_MARGIN`` over the run;
- nothing is lost: every request gets 200 or 429, and the server's counters (successes,
  rejections, rows, pending) agree exactly with what the clients saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.test_hardening_http import WIDTH, slow_model, write_model

QUEUE = 8
BATCH = 4
TARGET_BATCH_S = 0.06
DURATION_S = float(os.environ.get("STOKER_OVERLOAD_SECONDS", "15"))
OVERLOAD = 3.0
# Generous for a machine with another process on a core (9 ms seen on a quiet one); the
# ratio to the accepted requests' p50 is what shows that a refusal skips the queue.
REFUSAL_P50_S = 0.25
REFUSAL_P50_RATIO = 1 / 3
REFUSAL_P99_S = 0.5
# 524 ms seen with a second test suite running on the same two cores (accepted p99 831 ms),
# and 812 ms against an accepted 996 ms with other tests spawning processes beside it: under
# such load both tails are the scheduler's. A refusal that queued as accepted requests do would
# wait as long at the tail, so no slower than them is still the bound that tells; the p50s
# above say that refusals skip the queue.
REFUSAL_P99_RATIO = 1.0
# What the HTTP layer, the client and the scheduler add to an accepted request's queueing
# bound on two shared cores at three times the sustainable rate: 0.4 s was passed by 0.11 s
# in a CI run on a slower, noisier machine (p99 890 ms against a 784 ms bound). An unbounded
# queue would take the p99 to seconds over the 15 s run, far past this.
HTTP_SLACK_S = 0.8
RSS_MARGIN = 32 * 1024 * 1024

CONFIG = f"""\
max_batch_size: {BATCH}
runners: 1
dynamic_batching:
  max_queue_delay_us: 0
  max_queue_size: {QUEUE}
  default_timeout_us: 30000000
"""
URL = "/v2/models/slow/infer"


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("overload")
    write_model(root / "repository", "slow", slow_model(), CONFIG)
    server = start_server(root / "repository", root / "server.log")
    yield server
    code = stop_server(server)
    log = server.log.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def body(m: int, value: float) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, m, 1], "data": [value] * m}]}
    ).encode()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def scrape(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != "slow":
                continue
            reason = sample.labels.get("reason")
            values[sample.name + (f":{reason}" if reason else "")] = sample.value
    return values


@dataclass
class Run:
    statuses: Counter[str] = field(default_factory=Counter)
    accepted_s: list[float] = field(default_factory=list)
    refused_s: list[float] = field(default_factory=list)
    rows: int = 0
    wrong: int = 0
    elapsed_s: float = 0.0


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as response:
        return scrape(await response.text())


async def send(session: aiohttp.ClientSession, url: str, m: int, value: float) -> tuple[int, bool]:
    async with session.post(
        url + URL, data=body(m, value), headers={"Content-Type": "application/json"}
    ) as response:
        answer = await response.read()
        if response.status != 200:
            assert set(json.loads(answer)) == {"error"}
            return response.status, True
        got = json.loads(answer)["outputs"][0]["data"][0]
        # Values are powers of two: every partial sum is one times a count below 2**24, so
        # float32 sums them exactly in any order and a right answer is exactly right (with
        # arbitrary values a sum of ~10**6 terms drifts by a few percent on a fast machine).
        # Compared as float32: JSON carries the shortest text that reads back as that float32.
        return 200, np.float32(got) == np.float32(value * m * WIDTH)


async def closed_loop(url: str, m: int, clients: int, seconds: float) -> float:
    """Requests per second with ``clients`` always waiting: the sustainable rate."""
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        stop = time.perf_counter() + seconds

        async def one_client() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                status, right = await send(session, url, m, 1.0)
                assert status == 200 and right
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return done / (time.perf_counter() - started)


async def open_loop(url: str, m: int, rate: float, seconds: float) -> Run:
    run = Run()
    rng = random.Random(7)
    # A connection per request: a kept-alive connection that the server closes as idle while
    # the client reuses it is lost in the race of the two, which would hide a real loss.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks: set[asyncio.Task[None]] = set()

        async def one(arrival: float, value: float) -> None:
            try:
                status, right = await send(session, url, m, value)
            except aiohttp.ClientError as exc:
                run.statuses[type(exc).__name__] += 1
                return
            latency = time.perf_counter() - arrival
            run.statuses[str(status)] += 1
            if status == 200:
                run.accepted_s.append(latency)
                run.rows += 1
                run.wrong += not right
            elif status == 429:
                run.refused_s.append(latency)

        start = time.perf_counter()
        arrival = start
        while True:
            arrival += rng.expovariate(rate)
            if arrival >= start + seconds:
                break
            delay = arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Below 1000: the model fails on purpose for larger values (test_hardening_http).
            task = asyncio.create_task(one(arrival, float(2 ** rng.randint(0, 9))))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        run.elapsed_s = time.perf_counter() - start
    return run


def calibrate_m(url: str) -> int:
    """The ``m`` at which a full batch takes about TARGET_BATCH_S here."""
    probe = 512

    async def batch_seconds(m: int) -> float:
        async with aiohttp.ClientSession() as session:
            data = json.dumps(
                {
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "FP32",
                            "shape": [BATCH, m, 1],
                            "data": [1.0] * (BATCH * m),
                        }
                    ]
                }
            )
            timings = []
            for _ in range(5):
                started = time.perf_counter()
                # A str body is text/plain to aiohttp, which a server without keys refuses.
                headers = {"Content-Type": "application/json"}
                async with session.post(url + URL, data=data, headers=headers) as response:
                    assert response.status == 200
                    await response.read()
                timings.append(time.perf_counter() - started)
            return float(np.median(timings))

    elapsed = asyncio.run(batch_seconds(probe))
    # Capped so that m * WIDTH stays below 2**24, where the exact-sum check in send() holds.
    return min(2**24 // WIDTH - 1, max(8, int(probe * TARGET_BATCH_S / elapsed)))


@pytest.mark.slow
def test_three_times_the_sustainable_rate(
    overloaded: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    url = overloaded.url
    m = calibrate_m(url)
    sustainable = asyncio.run(closed_loop(url, m, clients=2 * BATCH, seconds=3))
    rate = OVERLOAD * sustainable

    async def measured() -> tuple[dict[str, float], Run, dict[str, float]]:
        async with aiohttp.ClientSession() as session:
            before = await metrics(session, url)
            run = await open_loop(url, m, rate, DURATION_S)
            after = await metrics(session, url)
            return before, run, after

    rss_before = rss_bytes(overloaded.process.pid)
    before, run, after = asyncio.run(measured())
    rss_after = rss_bytes(overloaded.process.pid)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batches = delta("stoker_inference_exec_count_total")
    batch_s = delta("stoker_inference_compute_infer_duration_seconds_sum") / delta(
        "stoker_inference_compute_infer_duration_seconds_count"
    )
    bound_s = (QUEUE / BATCH + 2) * batch_s + HTTP_SLACK_S
    accepted_p99 = float(np.percentile(run.accepted_s, 99))
    refused_p99 = float(np.percentile(run.refused_s, 99))
    refused_p50_ms = round(1000 * float(np.percentile(run.refused_s, 50)), 1)
    offered = sum(run.statuses.values())
    figures = {
        "duration_s": DURATION_S,
        "m": m,
        "sustainable_rps": round(sustainable, 1),
        "offered_rps": round(offered / DURATION_S, 1),
        "statuses": dict(run.statuses),
        "accepted_rps": round(run.statuses["200"] / run.elapsed_s, 1),
        "accepted_p50_ms": round(1000 * float(np.percentile(run.accepted_s, 50)), 1),
        "accepted_p99_ms": round(1000 * accepted_p99, 1),
        "bound_ms": round(1000 * bound_s, 1),
        "batch_ms": round(1000 * batch_s, 1),
        "mean_batch_rows": round(delta("stoker_inference_count_total") / batches, 2),
        "refused_p50_ms": refused_p50_ms,
        "refused_p99_ms": round(1000 * refused_p99, 1),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
    }
    with capsys.disabled():
        print(f"\noverload: {json.dumps(figures)}")

    # Nothing lost, every answer right, and the server counted exactly what clients saw.
    assert set(run.statuses) <= {"200", "429"}, run.statuses
    assert run.wrong == 0
    assert delta("stoker_inference_request_success_total") == run.statuses["200"]
    assert delta("stoker_inference_request_failure_total:rejected") == run.statuses["429"]
    for reason in ("invalid", "timeout", "cancelled", "backend", "unavailable"):
        assert delta(f"stoker_inference_request_failure_total:{reason}") == 0, reason
    assert delta("stoker_inference_count_total") == run.rows
    assert after["stoker_inference_pending_request_count"] == 0
    # The excess was refused, quickly; the accepted ones waited no more than the queue allows.
    assert run.statuses["429"] > offered / 3
    assert refused_p50_ms < 1000 * REFUSAL_P50_S, figures
    accepted_p50_ms = 1000 * float(np.percentile(run.accepted_s, 50))
    assert refused_p50_ms < REFUSAL_P50_RATIO * accepted_p50_ms, figures
    assert refused_p99 < max(REFUSAL_P99_S, REFUSAL_P99_RATIO * accepted_p99), figures
    assert accepted_p99 < bound_s, figures
    assert run.statuses["200"] / run.elapsed_s > sustainable / 2, figures
    assert rss_after - rss_before < RSS_MARGIN, figures
