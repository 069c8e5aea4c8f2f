"""Where a request's time goes, stage by stage, from the spans a server printed: its traced
requests (``OTEL_TRACES_EXPORTER=console``: one OTLP JSON export a line of the server's
output, from the front ends and the engine alike), each request's spans joined across the
processes, the engine's ``engine`` span to the ``batch`` it linked and that batch's ``run``.

    OTEL_TRACES_EXPORTER=console OTEL_TRACES_SAMPLER=traceidratio OTEL_TRACES_SAMPLER_ARG=0.02 \\
        stoker serve ... >spans.log
    python3 scripts/span_budget.py spans.log [--window START,END] [--name infer]

Per stage, the median, 90th percentile and mean in microseconds over the traced requests
(of the window: Unix seconds, when the requests arrived; of the request spans whose name
holds ``--name``). The stages tile the request's span: ``receive``, ``decode``, the ``engine
call`` (split by the engine's spans into the way there (gathering, the frame's crossing, the
engine loop's pick-up), the batcher's ``queue``, the ``run``, the engine's work after it, and
the way back to the front end's task), ``encode and write``, and what is left of the span
(routing before the route, the answer's last steps). A sampled share of the requests is
enough: at 2% a run of 5,000 req/s gives 100 a second. Tracing adds ~20 us a traced request
(BENCHMARKS.md, "Tracing at 100%").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

BATCH_LINK = "batch"
"""The ``stoker.link`` attribute of an ``engine`` span's link to its batch (app.tracing)."""


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    process: str
    attributes: dict[str, Any] = field(default_factory=dict)
    batch_link: str | None = None
    """The span id of the batch an ``engine`` span ran in."""

    @property
    def us(self) -> float:
        return (self.end_ns - self.start_ns) / 1000


def value_of(value: dict[str, Any]) -> Any:
    for kind, found in value.items():
        return int(found) if kind == "intValue" else found
    return None


def spans_of(lines: Iterable[str | bytes]) -> Iterator[Span]:
    """The spans of every export line among ``lines`` (the other lines of a server's output
    are skipped, as is a line cut short)."""
    for line in lines:
        text = line.strip()
        start = b'{"resourceSpans"' if isinstance(text, bytes) else '{"resourceSpans"'
        if not text.startswith(start):  # type: ignore[arg-type]
            continue
        try:
            export = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        for resource_spans in export.get("resourceSpans", ()):
            resource = {
                a["key"]: value_of(a["value"])
                for a in resource_spans.get("resource", {}).get("attributes", ())
            }
            process = str(resource.get("stoker.process", "?"))
            for scope in resource_spans.get("scopeSpans", ()):
                for raw in scope.get("spans", ()):
                    span = Span(
                        raw["name"],
                        raw["traceId"],
                        raw["spanId"],
                        raw.get("parentSpanId", ""),
                        int(raw["startTimeUnixNano"]),
                        int(raw["endTimeUnixNano"]),
                        process,
                        {a["key"]: value_of(a["value"]) for a in raw.get("attributes", ())},
                    )
                    for link in raw.get("links", ()):
                        kinds = {a["key"]: value_of(a["value"]) for a in link.get("attributes", ())}
                        if kinds.get("stoker.link") == BATCH_LINK:
                            span.batch_link = link["spanId"]
                    yield span


STAGES = (
    "receive",
    "decode",
    "engine call",
    "  to the engine (gather, cross, pick up)",
    "    of it: held, gathered and written in the front end",
    "    of it: the link (written to read by the engine)",
    "    of it: the engine's pick-up (read to its span)",
    "  decode (uploads: the decode queue and batch)",
    "  queue (batcher)",
    "  run (runner)",
    "    of it: compute input",
    "    of it: compute infer",
    "    of it: compute output",
    "  in the engine after the run",
    "  back to the front end",
    "    of it: the link back (the engine's end to the front end's read)",
    "    of it: the request's turn (read to its task)",
    "encode and write",
    "rest of the request span",
    "request (front end, first byte to answer)",
)


