"""The one door from the data plane to an engine: ``EngineClient``.

Two implementations, the same callers: ``app.engine.local.LocalEngine`` (the registry and
batchers in this process: the embedded default) and ``app.frontend.remote.RemoteEngine``
(engine processes over the control channel, tensors in this front end's arena). The data plane
above decodes, validates, gathers and encodes; an engine client runs what reaches an engine
(typed: frames, raw bodies, uploads) and answers every control operation through one generic
``control`` call, by the name of the engine's method, so no operation is written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from app.contract import Answer, Classified, Contract, Frame, Ran, Raw, Uploads
from app.frontend.arena import Slot


class EngineClient(Protocol):
    @property
    def alive(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    def engines(self) -> list[dict[str, object]]: ...
    async def start(self) -> None: ...
    def begin_drain(self) -> None: ...
    async def drain(self) -> None: ...
    async def stop(self) -> None: ...

    async def check(self, name: str, version: str | None = None) -> None: ...
    async def contract(self, name: str | None, version: str | None = None) -> Contract: ...
    def admit(self, contract: Contract, requests: int = 1) -> None: ...
    def body_buffer(
        self, declared: int | None, client: str = ""
    ) -> AbstractAsyncContextManager[Slot | None]: ...
    def arena_full_since(self) -> float | None: ...
    def submit(
        self, frame: Frame, deliver: Callable[[Ran | Exception], None]
    ) -> Callable[[], object]:
        """Run ``frame``: ``deliver`` gets its answer or error once; what it returns tells
        the engine nobody waits for it any more."""

    async def infer_raw(self, raw: Raw) -> Answer: ...
    def submit_uploads(
        self, uploads: Uploads, deliver: Callable[[Classified | Exception], None]
    ) -> Callable[[], object] | None:
        """Run ``uploads`` as ``classify`` does, without a task where it can be sent in this
        turn: ``deliver`` gets the answer or error once, and what it returns tells the
        engine nobody waits; None where it cannot go now (nothing was sent): the caller
        awaits ``classify``."""

    async def classify(self, uploads: Uploads) -> Classified: ...
    def request_timed(self, model: str, version: str, seconds: float, engine: str = "") -> None: ...
    def count_failures(
        self, name: str, version: str, reason: str, count: int, seconds: float
    ) -> None: ...

    async def control(self, method: str, *args: Any) -> Any:
        """The engine's control method ``method`` (metadata, statistics, a load...) called
        with ``args``; with several engines, on one or on all, as the method declares."""
