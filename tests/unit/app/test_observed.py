"""Triton's trace and log settings as one process holds them (``app.observed``), and how the
``OTEL_*`` variables set tracing up (``app.tracing``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from app import observed, tracing
from app.errors import BadRequest
from app.observed import Observed


@pytest.fixture
def state() -> Iterator[Observed]:
    held = Observed(tracing=True)
    held.trace = {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "",
        "trace_mode": "opentelemetry",
    }
    held.log = observed.log_defaults("info")
    level = logging.getLogger().level
    yield held
    logging.getLogger().setLevel(level)


def sampled(state: Observed, model: str, requests: int) -> list[bool]:
    return [state.sampled(model) for _ in range(requests)]


def test_the_rate_traces_one_request_in_n(state: Observed) -> None:
    assert sampled(state, "m", 3) == [True, True, True]
    state.update_trace(None, {"trace_rate": 3})  # a number, as JSON clients may send it
    assert state.trace_settings()["trace_rate"] == "3"
    assert sampled(state, "m", 7) == [True, False, False, True, False, False, True]


def test_trace_count_spends_itself_and_off_traces_nothing(state: Observed) -> None:
    state.update_trace(None, {"trace_count": "2"})
    assert sampled(state, "m", 4) == [True, True, False, False]
    assert state.trace_settings()["trace_count"] == "0"
    state.update_trace(None, {"trace_count": "-1", "trace_level": ["OFF"]})
    assert sampled(state, "m", 2) == [False, False]


def test_a_model_overrides_the_global_settings_until_it_clears_them(state: Observed) -> None:
    state.update_trace("quiet", {"trace_level": "OFF"})
    assert state.trace_settings("quiet")["trace_level"] == ["OFF"]
    assert state.trace_settings()["trace_level"] == ["TIMESTAMPS"]
    assert sampled(state, "quiet", 2) == [False, False]
    assert sampled(state, "loud", 2) == [True, True]
    state.update_trace(None, {"trace_rate": "5"})  # the global rate reaches the model too
    assert state.trace_settings("quiet")["trace_rate"] == "5"
    state.update_trace("quiet", {"trace_level": None})
    assert state.trace_settings("quiet") == state.trace_settings()
    assert state.models == {}


@pytest.mark.parametrize(
    "model, update",
    [
        (None, {"trace_rate": "often"}),
        (None, {"trace_rate": "0"}),
        (None, {"trace_count": "-2"}),
        (None, {"trace_level": ["LOUD"]}),
        (None, {"trace_mode": "triton"}),
        (None, {"colour": "blue"}),
        (None, {"trace_rate": None}),  # only a model's setting can be cleared
    ],
)
def test_bad_trace_settings_are_refused_and_change_nothing(
    state: Observed, model: str | None, update: dict[str, object]
) -> None:
    before = state.snapshot()
    with pytest.raises(BadRequest):
        state.update_trace(model, update)
    assert state.snapshot() == before


def test_without_an_exporter_tracing_cannot_be_turned_on(state: Observed) -> None:
    state.tracing = False
    with pytest.raises(BadRequest, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        state.update_trace(None, {"trace_level": ["TIMESTAMPS"]})
    state.update_trace(None, {"trace_rate": "2"})  # what does not turn it on is taken


def test_log_settings_set_the_root_logger(state: Observed) -> None:
    state.update_log({"log_verbose_level": 2})
    assert logging.getLogger().level == logging.DEBUG
    state.update_log({"log_verbose_level": 0, "log_info": False})
    assert logging.getLogger().level == logging.WARNING
    state.update_log({"log_warning": False})
    assert logging.getLogger().level == logging.ERROR
    for bad in ({"log_info": "yes"}, {"log_verbose_level": -1}, {"log_file": "/x"}, {"a": 1}):
        with pytest.raises(BadRequest):
            state.update_log(bad)


def test_another_process_adopts_only_newer_settings(state: Observed) -> None:
    engine = Observed(tracing=True, trace=dict(state.trace), log=dict(state.log))
    engine.update_trace("m", {"trace_rate": "4"})
    engine.update_log({"log_info": False})
    state.adopt(engine.snapshot())
    assert state.trace_settings("m")["trace_rate"] == "4" and state.revision == 2
    assert logging.getLogger().level == logging.WARNING
    restarted = Observed(tracing=True, trace=dict(state.trace), log=observed.log_defaults("info"))
    state.adopt(restarted.snapshot())  # revision 0: older than what this process runs with
    assert state.trace_settings("m")["trace_rate"] == "4" and not state.log["log_info"]


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({}, (True, 1, True)),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, (True, 1, False)),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, (False, 1, False)),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
            (True, 100, False),
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            (True, 4, True),
        ),
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, (False, 1, True)),
    ],
)
def test_the_sampler_variables_set_the_starting_rate(
    variables: dict[str, str], expected: tuple[bool, int, bool]
) -> None:
    assert tracing.sampling(variables) == expected


def test_tracing_is_off_unless_an_exporter_or_endpoint_is_named() -> None:
    try:
        tracing.configure("server", "info", {})
        assert tracing.tracer is None and observed.STATE.trace["trace_level"] == ["OFF"]
        tracing.configure("server", "info", {"OTEL_TRACES_EXPORTER": "none"})
        assert tracing.tracer is None
        both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"}
        tracing.configure("server", "info", both)
        assert tracing.tracer is None
        tracing.configure("server", "info", {"OTEL_TRACES_EXPORTER": "console"})
        assert tracing.tracer is not None
        assert observed.STATE.trace["trace_level"] == ["TIMESTAMPS"]
        resource = tracing.tracer.resource
        assert resource["stoker.process"] == "server" and resource["service.name"] == "stoker"
        # Sampled off at the start, tracing can still be turned on at run time.
        off = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_off"}
        tracing.configure("server", "info", off)
        assert observed.STATE.trace["trace_level"] == ["OFF"]
        observed.STATE.update_trace(None, {"trace_level": ["TIMESTAMPS"]})
    finally:
        tracing.shutdown()
        tracing.configure("server", "info", {})
