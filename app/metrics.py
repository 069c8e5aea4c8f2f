"""Every metric Stoker exports, declared once.

Stoker's own ``stoker_*`` names follow Triton's vocabulary (request, queue, compute
input/infer/output, inference and execution counts, pending requests) but latencies are
histograms in seconds. Beside them, Triton's own ``nv_*`` names, as Triton exports them
(cumulative counters in microseconds, failures by Triton's reasons, GPU gauges by
``gpu_uuid``), so a Triton dashboard, alert or autoscaling rule works unchanged. Labels:
``model`` and ``version`` (the precision). One process per GPU, so the default registry
suffices; prometheus-client's ``_created`` series are off (they doubled the exposition).

``ModelMetrics`` is the typed call site: it updates the Prometheus series and the plain
totals that ``/v2/models/{m}/stats`` reports, so the two can never disagree; the ``nv_*``
series are read from those same totals at scrape time (``TritonCollector``), so they move
with the ``stoker_*`` ones and cost the request path nothing.

Kept in one module (~550 lines): "declared once" is its point. A metric's name, its labels,
the total ``/stats`` reports and the ``nv_*`` series read from that total change together;
split, a Stoker and a Triton view of one total would live apart. What is not a declaration
(the weighted histogram) lives in ``app.counted``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.counted import CountedHistogram
from app.counted import CountedSeries as CountedSeries  # links.py reads it here
from engines.devices import nvml

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
LABELS = ("model", "version")

disable_created_metrics()  # type: ignore[no-untyped-call]


def request_durations() -> CountedSeries:
    """A series with the request-duration buckets, for a front end to time its requests in
    and send to the engine (``ModelMetrics.add_request_durations``)."""
    return CountedSeries(REQUEST_DURATION.bounds)


REQUEST_SUCCESS = Counter(
    "stoker_inference_request_success", "Inference requests answered successfully.", LABELS
)
REQUEST_FAILURE = Counter(
    "stoker_inference_request_failure",
    "Inference requests that failed, by reason: invalid (400), rejected (429, queue full), "
    "timeout (504, deadline), cancelled (client went away), backend (500), unavailable (503).",
    (*LABELS, "reason"),
)
INFERENCE_COUNT = Counter(
    "stoker_inference_count", "Rows inferred (the batch dimension, not requests).", LABELS
)
EXECUTION_COUNT = Counter("stoker_inference_exec_count", "Batches executed by a runner.", LABELS)
PADDED_ROWS = Counter(
    "stoker_inference_padded_rows",
    "Rows runners computed beyond their batches' own: batches padded up to the CUDA graph "
    "captured for their bucket, or each graph of a split batch up to its own (the torch "
    "backend). Over this plus stoker_inference_count, "
    "the share of the device's rows that were padding.",
    LABELS,
)
PENDING_REQUESTS = Gauge(
    "stoker_inference_pending_request_count",
    "Requests accepted by the batcher and not yet answered (queued or executing).",
    LABELS,
)
REQUEST_DURATION = CountedHistogram(
    "stoker_inference_request_duration_seconds",
    "From the request's arrival at the model (body read) to its response encoded (with front "
    "ends, timed in the front end that decoded and encoded it).",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
QUEUE_DURATION = CountedHistogram(
    "stoker_inference_queue_duration_seconds",
    "Time a request waited in the batcher queue before its batch was dispatched.",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
COMPUTE_INPUT_DURATION = CountedHistogram(
    "stoker_inference_compute_input_duration_seconds",
    "Per request: forming its batch's inputs (concatenation, host-to-device copies).",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
COMPUTE_INFER_DURATION = CountedHistogram(
    "stoker_inference_compute_infer_duration_seconds",
    "Per request: running its batch on the engine.",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
COMPUTE_OUTPUT_DURATION = CountedHistogram(
    "stoker_inference_compute_output_duration_seconds",
    "Per request: checking and splitting its batch's outputs (device-to-host copies).",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "stoker_inference_batch_size",
    "Rows in each executed batch (the realised batch size).",
    LABELS,
    buckets=BATCH_BUCKETS,
)

IMAGES_DECODED = Counter(
    "stoker_image_decode",
    "Uploaded images decoded, by device and decoder: gpu (in batches, by torchvision's nvJPEG "
    "or nvImageCodec: uploads.jpeg_decoder) or cpu (pillow, in the engine: formats other than "
    "JPEG, GPU decoding off, or an image the GPU's decoder refused; pillow_front_ends: made "
    "rows by the front ends, uploads.decode_in_front_ends).",
    (*LABELS, "device", "decoder"),
)
DECODE_BATCH_SIZE = Histogram(
    "stoker_image_decode_batch_size",
    "JPEG uploads decoded together in one GPU batch (uploads of concurrent requests gather).",
    LABELS,
    buckets=BATCH_BUCKETS,
)
DECODE_QUEUE_DURATION = CountedHistogram(
    "stoker_image_decode_queue_duration_seconds",
    "Per request with JPEG uploads for the GPU: from handing them to the decode queue to the "
    "start of the batch they joined (waiting for a free decoder, or, while another batch "
    "decodes, for uploads.decode_spread_pixels to queue).",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
DECODE_DURATION = CountedHistogram(
    "stoker_image_decode_duration_seconds",
    "Per request with JPEG uploads for the GPU: decoding the batch its uploads joined, from "
    "the batch's start to its rows on the device (in a decode process: the crossings too; "
    "a batch the device failed, until it failed).",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
MODEL_UNAVAILABLE = Gauge(
    "stoker_model_unavailable",
    "1 for a configured model version that is not served, by reason: accuracy (it missed "
    "its accuracy budget) or load (it failed to build or load). Its 503s say why.",
    (*LABELS, "reason"),
)


UNAVAILABLE_REASONS = ("accuracy", "load")


def model_unavailable(model: str, version: str, reason: str) -> None:
    """Count a configured version that is not served (``reason``: accuracy or load)."""
    MODEL_UNAVAILABLE.labels(model, version, reason).set(1)


def model_available(model: str, version: str) -> None:
    """A version loaded since, or no longer configured: its unavailable series go."""
    for reason in UNAVAILABLE_REASONS:
        with contextlib.suppress(KeyError):
            MODEL_UNAVAILABLE.remove(model, version, reason)


HTTP_REFUSALS = Counter(
    "stoker_http_refusals_total",
    "Requests refused by the server's limits before they reached a model, by status and "
    "reason: header_bytes, header_count, header_timeout, connections (431, 408, 503 from the "
    "HTTP layer), body_bytes, body_timeout, inflight_bytes, arena_full (413, 408, 503, 503 "
    "for bodies), image_header (400, 413: an upload whose image header is broken or over the "
    "pixel or aspect limits), host, origin (403, a browser's cross-origin or DNS-rebinding "
    "request); and "
    "gRPC calls by the status HTTP would have answered: grpc_calls, grpc_watches, grpc_probes, "
    "grpc_inflight_bytes (503, RESOURCE_EXHAUSTED), grpc_control_bytes (413, "
    "RESOURCE_EXHAUSTED), grpc_message_timeout (408, DEADLINE_EXCEEDED), grpc_connections "
    "(503: connections closed past their address's share).",
    ("status", "reason"),
)


def http_refused(status: int, reason: str, count: float = 1) -> None:
    HTTP_REFUSALS.labels(str(status), reason).inc(count)


def http_refusal_counts() -> dict[tuple[str, str], float]:
    """This process's refusal counts so far, by (status, reason)."""
    counts = {}
    for family in HTTP_REFUSALS.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                counts[(sample.labels["status"], sample.labels["reason"])] = sample.value
    return counts


