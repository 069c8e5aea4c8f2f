"""The metrics as a scraper reads them: Prometheus text from the default registry, parsed.

The default registry is process-wide and other tests record into it too, so every test here
uses model names of its own and reads only its own series.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from app.frontend.totals import labelled_metrics, merged_statistics
from app.metrics import (
    BATCH_BUCKETS,
    GPU_METRICS,
    LATENCY_BUCKETS,
    TRITON_GPU_METRICS,
    BatchTimes,
    GpuCollector,
    ModelMetrics,
    model_unavailable,
)
from engines.devices.nvml import GpuSample

REASONS = ("invalid", "rejected", "timeout", "cancelled", "backend", "unavailable")


def unique_model() -> str:
    return f"metrics-{uuid.uuid4().hex[:12]}"


def scrape(registry: CollectorRegistry = REGISTRY) -> list[Sample]:
    text = generate_latest(registry).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def series(model: str, registry: CollectorRegistry = REGISTRY) -> dict[tuple[str, ...], float]:
    """This model's samples as {(sample name, other label values sorted by label name...): v}."""
    found = {}
    for s in scrape(registry):
        if s.labels.get("model") != model:
            continue
        others = tuple(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
        found[(s.name, *others)] = s.value
    return found


def test_a_new_model_has_every_failure_reason_at_zero() -> None:
    """Dashboards' rate() sees a zero, not a gap, before the first failure."""
    model = unique_model()
    ModelMetrics(model, "fp32")
    got = series(model)
    failures = {k: v for k, v in got.items() if k[0] == "stoker_inference_request_failure_total"}
    assert failures == {
        ("stoker_inference_request_failure_total", f"reason={r}", "version=fp32"): 0.0
        for r in REASONS
    }
    assert got[("stoker_inference_request_success_total", "version=fp32")] == 0.0
    assert got[("stoker_inference_count_total", "version=fp32")] == 0.0
    assert got[("stoker_inference_exec_count_total", "version=fp32")] == 0.0
    assert got[("stoker_inference_pending_request_count", "version=fp32")] == 0.0


def test_successes_count_and_time_requests() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp16")
    durations = (0.0004, 0.004, 0.04, 40.0)
    for seconds in durations:
        metrics.request_succeeded(seconds)
    got = series(model)
    assert got[("stoker_inference_request_success_total", "version=fp16")] == len(durations)
    name = "stoker_inference_request_duration_seconds"
    assert got[(f"{name}_count", "version=fp16")] == len(durations)
    assert got[(f"{name}_sum", "version=fp16")] == pytest.approx(sum(durations))
    for le in LATENCY_BUCKETS:
        assert got[(f"{name}_bucket", f"le={le}", "version=fp16")] == sum(
            d <= le for d in durations
        )
    assert got[(f"{name}_bucket", "le=+Inf", "version=fp16")] == len(durations)
    # Only the fp16 version moved: no fp32 series was made on the fly.
    assert all(k[-1] == "version=fp16" for k in got)


def test_failures_are_counted_by_reason() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp32")
    for reason in ("rejected", "rejected", "timeout"):
        metrics.request_failed(reason, 0.01)
    got = series(model)
    failures = {k[1]: v for k, v in got.items() if k[0] == "stoker_inference_request_failure_total"}
    assert failures == {f"reason={r}": {"rejected": 2, "timeout": 1}.get(r, 0) for r in REASONS}
    assert got[("stoker_inference_request_success_total", "version=fp32")] == 0
    # A failure is not a request duration: that histogram is of answered requests.
    assert got[("stoker_inference_request_duration_seconds_count", "version=fp32")] == 0


def test_batches_count_rows_executions_and_per_request_durations() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "int8")
    batches = [  # rows, requests, compute input, infer, output
        BatchTimes(5, 2, 0.001, 0.02, 0.003),
        BatchTimes(1, 1, 0.002, 0.01, 0.001),
        BatchTimes(16, 4, 0.004, 0.5, 0.01),
    ]
    for batch in batches:
        metrics.batch_executed(batch)
    got = series(model)
    assert got[("stoker_inference_exec_count_total", "version=int8")] == 3
    assert got[("stoker_inference_count_total", "version=int8")] == 5 + 1 + 16
    size = "stoker_inference_batch_size"
    assert got[(f"{size}_count", "version=int8")] == 3
    assert got[(f"{size}_sum", "version=int8")] == 22
    for le in BATCH_BUCKETS:
        want = sum(b.rows <= le for b in batches)
        assert got[(f"{size}_bucket", f"le={float(le)}", "version=int8")] == want
    requests = sum(b.requests for b in batches)
    for stage in ("input", "infer", "output"):
        name = f"stoker_inference_compute_{stage}_duration_seconds"
        total = sum(b.requests * getattr(b, f"compute_{stage}") for b in batches)
        assert got[(f"{name}_count", "version=int8")] == requests
        assert got[(f"{name}_sum", "version=int8")] == pytest.approx(total)