def budgets(
    spans: Iterable[Span], window: tuple[float, float] | None = None, name: str = ""
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per stage (``STAGES``), its microseconds for each traced request whose request span
    starts in ``window`` and whose name holds ``name``; and the run's batches (mean rows, mean
    requests, how many) and the requests counted."""
    by_id: dict[str, Span] = {}
    children: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_id[span.span_id] = span
        if span.parent_id:
            children[span.parent_id].append(span)
    found: dict[str, list[float]] = {stage: [] for stage in STAGES}
    batches: dict[str, Span] = {}
    requests = 0
    for root in by_id.values():
        kids = {child.name: child for child in children.get(root.span_id, ())}
        if "receive" not in kids or "engine call" not in kids or name not in root.name:
            continue
        if window is not None and not window[0] <= root.start_ns / 1e9 < window[1]:
            continue
        requests += 1
        staged = 0.0
        for stage in ("receive", "decode", "engine call", "encode and write"):
            if stage in kids:
                found[stage].append(kids[stage].us)
                staged += kids[stage].us
        found["rest of the request span"].append(root.us - staged)
        found["request (front end, first byte to answer)"].append(root.us)
        call = kids["engine call"]
        engine = next((s for s in children.get(call.span_id, ()) if s.name == "engine"), None)
        if engine is None:
            continue
        there = (engine.start_ns - call.start_ns) / 1000
        found["  to the engine (gather, cross, pick up)"].append(there)
        found["  back to the front end"].append((call.end_ns - engine.end_ns) / 1000)
        # Stamps of the crossing where the tree sets them (wire.Run.sent_ns, contract.Ran).
        sent = engine.attributes.get("stoker.sent_ns")
        read = engine.attributes.get("stoker.read_ns")
        if sent and read:
            found["    of it: held, gathered and written in the front end"].append(
                (int(sent) - call.start_ns) / 1000
            )
            found["    of it: the link (written to read by the engine)"].append(
                (int(read) - int(sent)) / 1000
            )
            found["    of it: the engine's pick-up (read to its span)"].append(
                (engine.start_ns - int(read)) / 1000
            )
        received = call.attributes.get("stoker.received_ns")
        if received:
            found["    of it: the link back (the engine's end to the front end's read)"].append(
                (int(received) - engine.end_ns) / 1000
            )
            found["    of it: the request's turn (read to its task)"].append(
                (call.end_ns - int(received)) / 1000
            )
        decode = next((s for s in children.get(engine.span_id, ()) if s.name == "decode"), None)
        if decode is not None:
            found["  decode (uploads: the decode queue and batch)"].append(decode.us)
        queue = next((s for s in children.get(engine.span_id, ()) if s.name == "queue"), None)
        if queue is not None:
            found["  queue (batcher)"].append(queue.us)
        batch = by_id.get(engine.batch_link or "")
        runs = children.get(batch.span_id, []) if batch is not None else []
        run = next((s for s in runs if s.name == "run"), None)
        if batch is not None and run is not None:
            batches[batch.span_id] = batch
            found["  run (runner)"].append(run.us)
            for part in ("input", "infer", "output"):
                value = run.attributes.get(f"compute_{part}_us")
                if value is not None:
                    found[f"    of it: compute {part}"].append(float(value))
            found["  in the engine after the run"].append((engine.end_ns - run.end_ns) / 1000)
    sizes = [b.attributes.get("batch.size", 0) for b in batches.values()]
    counts = [b.attributes.get("batch.requests", 0) for b in batches.values()]
    facts = {
        "requests": requests,
        "batches": len(batches),
        "mean batch rows": statistics.fmean(sizes) if sizes else 0.0,
        "mean batch requests": statistics.fmean(counts) if counts else 0.0,
    }
    return found, facts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(found: dict[str, list[float]], facts: dict[str, float], title: str) -> str:
    lines = [
        f"{title}: {facts['requests']:.0f} traced request(s); their batches: "
        f"{facts['batches']:.0f}, mean {facts['mean batch rows']:.1f} rows "
        f"of {facts['mean batch requests']:.1f} requests",
        "",
        "| stage | median us | p90 us | mean us | requests |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for stage in STAGES:
        values = found[stage]
        if not values:
            continue
        label = stage.replace("  ", "&nbsp;&nbsp;")
        lines.append(
            f"| {label} | {statistics.median(values):,.0f} | {percentile(values, 0.9):,.0f} "
            f"| {statistics.fmean(values):,.0f} | {len(values)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="server output with console spans")
    parser.add_argument(
        "--window",
        action="append",
        default=[],
        metavar="[LABEL=]START,END",
        help="Unix seconds: a table of the requests that arrived between (repeatable)",
    )
    parser.add_argument("--name", default="", help="request spans whose name holds this")
    args = parser.parse_args(argv)
    spans: list[Span] = []
    for log in args.logs:
        with log.open("rb") as lines:
            spans.extend(spans_of(lines))
    windows: list[tuple[str, tuple[float, float] | None]] = []
    for text in args.window:
        label, _, bounds = text.rpartition("=")
        start, end = (float(v) for v in bounds.split(","))
        windows.append((label or bounds, (start, end)))
    for label, window in windows or [("all", None)]:
        found, facts = budgets(spans, window, args.name)
        print(table(found, facts, label))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
