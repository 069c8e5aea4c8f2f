"""What Triton's trace and logging extensions read and change, held once per process.

The engine process holds the settings the server runs with: a front end asks it to change
them (the control operations ``trace_settings`` / ``log_settings``, ``Spread.ADOPTED``),
adopts its answer at once, and the other front ends adopt them with their next poll of the
engine (``EngineState.observed`` carries a snapshot and its revision). So a change made
through any front end reaches every process, the engine's log level included. In one
process the engine client changes them here directly.

Trace settings (Triton's names and JSON shapes, values as strings): ``trace_level`` (OFF,
TIMESTAMPS, TENSORS: any but OFF traces), ``trace_rate`` (one request in N is traced),
``trace_count`` (how many more traces, -1 without end), ``log_frequency`` and ``trace_file``
(kept for Triton's clients; spans go to the OTLP exporter), ``trace_mode`` (opentelemetry).
A model may override any of them; a null value drops its override. Log settings:
``log_info``, ``log_warning``, ``log_error``, ``log_verbose_level``, ``log_format``
(default, ISO8601), ``log_file`` (empty: logs go to standard error).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.errors import BadRequest

log = logging.getLogger(__name__)

TRACE_LEVELS = frozenset({"OFF", "TIMESTAMPS", "TENSORS"})
TRACE_KEYS = (
    "trace_level",
    "trace_rate",
    "trace_count",
    "log_frequency",
    "trace_file",
    "trace_mode",
)
LOG_KEYS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
ISO8601 = "%Y-%m-%dT%H:%M:%S"


def _integer(key: str, value: Any, least: int) -> str:
    text = value[0] if isinstance(value, list) and len(value) == 1 else value
    try:
        number = int(str(text))
    except ValueError:
        raise BadRequest(f"{key} must be an integer, not {str(text)[:40]!r}") from None
    if number < least:
        raise BadRequest(f"{key} must be at least {least}, not {number}")
    return str(number)


def trace_value(key: str, value: Any) -> str | list[str]:
    """One trace setting as Triton's clients send it (a string, a number or a list of
    strings), checked; in the form the server answers it."""
    if key == "trace_level":
        levels = [str(v).upper() for v in (value if isinstance(value, list) else [value])]
        unknown = [level for level in levels if level not in TRACE_LEVELS]
        if unknown or not levels:
            raise BadRequest(f"trace_level must be of {sorted(TRACE_LEVELS)}, not {unknown}")
        return ["OFF"] if "OFF" in levels else levels
    if key == "trace_rate":
        return _integer(key, value, 1)
    if key == "trace_count":
        return _integer(key, value, -1)
    if key == "log_frequency":
        return _integer(key, value, 0)
    text = value[0] if isinstance(value, list) and len(value) == 1 else value
    if key == "trace_mode":
        if str(text).lower() != "opentelemetry":
            raise BadRequest(f"trace_mode {str(text)[:40]!r}: Stoker traces with opentelemetry")
        return "opentelemetry"
    if key == "trace_file":
        return str(text)
    raise BadRequest(f"unknown trace setting {key[:40]!r}; known: {', '.join(TRACE_KEYS)}")


@dataclass
class Observed:
    """One process's trace and log settings and its revision (moves with every change)."""

    trace: dict[str, Any] = field(default_factory=dict)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per model, the trace settings it overrides."""
    log: dict[str, Any] = field(default_factory=dict)
    revision: int = 0
    tracing: bool = False
    """Spans have somewhere to go (``app.tracing``): without, a level but OFF is refused."""
    _counts: dict[str, itertools.count[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- trace settings

    def trace_settings(self, model: str | None = None) -> dict[str, Any]:
        """The trace settings in force, globally or for ``model`` (its overrides on top)."""
        return {**self.trace, **(self.models.get(model, {}) if model else {})}

    def update_trace(self, model: str | None, update: Mapping[str, Any]) -> dict[str, Any]:
        """Change the global trace settings or ``model``'s (a null value: back to the
        global one; globally it is refused); the settings now in force."""
        checked: dict[str, str | list[str] | None] = {}
        for key, value in update.items():
            if value is None:
                if not model:
                    raise BadRequest(f"{key[:40]} cannot be cleared globally, only per model")
                if key not in TRACE_KEYS:
                    raise BadRequest(f"unknown trace setting {key[:40]!r}")
                checked[key] = None
            else:
                checked[key] = trace_value(key, value)
        if checked.get("trace_level", ["OFF"]) != ["OFF"] and not self.tracing:
            raise BadRequest(
                "tracing is off: set OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER) "
                "for the server to trace"
            )
        with self._lock:
            into = self.models.setdefault(model, {}) if model else self.trace
            for key, value in checked.items():
                if value is None:
                    into.pop(key, None)
                else:
                    into[key] = value
            if model and not into:
                del self.models[model]
            self._counts.clear()
            self.revision += 1
        log.info("settings of revision %d: trace settings of %s", self.revision, model or "all")
        return self.trace_settings(model)

    def sampled(self, model: str) -> bool:
        """Whether a request to ``model`` is traced: one in ``trace_rate`` while the level
        is not OFF and ``trace_count`` is not spent (spending one of it)."""
        settings = self.models.get(model)
        if settings is None:
            settings, key = self.trace, ""
        else:
            settings, key = {**self.trace, **settings}, model
        if settings["trace_level"] == ["OFF"]:
            return False
        count = self._counts.get(key)
        if count is None:
            count = self._counts.setdefault(key, itertools.count())
        if next(count) % int(settings["trace_rate"]):
            return False
        left = int(settings["trace_count"])
        if left == -1:
            return True
        if left == 0:
            return False
        with self._lock:
            into = self.models[model] if key and "trace_count" in self.models[model] else self.trace
            into["trace_count"] = str(int(into["trace_count"]) - 1)
        return True

    # -- log settings

    def update_log(self, update: Mapping[str, Any]) -> dict[str, Any]:
        """Change the log settings, in this process's loggers at once; the settings now."""
        checked: dict[str, Any] = {}
        for key, value in update.items():
            if key in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise BadRequest(f"{key} must be true or false")
            elif key == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise BadRequest("log_verbose_level must be an integer of at least 0")
            elif key == "log_format":
                if value not in ("default", "ISO8601"):
                    raise BadRequest("log_format must be default or ISO8601")
            elif key == "log_file":
                if value:
                    raise BadRequest("log_file: Stoker logs to standard error only")
            else:
                raise BadRequest(f"unknown log setting {key[:40]!r}; known: {', '.join(LOG_KEYS)}")
            checked[key] = value
        with self._lock:
            self.log.update(checked)
            self.revision += 1
        log.info("settings of revision %d: log settings", self.revision)
        apply_log(self.log)
        return dict(self.log)

    # -- across processes

    def snapshot(self) -> dict[str, Any]:
        """Everything, for another process to ``adopt``."""
        with self._lock:
            return {
                "revision": self.revision,
                "trace": dict(self.trace),
                "models": {m: dict(s) for m, s in self.models.items()},
                "log": dict(self.log),
            }

    def adopt(self, snapshot: Mapping[str, Any] | None) -> None:
        """Take an engine's settings, where they are newer than these."""
        if snapshot is None or snapshot["revision"] <= self.revision:
            return
        with self._lock:
            self.trace = dict(snapshot["trace"])
            self.models = {m: dict(s) for m, s in snapshot["models"].items()}
            changed = snapshot["log"] != self.log
            self.log = dict(snapshot["log"])
            self._counts.clear()
            self.revision = snapshot["revision"]
        log.info("settings of revision %d adopted", self.revision)
        if changed:
            apply_log(self.log)