def test_queue_time() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp32")
    metrics.queued(0.25)
    metrics.queued(0.5)
    got = series(model)
    name = "stoker_inference_queue_duration_seconds"
    assert got[(f"{name}_count", "version=fp32")] == 2
    assert got[(f"{name}_sum", "version=fp32")] == pytest.approx(0.75)
    assert got[(f"{name}_bucket", "le=0.3", "version=fp32")] == 1
    assert metrics.statistics()["inference_stats"]["queue"] == {  # type: ignore[index]
        "count": 2,
        "ns": 750_000_000,
    }


def test_pending_requests_are_read_from_their_owner_at_each_scrape() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp32")
    owner = {"pending": 3}
    metrics.count_pending(lambda: owner["pending"])
    assert series(model)[("stoker_inference_pending_request_count", "version=fp32")] == 3
    owner["pending"] = 1
    assert series(model)[("stoker_inference_pending_request_count", "version=fp32")] == 1


def test_image_decoding_is_counted_by_device_and_decoder() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp32")
    metrics.images_decoded("gpu", 12)
    metrics.images_decoded("cpu", 0)
    metrics.images_decoded("cpu", 3)
    metrics.images_decoded("front_ends", 4)
    metrics.decode_batch(12, [0.001, 0.003], 0.02)  # two requests' uploads in one batch
    got = series(model)
    assert got[("stoker_image_decode_queue_duration_seconds_count", "version=fp32")] == 2
    waited = got[("stoker_image_decode_queue_duration_seconds_sum", "version=fp32")]
    assert waited == pytest.approx(0.004)
    assert got[("stoker_image_decode_duration_seconds_count", "version=fp32")] == 2
    assert got[("stoker_image_decode_duration_seconds_sum", "version=fp32")] == pytest.approx(0.04)
    gpu = ("stoker_image_decode_total", "decoder=torchvision", "device=gpu", "version=fp32")
    assert got[gpu] == 12
    assert got[("stoker_image_decode_total", "decoder=pillow", "device=cpu", "version=fp32")] == 3
    made = ("stoker_image_decode_total", "decoder=pillow_front_ends", "device=cpu", "version=fp32")
    assert got[made] == 4
    assert got[("stoker_image_decode_batch_size_count", "version=fp32")] == 1
    assert got[("stoker_image_decode_batch_size_bucket", "le=8.0", "version=fp32")] == 0
    assert got[("stoker_image_decode_batch_size_bucket", "le=12.0", "version=fp32")] == 1
    other = unique_model()
    ModelMetrics(other, "fp32", "nvimgcodec").images_decoded("gpu", 5)
    decoded = {k: v for k, v in series(other).items() if k[0] == "stoker_image_decode_total"}
    assert decoded == {
        ("stoker_image_decode_total", "decoder=nvimgcodec", "device=gpu", "version=fp32"): 5,
        ("stoker_image_decode_total", "decoder=pillow", "device=cpu", "version=fp32"): 0,
        ("stoker_image_decode_total", "decoder=pillow_front_ends", "device=cpu", "version=fp32"): 0,
    }


def test_an_unserved_version_is_flagged_with_its_reason() -> None:
    model = unique_model()
    model_unavailable(model, "int8", "accuracy")
    got = series(model)
    assert got == {("stoker_model_unavailable", "reason=accuracy", "version=int8"): 1.0}


