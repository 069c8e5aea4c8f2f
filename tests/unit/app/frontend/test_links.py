"""What a front end makes of several engines' answers: one repository index, and the outcome
of a load or unload every engine was asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import NotFound
from app.frontend.links import EngineLink, RemoteError, every_engine, merged_index


def entry(name: str, state: str, reason: str = "") -> dict[str, str]:
    item = {"name": name, "version": "fp32", "state": state}
    return item | ({"reason": reason} if reason else {})


def test_engines_that_agree_give_their_index_and_disagreement_names_the_engine() -> None:
    zero = [entry("a", "READY"), entry("b", "READY"), entry("c", "UNAVAILABLE", "unloaded")]
    one = [entry("a", "READY"), entry("b", "LOADING"), entry("c", "UNAVAILABLE", "unloaded")]
    assert merged_index([("0", zero)]) == zero
    merged = {i["name"]: i for i in merged_index([("0", zero), ("1", one)])}
    assert merged["a"] == entry("a", "READY")
    assert merged["b"] == entry("b", "LOADING", "GPU 1")  # the one furthest from serving
    assert merged["c"] == entry("c", "UNAVAILABLE", "unloaded")
    only_zero = merged_index([("0", [*zero, entry("d", "READY")]), ("1", one)])
    assert only_zero[-1]["reason"] == "GPU 0 (unknown to GPU 1)"


def links(*labels: str) -> list[EngineLink]:
    return [EngineLink(label, Path(f"/tmp/{label}.sock")) for label in labels]


def test_a_call_to_every_engine_is_done_refused_alike_or_said_to_disagree() -> None:
    two = links("0", "1")
    every_engine("load of 'm'", two, [None, None])
    with pytest.raises(NotFound, match="no model"):
        every_engine("load of 'm'", two, [NotFound("no model"), NotFound("no model")])
    with pytest.raises(RemoteError, match="failed on some engines: GPU 1: out of memory") as some:
        every_engine("load of 'm'", two, [None, RemoteError("out of memory", 503, "x")])
    assert some.value.status == 500
    with pytest.raises(ConnectionError):
        every_engine("load of 'm'", two, [None, ConnectionError("gone")])
