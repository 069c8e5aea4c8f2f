"""What the server says about a step: ``/metrics`` before and after, as differences.

Stoker's histograms give the realised batch size, queue time and compute time per request;
Triton's cumulative counters (``nv_inference_*``) give the same means. A server with neither
(MLServer, the naive baseline) gives None for each, never an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class ServerStats:
    """Means over one step, from the server's own counters; None where it has none."""

    mean_batch_size: float | None = None
    queue_ms: float | None = None
    compute_infer_ms: float | None = None
    request_ms: float | None = None
    executions: float | None = None
    inferences: float | None = None

    def as_json(self) -> dict[str, float | None]:
        return asdict(self)


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str, model: str | None, version: str | None) -> float | None:
    """Sum of a sample over the series of the model (and version) asked for; None if absent.
    A counter matches with or without ``_total`` (the parser adds it to counters that lack
    it, such as Triton's)."""
    wanted = {name, f"{name}_total"}
    values = [
        value
        for (sample, labels), value in samples.items()
        if sample in wanted and _selected(dict(labels), model, version)
    ]
    return sum(values) if values else None


def _selected(labels: dict[str, str], model: str | None, version: str | None) -> bool:
    if model is not None and labels.get("model", model) != model:
        return False
    return version is None or labels.get("version", version) == version


def _delta(
    before: Samples, after: Samples, name: str, model: str | None, version: str | None
) -> float | None:
    end = total(after, name, model, version)
    if end is None:
        return None
    return end - (total(before, name, model, version) or 0.0)


def _ratio(numerator: float | None, denominator: float | None, scale: float = 1.0) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator * scale


def step_stats(
    before: str | None, after: str | None, model: str | None = None, version: str | None = None
) -> ServerStats:
    """The means over a step from two scrapes (texts in the Prometheus exposition format)."""
    if before is None or after is None:
        return ServerStats()
    b, a = parse(before), parse(after)

    def delta(name: str) -> float | None:
        return _delta(b, a, name, model, version)

    stoker = "stoker_inference_"
    if total(a, f"{stoker}batch_size_count", model, version) is not None:
        queued = delta(f"{stoker}queue_duration_seconds_count")
        computed = delta(f"{stoker}compute_infer_duration_seconds_count")
        return ServerStats(
            mean_batch_size=_ratio(
                delta(f"{stoker}batch_size_sum"), delta(f"{stoker}batch_size_count")
            ),
            queue_ms=_ratio(delta(f"{stoker}queue_duration_seconds_sum"), queued, 1e3),
            compute_infer_ms=_ratio(
                delta(f"{stoker}compute_infer_duration_seconds_sum"), computed, 1e3
            ),
            request_ms=_ratio(
                delta(f"{stoker}request_duration_seconds_sum"),
                delta(f"{stoker}request_duration_seconds_count"),
                1e3,
            ),
            executions=delta(f"{stoker}exec_count_total"),
            inferences=delta(f"{stoker}count_total"),
        )
    triton = "nv_inference_"
    if total(a, f"{triton}exec_count", model, version) is not None:
        executions = delta(f"{triton}exec_count")
        inferences = delta(f"{triton}count")
        successes = delta(f"{triton}request_success")
        return ServerStats(
            mean_batch_size=_ratio(inferences, executions),
            queue_ms=_ratio(delta(f"{triton}queue_duration_us"), successes, 1e-3),
            compute_infer_ms=_ratio(delta(f"{triton}compute_infer_duration_us"), successes, 1e-3),
            request_ms=_ratio(delta(f"{triton}request_duration_us"), successes, 1e-3),
            executions=executions,
            inferences=inferences,
        )
    return ServerStats()