def test_statistics_report_the_same_totals_as_prometheus() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp32")
    before_ms = int(time.time() * 1000)
    metrics.request_succeeded(0.003)
    metrics.request_succeeded(0.005)
    metrics.request_failed("invalid", 0.001)
    metrics.queued(0.002)
    metrics.batch_executed(BatchTimes(4, 2, 0.001, 0.004, 0.002))
    metrics.batch_executed(BatchTimes(4, 1, 0.001, 0.004, 0.002))
    metrics.batch_executed(BatchTimes(1, 1, 0.001, 0.004, 0.002))
    after_ms = int(time.time() * 1000)
    stats = metrics.statistics()
    assert stats["name"] == model and stats["version"] == "fp32"
    assert stats["inference_count"] == 9 and stats["execution_count"] == 3
    assert isinstance(stats["last_inference"], int)
    assert before_ms <= stats["last_inference"] <= after_ms
    inference = stats["inference_stats"]
    assert isinstance(inference, dict)
    assert inference["success"] == {"count": 2, "ns": 8_000_000}
    assert inference["fail"] == {"count": 1, "ns": 1_000_000}
    assert inference["queue"] == {"count": 1, "ns": 2_000_000}
    # Compute times are per request: four requests ran in these three batches.
    assert inference["compute_infer"] == {"count": 4, "ns": 16_000_000}
    assert inference["compute_input"]["count"] == 4
    assert stats["batch_stats"] == [
        {"batch_size": 1, "compute_infer": {"count": 1}},
        {"batch_size": 4, "compute_infer": {"count": 2}},
    ]
    got = series(model)
    assert got[("stoker_inference_count_total", "version=fp32")] == stats["inference_count"]
    assert got[("stoker_inference_exec_count_total", "version=fp32")] == stats["execution_count"]
    assert got[("stoker_inference_request_success_total", "version=fp32")] == 2


def test_gpu_gauges_come_from_a_fresh_sample_at_each_scrape() -> None:
    readings = itertools.count()

    def source() -> list[GpuSample]:
        n = next(readings)
        return [
            GpuSample(0, "A", 0.25 + n / 100, 1 << 30, 80 << 30, 300.5, "GPU-a"),
            GpuSample(1, "B", 1.0, 2 << 30, 80 << 30, 120.0, "GPU-b"),
        ]

    registry = CollectorRegistry()
    registry.register(GpuCollector(source))
    samples = scrape(registry)
    first = {(s.name, s.labels["gpu"]): s.value for s in samples if "gpu" in s.labels}
    assert first == {
        ("stoker_gpu_utilization_ratio", "0"): 0.25,
        ("stoker_gpu_utilization_ratio", "1"): 1.0,
        ("stoker_gpu_memory_used_bytes", "0"): float(1 << 30),
        ("stoker_gpu_memory_used_bytes", "1"): float(2 << 30),
        ("stoker_gpu_memory_total_bytes", "0"): float(80 << 30),
        ("stoker_gpu_memory_total_bytes", "1"): float(80 << 30),
        ("stoker_gpu_power_watts", "0"): 300.5,
        ("stoker_gpu_power_watts", "1"): 120.0,
    }
    # Triton's names, by Triton's label, from the same sample.
    triton = {(s.name, s.labels["gpu_uuid"]): s.value for s in samples if "gpu_uuid" in s.labels}
    assert triton == {
        ("nv_gpu_utilization", "GPU-a"): 0.25,
        ("nv_gpu_utilization", "GPU-b"): 1.0,
        ("nv_gpu_memory_used_bytes", "GPU-a"): float(1 << 30),
        ("nv_gpu_memory_used_bytes", "GPU-b"): float(2 << 30),
        ("nv_gpu_memory_total_bytes", "GPU-a"): float(80 << 30),
        ("nv_gpu_memory_total_bytes", "GPU-b"): float(80 << 30),
        ("nv_gpu_power_usage", "GPU-a"): 300.5,
        ("nv_gpu_power_usage", "GPU-b"): 120.0,
    }
    second = {(s.name, s.labels.get("gpu")): s.value for s in scrape(registry)}
    assert math.isclose(second[("stoker_gpu_utilization_ratio", "0")], 0.26)


def test_without_gpus_the_gauges_are_declared_with_no_series() -> None:
    registry = CollectorRegistry()
    registry.register(GpuCollector(list))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == set(GPU_METRICS) | set(TRITON_GPU_METRICS)
    assert all(f.type == "gauge" and f.samples == [] for f in families.values())


def test_the_default_registry_exports_the_gpu_gauges() -> None:
    text = generate_latest(REGISTRY).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert set(GPU_METRICS) <= names