# GPU gauges, labelled ``gpu`` (the NVML index), read through NVML at scrape time.
GPU_METRICS: dict[str, str] = {
    "stoker_gpu_utilization_ratio": "Fraction of NVML's last sample period in which a kernel "
    "ran on the GPU (0 to 1).",
    "stoker_gpu_memory_used_bytes": "GPU memory in use, by every process on the GPU.",
    "stoker_gpu_memory_total_bytes": "GPU memory in total.",
    "stoker_gpu_power_watts": "GPU power draw.",
}


# Triton's GPU gauges, labelled ``gpu_uuid`` as Triton's are, from the same NVML sample.
TRITON_GPU_METRICS: dict[str, str] = {
    "nv_gpu_utilization": "GPU utilization rate [0.0 - 1.0) (Triton's name).",
    "nv_gpu_memory_used_bytes": "GPU used memory, in bytes (Triton's name).",
    "nv_gpu_memory_total_bytes": "GPU total memory, in bytes (Triton's name).",
    "nv_gpu_power_usage": "GPU power usage in watts (Triton's name).",
}


class GpuCollector(Collector):
    """Yields the GPU gauges, Stoker's and Triton's, from one fresh NVML sample on each
    scrape; on a machine without a GPU the metrics are declared with no series."""

    def __init__(self, source: Callable[[], list[nvml.GpuSample]]) -> None:
        self._source = source

    def _families(self) -> dict[str, GaugeMetricFamily]:
        families = {
            name: GaugeMetricFamily(name, doc, labels=["gpu"]) for name, doc in GPU_METRICS.items()
        }
        for name, doc in TRITON_GPU_METRICS.items():
            families[name] = GaugeMetricFamily(name, doc, labels=["gpu_uuid"])
        return families

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        for gpu in self._source():
            label, uuid = [str(gpu.index)], [gpu.uuid or str(gpu.index)]
            for (ours, triton), value in (
                (("stoker_gpu_utilization_ratio", "nv_gpu_utilization"), gpu.utilization),
                (
                    ("stoker_gpu_memory_used_bytes", "nv_gpu_memory_used_bytes"),
                    gpu.memory_used_bytes,
                ),
                (
                    ("stoker_gpu_memory_total_bytes", "nv_gpu_memory_total_bytes"),
                    gpu.memory_total_bytes,
                ),
                (("stoker_gpu_power_watts", "nv_gpu_power_usage"), gpu.power_watts),
            ):
                families[ours].add_metric(label, value)
                families[triton].add_metric(uuid, value)
        yield from families.values()


