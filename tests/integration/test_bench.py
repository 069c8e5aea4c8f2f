"""The bench measured against servers whose answers are known.

A tiny V2 server sleeps a fixed delay per request (real uvicorn, free port): the bench's
latency percentiles must sit on that delay, and its throughput on concurrency / delay. A
``serial`` model answers one request at a time, so its capacity is 1 / delay and the rate
search has a known ceiling. Against a real Stoker, the /metrics scrape gives batch sizes
and times; the naive server and the in-process target answer without errors.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench import cli, payloads
from bench.launch import free_port
from bench.loadgen import HttpTarget, Step, Workers
from bench.payloads import ModelInputs
from tests.conftest import tiny_model
from tests.integration.conftest import Server

DELAY_S = 0.05
SERIAL_DELAY_S = 0.01
METADATA = {
    "name": "sleepy",
    "versions": ["1"],
    "platform": "test",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
}
ANSWER = orjson.dumps(
    {"model_name": "sleepy", "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 4]}]}
)


def delay_app() -> Starlette:
    one_at_a_time = asyncio.Semaphore(1)
    mixed = 0

    async def ready(_: Request) -> Response:
        return Response(b'{"ready": true}', media_type="application/json")

    async def metadata(request: Request) -> Response:
        return Response(orjson.dumps({**METADATA, "name": request.path_params["name"]}))

    async def infer(request: Request) -> Response:
        nonlocal mixed
        body = await request.body()
        if request.path_params["name"] == "mixer":
            # y = 2x, right for the first MIXER_RIGHT requests, then its rows reversed: the
            # answer of a server that puts a batch's rows back in the wrong places.
            mixed += 1
            return mixer_answer(request, body, reverse=mixed > MIXER_RIGHT)
        if request.path_params["name"] == "serial":
            async with one_at_a_time:
                await asyncio.sleep(SERIAL_DELAY_S)
        else:
            await asyncio.sleep(DELAY_S)
        return Response(ANSWER, media_type="application/json")

    async def upload(request: Request) -> Response:
        async with request.form() as form:
            images = [v for _, v in form.multi_items() if not isinstance(v, str)]
        if not images:
            return Response(b'{"error": "no image"}', status_code=400)
        await asyncio.sleep(DELAY_S)
        return Response(orjson.dumps({"images": len(images)}), media_type="application/json")

    return Starlette(
        routes=[
            Route("/v2/health/ready", ready),
            Route("/v2/models/{name}", metadata),
            Route("/v2/models/{name}/infer", infer, methods=["POST"]),
            Route("/infer", upload, methods=["POST"]),
        ]
    )


MIXER_RIGHT = 4


def mixer_answer(request: Request, body: bytes, reverse: bool) -> Response:
    """A V2 binary answer of ``y = 2x`` to a V2 binary request of FP32 ``x``."""
    length = int(request.headers["inference-header-content-length"])
    (entry,) = orjson.loads(body[:length])["inputs"]
    y = 2 * np.frombuffer(body, np.float32, offset=length).reshape(entry["shape"])
    y = y[::-1] if reverse else y
    output = {"name": "y", "datatype": "FP32", "shape": list(y.shape)}
    header = orjson.dumps({"outputs": [{**output, "parameters": {"binary_data_size": y.nbytes}}]})
    headers = {"Inference-Header-Content-Length": str(len(header))}
    return Response(header + y.tobytes(), headers=headers, media_type="application/octet-stream")


@pytest.fixture(scope="module")
def sleepy() -> Iterator[str]:
    """The delay server under a real uvicorn, in a thread of this process (the bench's
    clients run in their own processes)."""
    port = free_port()
    config = uvicorn.Config(delay_app(), port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "delay server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def tensor_payloads(count: int = 4) -> list[payloads.Payload]:
    model = ModelInputs.from_metadata(METADATA)
    return payloads.build("v2-binary", [], rows=1, count=count, model=model)


def test_closed_loop_latency_and_throughput_match_the_delay(sleepy: str) -> None:
    target = HttpTarget(sleepy, "/v2/models/sleepy/infer")
    with Workers(target, tensor_payloads(), count=2) as workers:
        results = [workers.run(Step("closed", c, warmup_s=0.3, duration_s=1.5)) for c in (2, 16)]
    for result in results:
        c, seen, ms = result.step.concurrency, result.as_json(), DELAY_S * 1e3
        latency = result.latency_ms
        assert result.errors == 0 and result.statuses == {"200": result.requests}, seen
        # A closed loop of c clients over a fixed delay cannot pass c / delay; a stall of
        # this shared machine can only slow it, so the bounds below are one-sided and loose
        # where a stall lands (the tail), tight where the measurement itself would be wrong.
        assert 0.6 * c / DELAY_S <= result.throughput <= 1.05 * c / DELAY_S, seen
        assert ms <= latency["p50"] <= ms + 25, seen  # type: ignore[operator]
        assert ms <= latency["p99"] <= 10 * ms, seen  # type: ignore[operator]
        assert latency["max"] >= latency["p99.9"] >= latency["p99"] >= latency["p90"], seen  # type: ignore[operator]
        # No /metrics on this server: the scrape says nothing rather than failing.
        assert result.server.mean_batch_size is None


def test_open_loop_offers_the_poisson_rate(sleepy: str) -> None:
    target = HttpTarget(sleepy, "/v2/models/sleepy/infer")
    with Workers(target, tensor_payloads(), count=1) as workers:
        result = workers.run(Step("open", rate=150.0, warmup_s=0.3, duration_s=3.0))
    seen, ms = result.as_json(), DELAY_S * 1e3
    assert result.errors == 0, seen
    assert result.throughput == pytest.approx(150.0, rel=0.2), seen
    assert ms <= result.latency_ms["p50"] <= ms + 25, seen  # type: ignore[operator]


def test_jpeg_forms_reach_the_server_whole(sleepy: str) -> None:
    images = payloads.synthetic_images(4, 320, 240)
    built = payloads.build("jpeg", images, rows=2, count=4)
    with Workers(HttpTarget(sleepy, "/infer"), built, count=1) as workers:
        result = workers.run(Step("closed", 4, warmup_s=0.2, duration_s=1.0))
    assert result.errors == 0 and result.requests > 0
    assert result.rows == 2 * result.requests


def test_rate_search_stays_under_a_serial_servers_capacity(sleepy: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = cli.main(
        [
            *("--url", sleepy, "--model", "serial", "--concurrency", "4"),
            *("--find-rate", "--p99-target-ms", "60", "--search-steps", "4"),
            *("--duration", "1", "--warmup", "0.3", "--distinct", "2"),
            *("--json", str(out), "--plots", str(tmp_path / "plots")),
        ]
    )
    assert code == 0
    document = orjson.loads(out.read_bytes())
    (target,) = document["targets"]
    capacity = 1 / SERIAL_DELAY_S
    assert 0.6 * capacity <= target["steps"][0]["throughput"] <= 1.05 * capacity
    found = target["find_rate"]["rate"]
    assert found is not None and 0.3 * capacity <= found <= capacity
    assert target["find_rate"]["step"]["latency_ms"]["p99"] <= 60
    assert (tmp_path / "plots" / "throughput.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("payload", "client"), [("v2-binary", "raw"), ("v2-json", "aiohttp")], ids=["binary", "json"]
)
def test_every_answer_of_a_real_stoker_is_its_requests(
    server: Server, tmp_path: Path, payload: str, client: str
) -> None:
    """``--check-answers`` against a real Stoker batching 3-row requests of 8 clients: every
    answer decoded and each row found equal to the request's answer alone."""
    out = tmp_path / "bench.json"
    argv = ["--url", server.url, "--model", "tiny", "--payload", payload, "--rows", "3"]
    argv += ["--concurrency", "8", "--duration", "1", "--warmup", "0.3", "--check-answers"]
    assert cli.main([*argv, "--http-client", client, "--json", str(out)]) == 0
    (step,) = orjson.loads(out.read_bytes())["targets"][0]["steps"]
    assert step["requests"] > 0 and step["statuses"] == {"200": step["requests"]}, step
    assert step["server"]["mean_batch_size"] > 3  # requests were batched together