def test_durations_timed_elsewhere_join_the_request_histogram_once() -> None:
    """Requests a front end timed: the engine counts them untimed, then merges the front
    end's series; the histogram and the statistics then say what one process would."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from app.metrics import ModelMetrics, request_durations

    metrics = ModelMetrics("timed-elsewhere", "fp32")
    metrics.request_succeeded(0.001, 3, timed=False)
    series = request_durations()
    for seconds in (0.004, 0.004, 0.2):
        series.observe(seconds)
    metrics.add_request_durations(*series.snapshot())
    found = {}
    for family in text_string_to_metric_families(generate_latest().decode()):
        for sample in family.samples:
            if sample.labels.get("model") == "timed-elsewhere":
                found[(sample.name, sample.labels.get("le"))] = sample.value
    assert found[("stoker_inference_request_duration_seconds_count", None)] == 3
    assert found[("stoker_inference_request_duration_seconds_bucket", "0.005")] == 2
    assert found[("stoker_inference_request_duration_seconds_sum", None)] == pytest.approx(0.208)
    stats = metrics.statistics()["inference_stats"]
    assert isinstance(stats, dict)
    assert stats["success"] == {"count": 3, "ns": 208_000_000}


def test_engines_metrics_merge_into_one_exposition_labelled_by_gpu() -> None:
    """Two engine processes' texts as the front end gets them: one family per metric with
    both engines' samples, each labelled with its engine's GPU; a sample that already names
    a GPU (an NVML gauge both engines read) is kept once."""

    def engine(successes: float, latency: float) -> bytes:
        return (
            "# HELP stoker_inference_request_success_total Answered.\n"
            "# TYPE stoker_inference_request_success_total counter\n"
            f'stoker_inference_request_success_total{{model="m",version="1"}} {successes}\n'
            "# HELP stoker_queue_seconds Queue time.\n"
            "# TYPE stoker_queue_seconds histogram\n"
            f'stoker_queue_seconds_bucket{{model="m",le="0.1"}} {successes}\n'
            f'stoker_queue_seconds_bucket{{model="m",le="+Inf"}} {successes}\n'
            f'stoker_queue_seconds_sum{{model="m"}} {latency}\n'
            f'stoker_queue_seconds_count{{model="m"}} {successes}\n'
            "# HELP stoker_gpu_utilization GPU busy.\n"
            "# TYPE stoker_gpu_utilization gauge\n"
            'stoker_gpu_utilization{gpu="0"} 50.0\n'
            'stoker_gpu_utilization{gpu="1"} 70.0\n'
        ).encode()

    merged = labelled_metrics([("0", engine(3, 0.5)), ("1", engine(5, 0.25))]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    success = families["stoker_inference_request_success"]
    assert {(s.labels["gpu"], s.value) for s in success.samples if s.name.endswith("_total")} == {
        ("0", 3.0),
        ("1", 5.0),
    }
    queue = families["stoker_queue_seconds"]
    sums = {s.labels["gpu"]: s.value for s in queue.samples if s.name.endswith("_sum")}
    assert sums == {"0": 0.5, "1": 0.25} and queue.type == "histogram"
    utilization = families["stoker_gpu_utilization"].samples
    assert sorted((s.labels["gpu"], s.value) for s in utilization) == [("0", 50.0), ("1", 70.0)]
    assert merged.count("# TYPE stoker_inference_request_success_total counter") == 1


def test_engines_statistics_add_up_per_model_version() -> None:
    """Two engines' statistics-extension entries (as ``ModelMetrics.statistics`` writes
    them) as one server's: counts and durations added, batch sizes merged by size, the
    latest inference kept; a version only one engine serves is passed through."""

    def entry(version: str, requests: int, last: int, batches: dict[int, int]) -> dict[str, Any]:
        timed = {"count": requests, "ns": 1000 * requests}
        return {
            "name": "m",
            "version": version,
            "last_inference": last,
            "inference_count": requests,
            "execution_count": sum(batches.values()),
            "inference_stats": {k: dict(timed) for k in ("success", "fail", "queue")},
            "batch_stats": [
                {"batch_size": size, "compute_infer": {"count": n}} for size, n in batches.items()
            ],
        }

    first = [entry("fp32", 3, 100, {1: 1, 2: 1}), entry("int8", 1, 50, {1: 1})]
    second = [entry("fp32", 5, 120, {2: 1, 3: 1})]
    merged = {e["version"]: e for e in merged_statistics([first, second])}
    fp32 = merged["fp32"]
    assert fp32["inference_count"] == 8 and fp32["execution_count"] == 4
    assert fp32["last_inference"] == 120
    assert fp32["inference_stats"]["success"] == {"count": 8, "ns": 8000}
    assert fp32["batch_stats"] == [
        {"batch_size": 1, "compute_infer": {"count": 1}},
        {"batch_size": 2, "compute_infer": {"count": 2}},
        {"batch_size": 3, "compute_infer": {"count": 1}},
    ]
    assert merged["int8"] == entry("int8", 1, 50, {1: 1})
    assert first[0]["inference_count"] == 3  # the engines' own answers are left as they were


def test_an_unloaded_version_leaves_no_series_behind() -> None:
    """Every series a version's metrics made (a failure reason first seen late, an image
    decode, a refusal) is gone after ``forget``; another version of the model keeps its own."""
    model = unique_model()
    gone, kept = ModelMetrics(model, "fp32"), ModelMetrics(model, "int8")
    gone.count_pending(lambda: 2)
    gone.request_succeeded(0.01)
    gone.request_failed("reloaded-late", 0.01)
    gone.images_decoded("cpu", 3)
    gone.batch_executed(BatchTimes(4, 2, 0.001, 0.002, 0.001))
    model_unavailable(model, "fp32", "load")
    assert any(key[-1] == "version=fp32" for key in series(model))
    gone.forget()
    left = series(model)
    assert left and all("version=int8" in key for key in left), left
    kept.forget()
    assert series(model) == {}


def test_the_pending_gauge_adds_up_the_batchers_of_a_reload_until_the_old_one_closes() -> None:
    model = unique_model()
    metrics = ModelMetrics(model, "fp32")
    old, new = (lambda: 3), (lambda: 2)
    metrics.count_pending(old)
    metrics.count_pending(new)
    assert series(model)[("stoker_inference_pending_request_count", "version=fp32")] == 5
    metrics.stop_counting(old)
    assert series(model)[("stoker_inference_pending_request_count", "version=fp32")] == 2


def test_tritons_series_move_with_stokers_from_the_same_observations() -> None:
    """Each call updates Stoker's series and Triton's alike: Triton's as it exports them,
    counters under bare names, durations cumulative in microseconds, failures by Triton's
    reasons, pending requests read from the batcher's count."""
    model = unique_model()
    metrics = ModelMetrics(model, "fp16")
    pending = [3]
    metrics.count_pending(lambda: pending[0])
    metrics.request_succeeded(0.004, 2)
    metrics.request_failed("rejected", 0.001, 3)
    metrics.request_failed("cancelled", 0.001)
    metrics.request_failed("timeout", 0.5)
    metrics.request_failed("invalid", 0.001)
    metrics.queued(0.002, 2)
    metrics.batch_executed(BatchTimes(5, 2, 0.001, 0.010, 0.0005))
    got = series(model)
    v = "version=fp16"
    assert got[("nv_inference_request_success", v)] == 2
    assert got[("stoker_inference_request_success_total", v)] == 2
    assert {k[1]: n for k, n in got.items() if k[0] == "nv_inference_request_failure"} == {
        "reason=BACKEND": 0,
        "reason=CANCELED": 1,
        "reason=OTHER": 2,
        "reason=REJECTED": 3,
    }
    assert got[("nv_inference_count", v)] == got[("stoker_inference_count_total", v)] == 5
    assert got[("nv_inference_exec_count", v)] == got[("stoker_inference_exec_count_total", v)]
    assert got[("nv_inference_request_duration_us", v)] == 8000
    assert got[("nv_inference_queue_duration_us", v)] == 4000
    assert got[("nv_inference_compute_input_duration_us", v)] == 2000
    assert got[("nv_inference_compute_infer_duration_us", v)] == 20000
    assert got[("nv_inference_compute_output_duration_us", v)] == 1000
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        stoker = got[(f"stoker_inference_{stage}_duration_seconds_sum", v)]
        assert math.isclose(got[(f"nv_inference_{stage}_duration_us", v)], stoker * 1e6)
    assert got[("nv_inference_pending_request_count", v)] == 3
    pending[0] = 1
    assert series(model)[("nv_inference_pending_request_count", v)] == 1
    metrics.forget()
    assert series(model) == {}


