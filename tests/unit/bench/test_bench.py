"""The bench without a server: statistics, the /metrics arithmetic, payloads the codec
accepts, and the report's files."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from PIL import Image
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartParser

from app.frontend.grpc.codec import read_request, request_body
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.protocol import decode_request
from bench import payloads, report
from bench.cli import levels, parse_args, plans, protocols
from bench.grpc_client import stream_failed
from bench.loadgen import Samples, Step, StepResult, merge, split, summarize
from bench.payloads import ModelInputs
from bench.scrape import ServerStats, step_stats
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec

IMAGE_MODEL = ModelInputs("img", (TensorSpec("input", "FP32", (3, 32, 32)),), batched=True)


def test_percentiles_come_from_every_sample() -> None:
    latencies = np.arange(1, 1001, dtype=np.float64) / 1000  # 1 ms ... 1000 ms
    summary = summarize(latencies)
    assert summary["p50"] == pytest.approx(500.5)
    assert summary["p99"] == pytest.approx(990.01)
    assert summary["p99.9"] == pytest.approx(999.001)
    assert summary["max"] == pytest.approx(1000.0)
    assert summary["mean"] == pytest.approx(500.5)
    assert all(v is None for v in summarize(np.empty(0)).values())


def test_workers_merge_into_one_step() -> None:
    step = Step("closed", concurrency=3, duration_s=2.0)
    parts = [
        Samples(np.full(100, 0.01), 100, 200, {"200": 100, "429": 3}, cpu_s=0.5),
        Samples(np.full(300, 0.03), 300, 600, {"200": 300, "error:ClientOSError": 1}, 0.7),
    ]
    result = merge(step, parts)
    assert result.requests == 400 and result.rows == 800
    assert result.throughput == 200.0 and result.rows_per_s == 400.0
    assert result.statuses == {"200": 400, "429": 3, "error:ClientOSError": 1}
    assert result.errors == 4
    assert result.client_cpu == pytest.approx(0.6)
    assert result.latency_ms["p50"] == pytest.approx(30.0)
    assert result.server == ServerStats()


def test_clients_split_evenly_over_workers() -> None:
    assert split(10, 4) == [3, 3, 2, 2]
    assert split(1, 3) == [1, 0, 0]
    assert sum(split(256, 7)) == 256


def test_concurrency_levels_parse() -> None:
    assert levels("1,2,4") == [1, 2, 4]
    assert levels("none") == []
    with pytest.raises(ValueError):
        levels("0,4")


def test_a_url_may_carry_its_target_name() -> None:
    args = parse_args(
        ["--url", "this=http://127.0.0.1:1/?a=b", "--url", "http://h:2", "--model", "m"]
    )
    assert [(p.name, p.url) for p in plans(args)] == [
        ("this", "http://127.0.0.1:1/?a=b"),
        ("target2", "http://h:2"),
    ]


STOKER_BEFORE = """\
# TYPE stoker_inference_batch_size histogram
stoker_inference_batch_size_count{model="m",version="fp32"} 10
stoker_inference_batch_size_sum{model="m",version="fp32"} 40
stoker_inference_batch_size_count{model="other",version="fp32"} 5
stoker_inference_batch_size_sum{model="other",version="fp32"} 5
# TYPE stoker_inference_queue_duration_seconds histogram
stoker_inference_queue_duration_seconds_count{model="m",version="fp32"} 40
stoker_inference_queue_duration_seconds_sum{model="m",version="fp32"} 0.2
# TYPE stoker_inference_compute_infer_duration_seconds histogram
stoker_inference_compute_infer_duration_seconds_count{model="m",version="fp32"} 40
stoker_inference_compute_infer_duration_seconds_sum{model="m",version="fp32"} 0.4
# TYPE stoker_inference_exec_count counter
stoker_inference_exec_count_total{model="m",version="fp32"} 10
"""
STOKER_AFTER = """\
# TYPE stoker_inference_batch_size histogram
stoker_inference_batch_size_count{model="m",version="fp32"} 30
stoker_inference_batch_size_sum{model="m",version="fp32"} 200
stoker_inference_batch_size_count{model="other",version="fp32"} 500
stoker_inference_batch_size_sum{model="other",version="fp32"} 500
# TYPE stoker_inference_queue_duration_seconds histogram
stoker_inference_queue_duration_seconds_count{model="m",version="fp32"} 200
stoker_inference_queue_duration_seconds_sum{model="m",version="fp32"} 0.52
# TYPE stoker_inference_compute_infer_duration_seconds histogram
stoker_inference_compute_infer_duration_seconds_count{model="m",version="fp32"} 200
stoker_inference_compute_infer_duration_seconds_sum{model="m",version="fp32"} 2.0
# TYPE stoker_inference_exec_count counter
stoker_inference_exec_count_total{model="m",version="fp32"} 30
"""


def test_stoker_metrics_give_the_step_means_of_the_model_asked_for() -> None:
    stats = step_stats(STOKER_BEFORE, STOKER_AFTER, model="m")
    assert stats.mean_batch_size == pytest.approx(160 / 20)
    assert stats.queue_ms == pytest.approx(0.32 / 160 * 1e3)
    assert stats.compute_infer_ms == pytest.approx(1.6 / 160 * 1e3)
    assert stats.executions == 20
    assert stats.request_ms is None  # not in this scrape
    everything = step_stats(STOKER_BEFORE, STOKER_AFTER)
    assert everything.mean_batch_size == pytest.approx((160 + 495) / (20 + 495))


def test_triton_counters_give_the_same_means() -> None:
    before = """\
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 100
# TYPE nv_inference_count counter
nv_inference_count{model="m",version="1"} 100
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="m",version="1"} 25
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="m",version="1"} 1000
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="m",version="1"} 5000
"""
    after = (
        before.replace("} 100", "} 300")
        .replace("} 25", "} 50")
        .replace("} 1000", "} 3000")
        .replace("} 5000", "} 25000")
    )
    stats = step_stats(before, after, model="m")
    assert stats.mean_batch_size == pytest.approx(200 / 25)
    assert stats.queue_ms == pytest.approx(2000 / 200 / 1000)
    assert stats.compute_infer_ms == pytest.approx(20000 / 200 / 1000)


def test_a_server_without_these_metrics_gives_none() -> None:
    other = "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 3.0\n"
    assert step_stats(other, other) == ServerStats()
    assert step_stats(None, None) == ServerStats()


def image_bytes(count: int) -> list[bytes]:
    return payloads.synthetic_images(count, 64, 48)


def test_synthetic_images_are_decodable_jpegs() -> None:
    images = image_bytes(3)
    assert len(set(images)) == 3
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.size == (64, 48)


@pytest.mark.parametrize("kind", ["v2-json", "v2-binary"])
def test_v2_payloads_decode_to_the_preprocessed_rows(kind: payloads.Kind) -> None:
    built = payloads.build(kind, image_bytes(4), rows=3, count=2, model=IMAGE_MODEL)
    tensors = payloads.model_tensors(IMAGE_MODEL, image_bytes(4), rows=3, count=2)
    spec = ModelSpec("img", IMAGE_MODEL.inputs, (), max_batch_size=8)
    assert len(built) == 2
    for payload, expected in zip(built, tensors, strict=True):
        length = payload.headers.get("Inference-Header-Content-Length")
        request = decode_request(payload.body, int(length) if length else None, spec)
        assert payload.rows == 3
        np.testing.assert_allclose(request.inputs["input"], expected["input"], rtol=1e-6)
        assert request.inputs["input"].shape == (3, 3, 32, 32)
        if kind == "v2-binary":
            assert request.binary_data_output


@pytest.mark.parametrize("kind", ["v2-json", "v2-binary"])
def test_grpc_payloads_are_requests_the_server_reads_as_the_same_rows(kind: payloads.Kind) -> None:
    built = payloads.build(
        kind, image_bytes(4), rows=3, count=2, model=IMAGE_MODEL, protocol="grpc", version="fp16"
    )
    tensors = payloads.model_tensors(IMAGE_MODEL, image_bytes(4), rows=3, count=2)
    spec = ModelSpec("img", IMAGE_MODEL.inputs, (), max_batch_size=8)
    for payload, expected in zip(built, tensors, strict=True):
        call = read_request(payload.body)
        assert (call.request.model_name, call.request.model_version) == ("img", "fp16")
        assert len(call.raw) == (1 if kind == "v2-binary" else 0)  # typed contents otherwise
        header, chunks = request_body(call, spec)  # typed contents are counted by the spec
        request = decode_request(b"".join([header, *chunks]), len(header), spec)
        np.testing.assert_allclose(request.inputs["input"], expected["input"], rtol=1e-6)
        assert payload.rows == 3 and request.inputs["input"].shape == (3, 3, 32, 32)
    with pytest.raises(ValueError, match="no image upload"):
        payloads.build("jpeg", image_bytes(1), 1, 1, protocol="grpc")


def test_protocols_parse() -> None:
    assert protocols("http") == ["http"]
    assert protocols("grpc, HTTP,grpc") == ["grpc", "http"]
    assert protocols("grpc-stream,http,GRPC-stream") == ["grpc-stream", "http"]
    assert protocols("http,websocket") == []


def test_a_stream_answer_that_carries_an_error_message_is_a_failure() -> None:
    """``stream_failed`` reads ModelStreamInferResponses as protobuf writes them: an answer
    (whatever its fields' order and size), an empty error_message, and an error beside an
    echoed request are told apart."""
    answer = pb.ModelInferResponse(model_name="tiny", model_version="fp32", id="x" * 300)
    answer.outputs.add(name="y", datatype="FP32", shape=[1, 3])
    answer.raw_output_contents.append(b"\x00" * 200_000)
    good = pb.ModelStreamInferResponse(infer_response=answer).SerializeToString()
    empty = pb.ModelStreamInferResponse(error_message="", infer_response=answer)
    failed = pb.ModelStreamInferResponse(
        error_message="no model 'nope'", infer_response=pb.ModelInferResponse(id="a")
    ).SerializeToString()
    assert not stream_failed(good)
    assert not stream_failed(empty.SerializeToString())
    assert stream_failed(failed)
    assert stream_failed(good + failed)  # fields may come in any order


def test_non_image_inputs_get_random_tensors() -> None:
    model = ModelInputs(
        "t", (TensorSpec("x", "FP32", (4,)), TensorSpec("ids", "INT64", (-1,))), batched=True
    )
    (tensors,) = payloads.model_tensors(model, [], rows=2, count=1)
    assert tensors["x"].shape == (2, 4) and tensors["ids"].shape == (2, 1)
    assert tensors["ids"].dtype == np.int64
    with pytest.raises(ValueError, match="no batch dimension"):
        payloads.model_tensors(ModelInputs("u", model.inputs, batched=False), [], 2, 1)


def test_jpeg_uploads_are_forms_a_server_parses() -> None:
    images = image_bytes(3)
    single = payloads.jpeg_upload(images[:1])
    assert single.body == images[0] and single.headers["Content-Type"] == "image/jpeg"
    form = payloads.jpeg_upload(images)

    async def parse() -> list[bytes]:
        async def stream() -> AsyncGenerator[bytes, None]:
            yield form.body

        parsed = await MultiPartParser(Headers(form.headers), stream()).parse()
        return [await v.read() for _, v in parsed.multi_items() if isinstance(v, UploadFile)]

    assert asyncio.run(parse()) == images and form.rows == 3


def test_metadata_marks_the_batch_dimension() -> None:
    metadata = {
        "name": "m",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
    }
    model = ModelInputs.from_metadata(metadata)
    assert model.batched and model.inputs[0].shape == (3, 224, 224)
    unbatched = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}]}
    fixed = ModelInputs.from_metadata(unbatched)
    assert not fixed.batched and fixed.inputs[0].shape == (3,)


def sample_result(concurrency: int, throughput: float, p50: float) -> StepResult:
    latency = {"p50": p50, "p90": p50 * 1.5, "p99": p50 * 2, "p99.9": p50 * 3}
    return StepResult(
        step=Step("closed", concurrency, duration_s=1.0),
        requests=int(throughput),
        rows=int(throughput),
        throughput=throughput,
        rows_per_s=throughput,
        latency_ms={**latency, "mean": p50, "max": p50 * 4},
        statuses={"200": int(throughput)},
        client_cpu=0.1,
        server=ServerStats(mean_batch_size=2.0, queue_ms=1.0, compute_infer_ms=5.0),
    )


def test_report_writes_table_json_and_plots(tmp_path: Path) -> None:
    fast = report.TargetResult("stoker", "", [sample_result(c, 100.0 * c, 10.0) for c in (1, 4)])
    slow = report.TargetResult("naive", "", [sample_result(c, 50.0, 10.0 * c) for c in (1, 4)])
    line = report.row("stoker", fast.steps[1])
    assert "c=4" in line and "400.0" in line and "2.00" in line
    assert any("8.00x" in text for text in report.comparison([fast, slow]))

    report.write_json(tmp_path / "out.json", [fast, slow], {"duration": 1.0}, ["stoker", "bench"])
    document = orjson.loads((tmp_path / "out.json").read_bytes())
    assert document["machine"]["cores"] >= 1
    assert document["targets"][0]["steps"][1]["latency_ms"]["p99"] == 20.0
    assert document["ratios"][1] == {
        "numerator": "stoker",
        "denominator": "naive",
        "concurrency": 4,
        "throughput_ratio": 8.0,
        "rounds": [8.0],
    }

    written = report.write_plots(tmp_path / "plots", [fast, slow], "test")
    assert [p.name for p in written] == ["throughput.png", "latency.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_over_rounds_the_comparison_gives_the_median_of_each_rounds_ratio() -> None:
    """Round i of one target is compared with round i of the other: ratios 2, 4 and 9 (a
    noisy round) give a median of 4, not the ratio of the mean rates."""
    fast = report.TargetResult("stoker", "", [sample_result(1, r, 10.0) for r in (2, 8, 90)])
    slow = report.TargetResult("direct", "", [sample_result(1, r, 10.0) for r in (1, 2, 10)])
    lines = report.comparison([fast, slow])
    assert any("median  4.00x of 3 rounds (2.00, 4.00, 9.00)" in line for line in lines)
    (ratio,) = report.ratios_json([fast, slow])
    assert ratio["throughput_ratio"] == 4.0 and ratio["rounds"] == [2.0, 4.0, 9.0]


def test_without_the_bench_extra_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from bench import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp" else real(name)
    )
    assert cli.main(["--url", "http://127.0.0.1:9"]) == 2
    error = capsys.readouterr().err
    assert "needs aiohttp (the bench extra)" in error and "install -e '.[bench]'" in error


def test_each_stream_in_flight_has_a_connection_of_its_own() -> None:
    """``--protocol grpc-stream``: requests in flight at once each get a stream on a channel
    (a connection) of its own, as unary calls do, and a stream freed by its answer is used
    again rather than opening another (grpc's channels replaced by ones that record where
    each stream is opened)."""
    from bench.grpc_client import GrpcClient, GrpcTarget
    from bench.payloads import Payload

    answered = pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id="x"))

    class Stream:
        def __init__(self, channel: int, release: asyncio.Event) -> None:
            self.channel, self.release = channel, release

        async def write(self, body: bytes) -> None:
            assert body == b"request"

        async def read(self) -> bytes:
            await self.release.wait()
            return answered.SerializeToString()

        def cancel(self) -> None:
            raise AssertionError("no stream fails here")

    async def scenario() -> tuple[list[int], int]:
        client = GrpcClient(GrpcTarget("127.0.0.1:1", "http://127.0.0.1:1", stream=True))
        release = asyncio.Event()
        opened: list[int] = []

        class Channel:
            def __init__(self, number: int) -> None:
                self.number = number

            def stream_stream(self, method: str) -> Any:
                assert method.endswith("/ModelStreamInfer")
                opened.append(self.number)
                return lambda: Stream(self.number, release)

            async def close(self) -> None:
                pass

        def fake_open() -> None:
            client._channels.append(Channel(len(client._channels)))

        client._open = fake_open  # type: ignore[method-assign]
        sends = [asyncio.create_task(client.send(Payload(1, b"request"))) for _ in range(3)]
        for _ in range(20):
            await asyncio.sleep(0)
        release.set()
        statuses = await asyncio.gather(*sends)
        again = await client.send(Payload(1, b"request"))  # a freed stream, no new one
        await client._session.close()
        return opened, len(client._channels) if statuses == [200] * 3 and again == 200 else -1

    opened, channels = asyncio.run(scenario())
    assert opened == [0, 1, 2] and channels == 3


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_rows_of_requests_cycling_through_fewer_images_all_differ(
    layout: Literal["NCHW", "NHWC"],
) -> None:
    """32-row requests made from 8 images: every row of every request is a different input
    (the images' views, ``payloads.variant``), so a row answered in another's place shows
    under ``--check-answers``; the first cycle is the images themselves."""
    shape = (3, 32, 32) if layout == "NCHW" else (32, 32, 3)
    model = ModelInputs("m", (TensorSpec("x", "UINT8", shape),), True)
    prep = ImagePreprocess(resize_shorter=32, crop=32, layout=layout, datatype="UINT8")
    images = payloads.synthetic_images(8, 48, 40)
    sets = payloads.model_tensors(model, images, rows=32, count=4, configured=prep)
    rows = np.concatenate([s["x"] for s in sets])
    assert rows.shape == (128, *shape)
    assert len({row.tobytes() for row in rows}) == 128
    first = payloads.model_tensors(model, images, rows=8, count=1, configured=prep)[0]["x"]
    np.testing.assert_array_equal(rows[:8], first)
