"""Graceful drain of a real ``stoker serve`` on SIGTERM: readiness and new requests answer 503
at once (new and kept-alive connections alike), every accepted request gets its answer, and
the process exits 0 within ``server.drain_timeout_s``.

The model is built to be slow on demand: ``y = sum(x * ones[1, N] @ I^K)`` over a ``[rows,
M, 1]`` input, so its answer is ``x * M * N`` and its cost grows with ``M``. A request with a
large ``M`` (the blocker) keeps the only runner busy while 200 small requests queue behind it;
their different shape keeps them out of the blocker's batch.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import configure, slow_onnx
from tests.integration.conftest import Server, launch_server, serve_one_model

WIDTH = 512
LAYERS = 16
IN_FLIGHT = 200
# Long enough for 200 requests to reach the queue on two busy cores (1 to 2.5 s seen, more
# with another process on a core) with the blocker still running, and for the drain timeout
# test's 0.5 s to pass before it ends. The blocker's size is calibrated on an idle server, so
# the margin covers a machine that gets busier during the test.
BLOCKER_SECONDS = 8.0

CONFIG = """\
max_batch_size: 64
runners: 1
dynamic_batching:
  max_queue_delay_us: 0
  max_queue_size: 1024
  default_timeout_us: 60000000
"""


def infer_body(value: float, m: int = 1) -> dict[str, object]:
    return {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, m, 1], "data": [value] * m},
        ]
    }


def answer(response: httpx.Response) -> float:
    return float(response.json()["outputs"][0]["data"][0])


@dataclass
class Drained:
    server: Server
    drain_timeout_s: float
    blocker_m: int


def start(tmp_path: Path, drain_timeout_s: float) -> Server:
    env = {"STOKER_SERVER__DRAIN_TIMEOUT_S": str(drain_timeout_s)}
    return serve_one_model(tmp_path, "slow", slow_onnx(WIDTH, LAYERS), CONFIG, env)


def blocker_size(server: Server) -> int:
    """The ``M`` that keeps the runner busy for about BLOCKER_SECONDS on this machine."""
    probe = 2048
    url = f"{server.url}/v2/models/slow/infer"
    httpx.post(url, json=infer_body(1.0, probe), timeout=30).raise_for_status()
    started = time.perf_counter()
    response = httpx.post(url, json=infer_body(1.0, probe), timeout=30)
    elapsed = time.perf_counter() - started
    assert answer(response) == pytest.approx(probe * WIDTH)
    return max(probe, int(probe * BLOCKER_SECONDS / elapsed))


@pytest.fixture
def drained(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Drained]:
    timeout: float = request.param
    server = start(tmp_path, timeout)
    try:
        yield Drained(server, timeout, blocker_size(server))
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def pending_requests(client: httpx.Client, url: str) -> float:
    text = client.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "stoker_inference_pending_request_count":
            return sum(s.value for s in family.samples)
    return 0.0


@dataclass
class Outcome:
    blocker: httpx.Response
    accepted: list[tuple[float, httpx.Response, float]]  # (x, response, answered at)
    after: dict[str, httpx.Response]  # requests sent during the drain
    signalled_at: float
    refused_at: float
    exit_code: int
    exited_at: float


def drain_under_load(drained: Drained) -> Outcome:
    """Fire the blocker and IN_FLIGHT small requests, SIGTERM once all are accepted, probe the
    server during the drain, collect every answer and the exit code."""
    server = drained.server
    url = f"{server.url}/v2/models/slow/infer"

    async def scenario() -> Outcome:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with (
            httpx.AsyncClient(timeout=60, limits=limits) as clients,
            httpx.AsyncClient(timeout=60) as kept_alive,
        ):
            warm = await kept_alive.post(url, json=infer_body(0.5))
            assert warm.status_code == 200 and answer(warm) == pytest.approx(0.5 * WIDTH)

            blocker = asyncio.create_task(
                clients.post(url, json=infer_body(1.0, drained.blocker_m))
            )

            async def one(x: float) -> tuple[float, httpx.Response, float]:
                response = await clients.post(url, json=infer_body(x))
                return x, response, time.monotonic()

            await asyncio.sleep(0.1)
            small = [asyncio.create_task(one(float(i + 1))) for i in range(IN_FLIGHT)]
            with httpx.Client(timeout=5) as probe:
                deadline = time.monotonic() + 30
                while pending_requests(probe, server.url) < IN_FLIGHT + 1:
                    assert time.monotonic() < deadline, "requests never all reached the queue"
                    assert not blocker.done(), "the blocker finished before all were queued"
                    await asyncio.sleep(0.02)

            server.process.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            async with httpx.AsyncClient(timeout=5) as fresh:
                after = {
                    "ready": await fresh.get(f"{server.url}/v2/health/ready"),
                    "live": await fresh.get(f"{server.url}/v2/health/live"),
                    "new connection": await fresh.post(url, json=infer_body(7.0)),
                    "kept-alive connection": await kept_alive.post(url, json=infer_body(7.0)),
                }
            refused_at = time.monotonic()
            accepted = await asyncio.gather(*small)
            code = await asyncio.to_thread(server.process.wait, drained.drain_timeout_s + 15)
            return Outcome(
                await blocker, accepted, after, signalled_at, refused_at, code, time.monotonic()
            )

    return asyncio.run(scenario())


def assert_refused_during_drain(outcome: Outcome) -> None:
    assert outcome.after["ready"].status_code == 503
    assert outcome.after["ready"].json() == {"ready": False}
    assert outcome.after["live"].status_code == 200, "liveness must hold during a drain"
    for what in ("new connection", "kept-alive connection"):
        response = outcome.after[what]
        assert response.status_code == 503, (what, response.status_code, response.text)
        assert set(response.json()) == {"error"} and "shutting down" in response.json()["error"]


@pytest.mark.slow
@pytest.mark.parametrize("drained", [20.0], indirect=True)
def test_sigterm_drains_every_accepted_request_and_exits_0(drained: Drained) -> None:
    outcome = drain_under_load(drained)

    assert_refused_during_drain(outcome)
    assert outcome.blocker.status_code == 200
    assert answer(outcome.blocker) == pytest.approx(drained.blocker_m * WIDTH)
    assert len(outcome.accepted) == IN_FLIGHT
    for x, response, _ in outcome.accepted:
        assert response.status_code == 200, response.text
        assert answer(response) == pytest.approx(x * WIDTH), "each request gets its own answer"
    # The refusals came while accepted requests were still waiting for their answers: the
    # listener stayed open during the drain instead of closing at the signal.
    assert max(at for _, _, at in outcome.accepted) > outcome.refused_at
    assert outcome.exit_code == 0, drained.server.log.read_text()[-3000:]
    assert outcome.exited_at - outcome.signalled_at < drained.drain_timeout_s
    log = drained.server.log.read_text()
    assert "Traceback" not in log and "drain timeout" not in log


@pytest.mark.slow
@pytest.mark.parametrize("drained", [0.5], indirect=True)
def test_drain_timeout_answers_what_is_left_with_503_and_exits_0(drained: Drained) -> None:
    """The blocker outlives the drain timeout: it still finishes (a running batch cannot be
    interrupted), the requests still queued get 503, nobody gets a dropped connection."""
    outcome = drain_under_load(drained)

    assert_refused_during_drain(outcome)
    assert outcome.blocker.status_code == 200
    statuses = [response.status_code for _, response, _ in outcome.accepted]
    assert set(statuses) == {503}, "queued behind the blocker past the timeout"
    assert all("shutting down" in r.json()["error"] for _, r, _ in outcome.accepted)
    assert outcome.exit_code == 0, drained.server.log.read_text()[-3000:]
    assert outcome.exited_at - outcome.signalled_at < BLOCKER_SECONDS + 5
    assert "drain timeout" in drained.server.log.read_text()


@pytest.mark.slow
def test_sigterm_during_an_int8_build_stops_it_and_leaves_the_store_clean(
    tmp_path: Path, efficientnet_dir: Path
) -> None:
    """A first start calibrating 480 rows (a minute of work on two cores) gets SIGTERM a few
    strides in: the process exits 0 within seconds, not when calibration would have ended,
    and the store holds no variant, no ranges and no half-written file."""
    repository = tmp_path / "repository"
    shutil.copytree(efficientnet_dir, repository / "efficientnet_lite0")
    configure(
        repository / "efficientnet_lite0",
        {"int8": {"samples": 480}, "accuracy": {"evaluation_samples": 16}},
    )
    store = tmp_path / "store"  # launch_server's store, beside its log
    log = tmp_path / "server.log"
    process = launch_server(repository, log).process
    try:
        deadline = time.monotonic() + 120
        while "calibrating (percentile) 32/480" not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "calibration never started"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = process.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert took < 15, f"exited {took:.1f} s after SIGTERM"
    assert "calibration stopped at" in text and "(shutting down)" in text
    assert "calibrating (percentile) 96/480" not in text
    assert "Traceback" not in text
    leftovers = [p.name for p in store.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert leftovers == [], leftovers
