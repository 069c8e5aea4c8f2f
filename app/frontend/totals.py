"""Several engine processes' metrics and statistics as one server's (``RemoteEngine``, one
engine per GPU behind the same front ends): ``/metrics`` with a ``gpu`` label on every
sample, and Triton's statistics added up per model version. What is declared and counted
is ``app.metrics``'; this only merges what the engines expose.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


def labelled_metrics(texts: Sequence[tuple[str, bytes]]) -> bytes:
    """Several engine processes' ``/metrics`` as one exposition: every sample gains a ``gpu``
    label naming its engine's GPU, and each family is written once with every engine's
    samples. A sample that already names a GPU (the NVML gauges by ``gpu`` or, Triton's, by
    ``gpu_uuid``: every engine process reads every GPU of the machine) is kept once."""
    families: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for gpu, text in texts:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                labels = dict(sample.labels)
                if "gpu" in labels or "gpu_uuid" in labels:
                    key = (sample.name, tuple(sorted(labels.items())))
                    if key in seen:
                        continue
                    seen.add(key)
                else:
                    labels = {"gpu": gpu, **labels}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)

    class Merged(Collector):
        def collect(self) -> Iterator[Metric]:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


def merged_statistics(answers: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several engine processes' statistics-extension entries as one server's: per model
    version the counts and durations added up, batch sizes' counts added by size, the last
    inference the latest of them."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for entries in answers:
        for entry in entries:
            key = (entry["name"], entry["version"])
            into = merged.get(key)
            if into is None:
                merged[key] = copy.deepcopy(entry)  # the others are added into it
                continue
            into["last_inference"] = max(into["last_inference"], entry["last_inference"])
            for field_ in ("inference_count", "execution_count"):
                into[field_] += entry[field_]
            for name, figures in entry["inference_stats"].items():
                mine = into["inference_stats"].setdefault(name, {"count": 0, "ns": 0})
                mine["count"] += figures["count"]
                mine["ns"] += figures["ns"]
            sizes = {b["batch_size"]: b for b in into["batch_stats"]}
            for batch in entry["batch_stats"]:
                same = sizes.get(batch["batch_size"])
                if same is None:
                    sizes[batch["batch_size"]] = copy.deepcopy(batch)
                else:
                    same["compute_infer"]["count"] += batch["compute_infer"]["count"]
            into["batch_stats"] = [sizes[size] for size in sorted(sizes)]
    return list(merged.values())