def log_level(settings: Mapping[str, Any]) -> int:
    """The root logger's level for Triton's log switches."""
    if settings.get("log_verbose_level", 0) > 0:
        return logging.DEBUG
    for key, level in (
        ("log_info", logging.INFO),
        ("log_warning", logging.WARNING),
        ("log_error", logging.ERROR),
    ):
        if settings.get(key, True):
            return level
    return logging.CRITICAL


def apply_log(settings: Mapping[str, Any]) -> None:
    """This process's loggers at ``settings``; said in the log at the new level itself (so
    the line passes it): each process that takes a change says so."""
    root = logging.getLogger()
    level = log_level(settings)
    root.setLevel(level)
    for handler in root.handlers:
        if handler.formatter is not None:
            handler.formatter.datefmt = ISO8601 if settings["log_format"] == "ISO8601" else None
    log.log(level, "log level now %s (Triton's log settings)", logging.getLevelName(level))


def log_defaults(level: str) -> dict[str, Any]:
    """Triton's log settings for ``server.log_level``."""
    rank = ("debug", "info", "warning", "error").index(level)
    return {
        "log_file": "",
        "log_info": rank <= 1,
        "log_warning": rank <= 2,
        "log_error": True,
        "log_verbose_level": 1 if rank == 0 else 0,
        "log_format": "default",
    }


STATE = Observed()
"""This process's settings: ``configure`` sets them up at its start."""


def configure(level: str, rate: int, on: bool, traced: bool = True) -> None:
    """This process's starting settings: the log settings of ``server.log_level``; where
    tracing is ``on`` (an exporter is set up), one request in ``rate`` traced, or none until
    the trace extension says so where not ``traced`` (level OFF)."""
    STATE.tracing = on
    STATE.trace = {
        "trace_level": ["TIMESTAMPS"] if on and traced else ["OFF"],
        "trace_rate": str(rate),
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "",
        "trace_mode": "opentelemetry",
    }
    STATE.log = log_defaults(level)