def test_an_answer_with_rows_out_of_place_is_a_wrong_answer(sleepy: str, tmp_path: Path) -> None:
    """A server whose 200s under load carry the request's rows reversed: every such answer is
    counted as ``wrong-answer``, an error, none as a success."""
    out = tmp_path / "bench.json"
    argv = ["--url", sleepy, "--model", "mixer", "--payload", "v2-binary", "--rows", "3"]
    argv += ["--distinct", str(MIXER_RIGHT), "--concurrency", "2", "--duration", "0.5"]
    argv += ["--warmup", "0.2", "--check-answers", "--json", str(out)]
    assert cli.main(argv) == 0
    (step,) = orjson.loads(out.read_bytes())["targets"][0]["steps"]
    assert step["requests"] == 0 and step["errors"] > 0, step
    assert set(step["statuses"]) == {"wrong-answer"}, step


def test_stoker_metrics_give_batch_size_and_times(server: Server) -> None:
    metadata = cli.fetch_json(f"{server.url}/v2/models/tiny")
    built = payloads.build("v2-binary", [], 2, 8, ModelInputs.from_metadata(metadata))
    target = HttpTarget(server.url, "/v2/models/tiny/infer")
    with Workers(target, built, count=1, model="tiny") as workers:
        result = workers.run(Step("closed", 8, warmup_s=0.3, duration_s=1.0))
    assert result.errors == 0 and result.rows == 2 * result.requests
    stats = result.server
    assert stats.mean_batch_size is not None and 2 <= stats.mean_batch_size <= 16
    assert stats.queue_ms is not None and stats.queue_ms >= 0
    assert stats.compute_infer_ms is not None and stats.compute_infer_ms > 0
    assert stats.inferences is not None and stats.inferences >= result.rows * 0.8