def test_the_exposition_has_no_created_series() -> None:
    """prometheus-client's ``_created`` timestamps doubled the lines of every counter."""
    metrics = ModelMetrics(unique_model(), "fp32")
    metrics.request_succeeded(0.001)
    text = generate_latest(REGISTRY).decode()
    assert "_created" not in text
    assert f'stoker_inference_request_success_total{{model="{metrics.model}"' in text


def test_tritons_names_survive_the_merge_of_several_engines() -> None:
    """With one engine per GPU the front end parses and merges the engines' texts: Triton's
    bare counter names come out as they went in, and its GPU gauges (by ``gpu_uuid``) once."""
    metrics = ModelMetrics(unique_model(), "fp32")
    metrics.request_succeeded(0.001, 4)
    own = generate_latest(REGISTRY)
    gpu = b'nv_gpu_utilization{gpu_uuid="GPU-a"} 0.5\n'
    merged = labelled_metrics([("0", own + gpu), ("1", own + gpu)]).decode()
    model = metrics.model
    for engine in ("0", "1"):
        line = f'nv_inference_request_success{{gpu="{engine}",model="{model}",version="fp32"}} 4.0'
        assert line in merged
    assert merged.count('nv_gpu_utilization{gpu_uuid="GPU-a"}') == 1