REGISTRY.register(GpuCollector(nvml.sample))


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, times: int = 1) -> None:
        self.count += times
        self.ns += int(seconds * 1e9) * times

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchTimes:
    """Durations of one executed batch, in seconds."""

    rows: int
    requests: int
    compute_input: float
    compute_infer: float
    compute_output: float
    padded: int = 0
    """Rows the runner computed beyond the batch's own (up to its CUDA graph's bucket)."""


@dataclass
class ModelMetrics:
    """The call site for one served model version."""

    model: str
    version: str
    jpeg_decoder: str = "torchvision"
    """What decodes the version's JPEG uploads on the GPU (``uploads.jpeg_decoder``)."""
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batch_stats: dict[int, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    """Failed requests by Stoker's reason (``nv_inference_request_failure`` reads them)."""

    def __post_init__(self) -> None:
        labels = (self.model, self.version)
        _LIVE[labels] = self
        self._success = REQUEST_SUCCESS.labels(*labels)
        self._inference_count = INFERENCE_COUNT.labels(*labels)
        self._exec_count = EXECUTION_COUNT.labels(*labels)
        self._padded = PADDED_ROWS.labels(*labels)
        self._pending = PENDING_REQUESTS.labels(*labels)
        self._request = REQUEST_DURATION.labels(*labels)
        self._queue = QUEUE_DURATION.labels(*labels)
        self._input = COMPUTE_INPUT_DURATION.labels(*labels)
        self._infer = COMPUTE_INFER_DURATION.labels(*labels)
        self._output = COMPUTE_OUTPUT_DURATION.labels(*labels)
        self._batch = BATCH_SIZE.labels(*labels)
        # where an image was decoded: its device and decoder labels
        self._decoders = {
            "gpu": ("gpu", self.jpeg_decoder),
            "cpu": ("cpu", "pillow"),
            "front_ends": ("cpu", "pillow_front_ends"),
        }
        self._decoded = {
            where: IMAGES_DECODED.labels(*labels, *device_decoder)
            for where, device_decoder in self._decoders.items()
        }
        self._decode_batch = DECODE_BATCH_SIZE.labels(*labels)
        self._decode_queue = DECODE_QUEUE_DURATION.labels(*labels)
        self._decode = DECODE_DURATION.labels(*labels)
        self._pending_sources: list[Callable[[], int]] = []
        # Failure series exist from the start, so a dashboard's rate() sees a zero, not a gap.
        self._reasons = {"invalid", "rejected", "timeout", "cancelled", "backend", "unavailable"}
        for reason in self._reasons:
            REQUEST_FAILURE.labels(*labels, reason)

    def forget(self) -> None:
        """Remove every series of this model version from the registry (it was unloaded):
        a dashboard then shows it gone, not frozen at its last values."""
        labels = (self.model, self.version)
        if _LIVE.get(labels) is self:
            del _LIVE[labels]
        for metric in (
            REQUEST_SUCCESS,
            INFERENCE_COUNT,
            EXECUTION_COUNT,
            PADDED_ROWS,
            PENDING_REQUESTS,
            BATCH_SIZE,
            DECODE_BATCH_SIZE,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)
        for histogram in (
            REQUEST_DURATION,
            QUEUE_DURATION,
            COMPUTE_INPUT_DURATION,
            COMPUTE_INFER_DURATION,
            COMPUTE_OUTPUT_DURATION,
            DECODE_QUEUE_DURATION,
            DECODE_DURATION,
        ):
            histogram.remove(*labels)
        for device_decoder in self._decoders.values():
            with contextlib.suppress(KeyError):
                IMAGES_DECODED.remove(*labels, *device_decoder)
        for reason in self._reasons:
            with contextlib.suppress(KeyError):
                REQUEST_FAILURE.remove(*labels, reason)
        model_available(*labels)

    def request_succeeded(self, seconds: float, times: int = 1, timed: bool = True) -> None:
        """``times`` requests answered, each after ``seconds``. ``timed`` False: a front end
        times them from its own start to its encoded answer (``add_request_durations``)."""
        self._success.inc(times)
        if timed:
            self._request.observe(seconds, times)
            self.success.add(seconds, times)
        else:
            self.success.count += times

    def request_timed(self, seconds: float) -> None:
        """The duration of one request counted ``timed=False``, measured by the data plane
        in this process."""
        self._request.observe(seconds)
        self.success.ns += int(seconds * 1e9)

    def add_request_durations(self, counts: list[int], total: float) -> None:
        """The durations a front end measured for requests counted ``timed=False``."""
        self._request.merge(counts, total)
        self.success.ns += int(total * 1e9)

    def request_failed(self, reason: str, seconds: float, times: int = 1) -> None:
        """``times`` requests failed for ``reason``, each after ``seconds``."""
        self._reasons.add(reason)
        REQUEST_FAILURE.labels(self.model, self.version, reason).inc(times)
        self.fail.add(seconds, times)
        self.failures[reason] = self.failures.get(reason, 0) + times

    def images_decoded(self, where: str, count: int) -> None:
        """``count`` images decoded on the ``gpu``, the engine's ``cpu``, or by the
        ``front_ends`` (rows made there)."""
        if count:
            self._decoded[where].inc(count)

    def decode_batch(self, images: int, waits: list[float], seconds: float) -> None:
        """One GPU decode batch of ``images`` uploads, for requests that waited ``waits`` for
        it to start; it took ``seconds``."""
        self._decode_batch.observe(images)
        for waited in waits:
            self._decode_queue.observe(waited)
        self._decode.observe(seconds, len(waits))

    def queued(self, seconds: float, times: int = 1) -> None:
        """``times`` requests waited ``seconds`` in the queue (one gathered entry)."""
        self._queue.observe(seconds, times)
        self.queue.add(seconds, times)

    def count_pending(self, source: Callable[[], int]) -> None:
        """The pending-requests gauge reads ``source`` (the batcher's own count of its queued
        and executing requests) at scrape time: one count, never a second copy of it. While
        a reload switches, the old batcher's and the new one's are added up."""
        self._pending_sources.append(source)
        self._pending.set_function(self.pending)

    def pending(self) -> int:
        """Requests queued or executing in this version's batchers now."""
        return sum(count() for count in self._pending_sources)

    def stop_counting(self, source: Callable[[], int]) -> None:
        """A batcher that closed: the gauge no longer reads it."""
        with contextlib.suppress(ValueError):
            self._pending_sources.remove(source)

    def batch_executed(self, times: BatchTimes) -> None:
        self._exec_count.inc()
        self._inference_count.inc(times.rows)
        if times.padded:
            self._padded.inc(times.padded)
        self._batch.observe(times.rows)
        self._input.observe(times.compute_input, times.requests)
        self._infer.observe(times.compute_infer, times.requests)
        self._output.observe(times.compute_output, times.requests)
        self.compute_input.add(times.compute_input, times.requests)
        self.compute_infer.add(times.compute_infer, times.requests)
        self.compute_output.add(times.compute_output, times.requests)
        self.inference_count += times.rows
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        self.batch_stats[times.rows] = self.batch_stats.get(times.rows, 0) + 1

    def statistics(self) -> dict[str, object]:
        """Triton's statistics-extension entry for this model version."""
        return {
            "name": self.model,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_json(),
                "fail": self.fail.as_json(),
                "queue": self.queue.as_json(),
                "compute_input": self.compute_input.as_json(),
                "compute_infer": self.compute_infer.as_json(),
                "compute_output": self.compute_output.as_json(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_infer": {"count": count}}
                for size, count in sorted(self.batch_stats.items())
            ],
        }


_LIVE: dict[tuple[str, str], ModelMetrics] = {}
"""The model versions whose series are exported, by (model, version)."""

TRITON_REASONS = {"rejected": "REJECTED", "cancelled": "CANCELED", "backend": "BACKEND"}
"""Stoker's failure reasons as Triton names them; every other one is Triton's OTHER."""


class TritonCollector(Collector):
    """Triton's per-model series, read at scrape time from each live ``ModelMetrics``' plain
    totals (the ones its statistics extension reports), so they move with the ``stoker_*``
    series and the request path pays nothing for them. As Triton has them: counters under
    their bare names (no ``_total``), durations cumulative in microseconds."""

    COUNTERS: ClassVar[dict[str, str]] = {
        "nv_inference_request_success": "Number of successful inference requests, all batch sizes.",
        "nv_inference_request_failure": "Number of failed inference requests, all batch sizes, "
        "by Triton's reason (REJECTED, CANCELED, BACKEND, OTHER).",
        "nv_inference_count": "Number of inferences performed (rows).",
        "nv_inference_exec_count": "Number of model executions performed (batches).",
        "nv_inference_request_duration_us": "Cumulative inference request duration in "
        "microseconds (successful requests).",
        "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds.",
        "nv_inference_compute_input_duration_us": "Cumulative compute input duration in "
        "microseconds.",
        "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in "
        "microseconds.",
        "nv_inference_compute_output_duration_us": "Cumulative inference compute output "
        "duration in microseconds.",
    }
    PENDING = "nv_inference_pending_request_count"

    def describe(self) -> Iterator[Metric]:
        return self._empty()

    def _empty(self) -> Iterator[Metric]:
        for name, documentation in self.COUNTERS.items():
            yield Metric(name, documentation, "counter")
        yield Metric(
            self.PENDING,
            "Instantaneous number of pending requests awaiting execution per-model.",
            "gauge",
        )

    def collect(self) -> Iterator[Metric]:
        families = {family.name: family for family in self._empty()}

        def add(name: str, labels: dict[str, str], value: float) -> None:
            families[name].add_sample(name, labels, value)

        for (model, version), m in list(_LIVE.items()):
            labels = {"model": model, "version": version}
            add("nv_inference_request_success", labels, m.success.count)
            failed = dict.fromkeys(("REJECTED", "CANCELED", "BACKEND", "OTHER"), 0)
            for reason, count in list(m.failures.items()):
                failed[TRITON_REASONS.get(reason, "OTHER")] += count
            for reason, count in failed.items():
                add("nv_inference_request_failure", {**labels, "reason": reason}, count)
            add("nv_inference_count", labels, m.inference_count)
            add("nv_inference_exec_count", labels, m.execution_count)
            for name, duration in (
                ("request", m.success),
                ("queue", m.queue),
                ("compute_input", m.compute_input),
                ("compute_infer", m.compute_infer),
                ("compute_output", m.compute_output),
            ):
                add(f"nv_inference_{name}_duration_us", labels, duration.ns // 1000)
            add(self.PENDING, labels, m.pending())
        yield from families.values()


REGISTRY.register(TritonCollector())
