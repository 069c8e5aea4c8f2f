"""Every metric Stoker exports, declared once.

Names follow Triton's vocabulary (request, queue, compute input/infer/output, inference and
execution counts, pending requests) so existing habits carry over, but latencies are
histograms in seconds. Labels: ``model`` and ``version`` (the precision). One process per GPU,
so the default registry suffices.

``ModelMetrics`` is the typed call site: it updates the Prometheus series and the plain
totals that ``/v2/models/{m}/stats`` reports, so the two can never disagree.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engines.devices import nvml

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
LABELS = ("model", "version")


class CountedHistogram(Collector):
    """A labelled histogram whose ``observe`` takes a count: the requests of one batch share
    its compute times, so a batch of n requests is one observation of weight n, not n calls
    (per-request Python is what bounds the engine process). Exposed like a Prometheus
    histogram: ``_bucket``, ``_sum``, ``_count``."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = (*buckets, float("inf"))
        self._series: dict[tuple[str, ...], CountedSeries] = {}
        self._lock = threading.Lock()
        REGISTRY.register(self)

    def labels(self, *values: str) -> CountedSeries:
        with self._lock:
            series = self._series.get(values)
            if series is None:
                series = self._series[values] = CountedSeries(self.bounds)
            return series

    def remove(self, *values: str) -> None:
        """Drop one label set (a model version that was unloaded)."""
        with self._lock:
            self._series.pop(values, None)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        with self._lock:
            series = list(self._series.items())
        for values, one in series:
            counts, total = one.snapshot()
            cumulative, buckets = 0.0, []
            for bound, count in zip(self.bounds, counts, strict=True):
                cumulative += count
                buckets.append(
                    ("+Inf" if bound == float("inf") else repr(float(bound)), cumulative)
                )
            family.add_metric(list(values), buckets, total)
        yield family


class CountedSeries:
    """One label set of a ``CountedHistogram``."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        at = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[at] += times
            self._sum += value * times

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    def merge(self, counts: list[int], total: float) -> None:
        """Add another series' observations (``snapshot`` of one with the same bounds)."""
        if len(counts) != len(self._counts):
            raise ValueError(f"{len(counts)} buckets for a series of {len(self._counts)}")
        with self._lock:
            for i, count in enumerate(counts):
                self._counts[i] += int(count)
            self._sum += float(total)


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
    "or nvImageCodec: models.jpeg_decoder) or cpu (pillow, in the engine: formats other than "
    "JPEG, GPU decoding off, or an image the GPU's decoder refused; pillow_front_ends: made "
    "rows by the front ends, server.decode_uploads_in_front_ends).",
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
    "start of the batch they joined (waiting for a free decoder).",
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
    "gRPC calls by the status HTTP would have answered: grpc_calls, grpc_watches, "
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


class GpuCollector(Collector):
    """Yields the GPU gauges from a fresh NVML sample on each scrape; on a machine without
    a GPU the metrics are declared with no series."""

    def __init__(self, source: Callable[[], list[nvml.GpuSample]]) -> None:
        self._source = source

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation in GPU_METRICS.items():
            yield GaugeMetricFamily(name, documentation, labels=["gpu"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            name: GaugeMetricFamily(name, doc, labels=["gpu"]) for name, doc in GPU_METRICS.items()
        }
        for gpu in self._source():
            label = [str(gpu.index)]
            families["stoker_gpu_utilization_ratio"].add_metric(label, gpu.utilization)
            families["stoker_gpu_memory_used_bytes"].add_metric(label, gpu.memory_used_bytes)
            families["stoker_gpu_memory_total_bytes"].add_metric(label, gpu.memory_total_bytes)
            families["stoker_gpu_power_watts"].add_metric(label, gpu.power_watts)
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


@dataclass
class ModelMetrics:
    """The call site for one served model version."""

    model: str
    version: str
    jpeg_decoder: str = "torchvision"
    """What decodes the version's JPEG uploads on the GPU (``models.jpeg_decoder``)."""
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

    def __post_init__(self) -> None:
        labels = (self.model, self.version)
        self._success = REQUEST_SUCCESS.labels(*labels)
        self._inference_count = INFERENCE_COUNT.labels(*labels)
        self._exec_count = EXECUTION_COUNT.labels(*labels)
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
        for metric in (
            REQUEST_SUCCESS,
            INFERENCE_COUNT,
            EXECUTION_COUNT,
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
        sources = self._pending_sources
        self._pending.set_function(lambda: sum(count() for count in sources))

    def stop_counting(self, source: Callable[[], int]) -> None:
        """A batcher that closed: the gauge no longer reads it."""
        with contextlib.suppress(ValueError):
            self._pending_sources.remove(source)

    def batch_executed(self, times: BatchTimes) -> None:
        self._exec_count.inc()
        self._inference_count.inc(times.rows)
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