@pytest.fixture
def tiny_repository(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "tiny"
    tiny_model(folder)
    return tmp_path / "models"


def test_naive_and_in_process_targets_in_one_run(tiny_repository: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = cli.main(
        [
            *("--naive", "--in-process", "--repository", str(tiny_repository)),
            *("--model", "tiny", "--concurrency", "4", "--duration", "1", "--warmup", "0.3"),
            *("--json", str(out)),
        ]
    )
    assert code == 0
    document = orjson.loads(out.read_bytes())
    naive, raw = document["targets"]
    assert [naive["name"], raw["name"]] == ["naive", "in-process"]
    for target in (naive, raw):
        (step,) = target["steps"]
        assert step["errors"] == 0 and step["throughput"] > 10
    assert naive["steps"][0]["server"]["mean_batch_size"] is None
    assert raw["steps"][0]["server"]["mean_batch_size"] >= 1
    (ratio,) = document["ratios"]
    assert ratio["numerator"] == "naive" and ratio["denominator"] == "in-process"
    assert np.isfinite(ratio["throughput_ratio"])


def test_the_direct_target_runs_batches_of_c_rows_round_after_round(
    tiny_repository: Path, tmp_path: Path
) -> None:
    """ONNX Runtime called directly: at c=4 each run answers four requests at once (their
    latencies are the runs' own, so the four of a run are equal), in every round."""
    out = tmp_path / "bench.json"
    code = cli.main(
        [
            *("--in-process", "--direct", "--repository", str(tiny_repository)),
            *("--model", "tiny", "--concurrency", "1,4", "--duration", "0.5", "--warmup", "0.2"),
            *("--rounds", "2", "--json", str(out)),
        ]
    )
    assert code == 0
    document = orjson.loads(out.read_bytes())
    _, direct = document["targets"]
    assert direct["name"] == "direct"
    assert [s["concurrency"] for s in direct["steps"]] == [1, 4, 1, 4]
    for step in direct["steps"]:
        assert step["errors"] == 0 and step["requests"] > 0
        assert step["requests"] % step["concurrency"] == 0  # whole batches of c requests
    ratios = [r for r in document["ratios"] if r["denominator"] == "direct"]
    assert [r["concurrency"] for r in ratios] == [1, 4]
    for ratio in ratios:
        assert len(ratio["rounds"]) == 2
        assert ratio["throughput_ratio"] == pytest.approx(sum(ratio["rounds"]) / 2)


def test_uint8_pixels_reach_the_naive_server_and_the_batcher(
    efficientnet_dir: Path, tmp_path: Path
) -> None:
    """``--uint8`` sends the image input as pixels; on ONNX Runtime the service normalises
    them, and every request of both targets is answered."""
    import shutil

    from tests.conftest import configure

    repository = tmp_path / "repo"
    shutil.copytree(efficientnet_dir, repository / "efficientnet_lite0")
    configure(repository / "efficientnet_lite0", {"precisions": ["fp32"]})
    out = tmp_path / "bench.json"
    argv = [
        *("--naive", "--in-process", "--repository", str(repository), "--uint8"),
        *("--model", "efficientnet_lite0", "--rows", "2", "--image-size", "320x240"),
        *("--concurrency", "2", "--duration", "1", "--warmup", "0.3", "--distinct", "2"),
        *("--json", str(out)),
    ]
    model = cli.in_process_inputs(repository, "efficientnet_lite0")
    sent = cli.PayloadCache(cli.parse_args(argv)).get("tensors", model)
    assert all(p.tensors is not None and p.tensors["input"].dtype == np.uint8 for p in sent)
    assert cli.main(argv) == 0
    for target in orjson.loads(out.read_bytes())["targets"]:
        (step,) = target["steps"]
        assert step["errors"] == 0 and step["requests"] > 0


def test_jpeg_uploads_run_in_process_through_the_models_handler(
    efficientnet_dir: Path, tmp_path: Path
) -> None:
    """``--in-process --payload jpeg``: the uploads are decoded by the model's own handler
    and run through its batcher (the in-process decode, resize and infer pipeline the
    service's JPEG route is compared with); every request is answered with its rows."""
    import shutil

    from tests.conftest import configure

    repository = tmp_path / "repo"
    shutil.copytree(efficientnet_dir, repository / "efficientnet_lite0")
    configure(repository / "efficientnet_lite0", {"precisions": ["fp32"]})
    out = tmp_path / "bench.json"
    argv = [
        *("--in-process", "--repository", str(repository), "--payload", "jpeg"),
        *("--model", "efficientnet_lite0", "--rows", "3", "--image-size", "320x240"),
        *("--concurrency", "2", "--duration", "1", "--warmup", "0.3", "--distinct", "2"),
        *("--json", str(out)),
    ]
    sent = cli.PayloadCache(cli.parse_args(argv)).get("jpeg", None)
    assert all(len(p.images) == 3 and p.images[0][:2] == b"\xff\xd8" for p in sent)
    assert cli.main(argv) == 0
    (target,) = orjson.loads(out.read_bytes())["targets"]
    (step,) = target["steps"]
    assert target["name"] == "in-process"
    assert step["errors"] == 0 and step["requests"] > 0
    assert step["rows"] == 3 * step["requests"]
    assert step["server"]["mean_batch_size"] >= 3  # the three images of a request together
