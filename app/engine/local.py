"""The engine behind one interface: the model registry and its batchers, as the data plane
calls them in one process and as the engine process's control server calls them for its
front ends (``app.engine.process``). Every engine operation is written here once.

It implements ``app.frontend.client.EngineClient`` in-process: decoding, gathering and
encoding stay in the data plane above it; this runs what reaches an engine (a frame of
decoded requests, a body that names shared-memory regions, image uploads) and answers the
control operations (metadata, statistics, model control, shared-memory registration): each
a method marked ``@operation``, which ``CONTROL`` lists with how its calls spread over several
engines, called by name (``LocalEngine.control``, and the engine process for its front ends).

Kept in one module (~520 lines): an operation is written once, its method beside its spread
(issue 44's door), so every operation is here; Triton's configuration document is built in
``app.engine.index`` and the uploads' run in ``app.engine.uploads``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import numpy as np
from prometheus_client import generate_latest

from app import observed, tracing, wire
from app.contract import (
    Answer,
    Classified,
    Contract,
    Frame,
    Ran,
    Raw,
    Uploads,
    batch_key,
    control_refusal,
    decode_infer_async,
    draining,
)
from app.drain import Drain
from app.engine.batch import Tensors, time_left
from app.engine.index import triton_config
from app.engine.models import LoadedModel
from app.engine.registry import Registry
from app.engine.shared_memory import SharedRegions
from app.engine.uploads import run_uploads
from app.engine.watch import watch
from app.errors import NotImplementedHere, Reloaded, StokerError, Unavailable
from app.protocol import RequestedOutput, classify, encode_response
from app.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
Shaped = list[tuple[RequestedOutput, np.ndarray]]
Method = TypeVar("Method", bound=Callable[..., Awaitable[Any]])
CONTROL: dict[str, wire.Rule] = {}
"""The control methods of ``LocalEngine`` (``@operation``), by name, with how each one's calls
spread over several engines: the one table a control call is dispatched by, here and in the
engine process, and that a front end learns at ``Hello``."""


def operation(
    spread: wire.Spread, undo: str | None = None, restore: str | None = None
) -> Callable[[Method], Method]:
    """Mark an engine method as a control operation, called by name (``CONTROL``)."""

    def mark(method: Method) -> Method:
        CONTROL[method.__name__] = wire.Rule(spread, undo, restore)
        return method

    return mark


class LocalEngine:
    def __init__(self, settings: Settings, one_device: bool = False) -> None:
        self.settings = settings
        self.models = Registry(settings, one_device)
        self.regions = SharedRegions()
        self.drain_state = Drain(settings.server.drain_timeout_s)
        self._keyed = bool(settings.auth.keys())
        """API keys are set: the front ends let only key holders reach model control."""
        self.failed: BaseException | None = None
        """Why loading failed, in an engine process (``app.child.watch_loading``)."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Loads and unloads in progress (they finish when their caller leaves) and poll
        mode's watch of the repository."""

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model (``Registry.load_all``); readiness follows. In poll mode, the
        repository is watched from then on (``app.engine.watch``)."""
        await self.models.load_all()
        models = self.settings.models
        if models.control == "poll":
            self._keep(asyncio.create_task(watch(self.models, models.poll_s), name="poll"))

    def _keep(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def begin_drain(self) -> None:
        """Readiness turns false and a build running in a worker thread stops; requests are
        still taken until ``drain``: what the data plane (or a front end) accepted before
        its own door closed reaches the engine after. Plain attributes only: a signal
        handler may call it."""
        self.models.stopping.set()
        self.drain_state.begin()

    async def drain(self) -> None:
        """Refuse new requests with 503, wait until every accepted one has its answer or the
        drain timeout passes, then fail what is still queued with 503 (a batch already
        running finishes: a runner's thread cannot be interrupted)."""
        self.begin_drain()
        self.drain_state.close()
        left = self.drain_state.time_left()
        if not await self.drain_state.all_answered(left):
            log.warning("drain timeout: %d request(s) still in flight", self.drain_state.active)
        await self.models.close_batchers(self.drain_state.time_left())

    async def stop(self) -> None:
        """Free runners and engines in reverse order of loading."""
        self.begin_drain()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.models.close_batchers(self.drain_state.time_left())
        await self.models.close()
        self.regions.close()

    # -- state --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """The registry is ready (loading over, something serves, all of it healthy)."""
        return self.models.ready and not self.drain_state.draining

    @property
    def alive(self) -> bool:
        """False once loading failed or a model stopped on an unrecoverable engine fault."""
        return self.failed is None and self.models.healthy

    def engines(self) -> list[dict[str, object]]:
        """One engine, this one: nothing to list per GPU."""
        return []

    def serving(self) -> list[tuple[str, str, int]]:
        """The model versions answered now (loaded, not stopped by a fault), each with the
        most rows it takes in one request (engines on different GPUs may have shrunk a
        version to different max batches)."""
        return [
            (model.name, model.version, model.spec.max_batch_size)
            for model in self.models.loaded()
            if model.ready
        ]

    def queued_requests(self) -> int:
        """Requests queued or executing over every loaded version."""
        return sum(model.batcher.pending for model in self.models.loaded())

    async def check(self, name: str, version: str | None = None) -> None:
        """Raise what a request to this model would get (404, 503) before its body is read."""
        self.models.get(name, version)

    async def contract(self, name: str | None, version: str | None = None) -> Contract:
        """The model version's contract (``name`` None: the default model's, for uploads)."""
        return self._upload_model(name, version).contract

    def admit(self, contract: Contract, requests: int = 1) -> None:
        """Refuse now (503, 429) what the model's batcher would refuse, before decoding."""
        self.models.get(contract.model, contract.version).batcher.admit(requests)

    async def control(self, method: str, *args: Any) -> Any:
        """Call the control method ``method`` (one ``CONTROL`` lists) with ``args``."""
        if method not in CONTROL:
            raise NotImplementedHere(f"no control operation '{method}' in this engine")
        return await getattr(self, method)(*args)

    @operation(wire.Spread.MODEL)
    async def metadata(self, name: str, version: str | None = None) -> dict[str, object]:
        """The V2 model metadata, with the versions that are configured but not served."""
        model = self.models.get(name, version)
        metadata = model.spec.metadata(self.models.versions(name), f"{model.backend}_onnx")
        unavailable = self.models.unavailable(name)
        if unavailable:
            # Not in the V2 schema (clients ignore extra fields): why a version is absent.
            metadata["unavailable_versions"] = [
                {"version": v, "reason": reason} for v, reason in unavailable.items()
            ]
        return metadata

    @operation(wire.Spread.MODEL)
    async def version_ready(self, name: str, version: str | None = None) -> dict[str, object]:
        model = self.models.get(name, version)
        return {"name": model.name, "version": model.version, "ready": model.ready}

    @operation(wire.Spread.MODEL)
    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model configuration, as its clients read it (``triton_config``)."""
        return triton_config(self.models.get(name, version), self.models.versions(name))

    @operation(wire.Spread.SUMMED)
    async def statistics(self, name: str | None = None, version: str | None = None) -> list[object]:
        """Triton's statistics: of every served version, of a model's, or of one version."""
        if name is None:
            models = self.models.loaded()
        elif version is None:
            if not self.models.versions(name):
                self.models.get(name)  # raises: 404 unknown, 503 loading or refused
            models = [self.models.get(name, v) for v in self.models.versions(name)]
        else:
            models = [self.models.get(name, version)]
        return [m.metrics.statistics() for m in models]

    @operation(wire.Spread.WORST)
    async def repository_index(self) -> list[dict[str, str]]:
        return await self.models.index()

    # -- model control --------------------------------------------------------------------

    def _controllable(self) -> None:
        """Refuse a load or unload the mode does not take, or one that comes while the
        server drains."""
        refused = control_refusal(self.settings.models, self._keyed)
        if refused is not None:
            raise refused
        if self.drain_state.draining:
            raise draining()

    async def _finished(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a load or an unload to its end even if its caller goes away meanwhile (a
        half-done switch would help no one); the caller waits for it."""
        await asyncio.shield(self._keep(asyncio.create_task(work, name="model-control")))

    @operation(wire.Spread.AT_ONCE)
    async def load(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load model ``name`` or reload it (``config``: in place of its config.yaml)."""
        self._controllable()
        await self._finished(self.models.load(name, config))

    @operation(wire.Spread.AT_ONCE)
    async def unload(self, name: str) -> None:
        self._controllable()
        await self._finished(self.models.unload(name))

    @property
    def generation(self) -> int:
        """Moves whenever the served set changes (``Registry.generation``)."""
        return self.models.generation

    @operation(wire.Spread.LABELLED)
    async def metrics_text(self) -> bytes:
        """The Prometheus exposition of this process."""
        return generate_latest()

    @operation(wire.Spread.ADOPTED)
    async def trace_settings(
        self, model: str | None = None, update: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Triton's trace settings in force, globally or for ``model``, after ``update``."""
        if model and not self.models.versions(model):
            self.models.get(model)  # raises: 404 unknown, 503 loading or refused
        if update is None:
            return observed.STATE.trace_settings(model)
        return observed.STATE.update_trace(model, update)

    @operation(wire.Spread.ADOPTED)
    async def log_settings(self, update: dict[str, Any] | None = None) -> dict[str, Any]:
        """Triton's log settings, after ``update`` (applied to this process's loggers)."""
        if update is None:
            return dict(observed.STATE.log)
        return observed.STATE.update_log(update)

    @operation(wire.Spread.ALL_OR_NONE, undo="shm_unregister")
    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.regions.register(name, key, offset, byte_size)

    @operation(wire.Spread.IN_TURN)
    async def shm_unregister(self, name: str | None = None) -> None:
        self.regions.unregister(name)

    @operation(wire.Spread.ANY, restore="shm_register")
    async def shm_status(self, name: str | None = None) -> list[dict[str, object]]:
        return self.regions.status(name)

    def body_buffer(
        self, declared: int | None, client: str = ""
    ) -> AbstractAsyncContextManager[None]:
        """In one process a body is read into memory of its own (None: ``read_body``
        allocates): there is no arena to lend from."""
        return contextlib.nullcontext(None)

    def arena_full_since(self) -> float | None:
        return None  # no arena

    # -- what the data plane measured ---------------------------------------------------

    def request_timed(self, model: str, version: str, seconds: float, engine: str = "") -> None:
        """One request's duration, from its body read to its encoded answer."""
        with contextlib.suppress(StokerError):
            self.models.get(model, version).metrics.request_timed(seconds)

    def add_request_durations(
        self, name: str, version: str, counts: Sequence[int], total: float
    ) -> None:
        """Durations a front end measured for requests it sent through ``run``."""
        with contextlib.suppress(StokerError):
            self.models.get(name, version).metrics.add_request_durations(list(counts), total)

    def count_failures(
        self, name: str, version: str, reason: str, count: int, seconds: float
    ) -> None:
        """Requests refused before they reached the engine (a request that did not decode):
        counted with this model's own failures."""
        with contextlib.suppress(StokerError):
            self.models.get(name, version).metrics.request_failed(reason, seconds, count)

    # -- inference ----------------------------------------------------------------------

    async def _measured(
        self,
        model: LoadedModel,
        work: Callable[[], Awaitable[T]],
        requests: int | Callable[[], int] = 1,
        timed: bool = True,
    ) -> T:
        """Run the work of one request (or of ``requests`` run together: a number, or what
        the callable says once the work ends, when the work counted some failures itself),
        counting the outcome (and, ``timed``, the duration) of each by reason; refuse it
        with 503 once the engine drains, and track it until answered so a drain can wait."""
        started = time.perf_counter()
        count = requests if callable(requests) else (lambda: requests)
        try:
            if self.drain_state.refuses():
                raise draining()
            with self.drain_state.in_flight():
                result = await work()
        except Reloaded:
            raise  # not an outcome: the data plane decodes it again and sends it anew
        except StokerError as exc:
            model.metrics.request_failed(exc.reason, time.perf_counter() - started, count())
            exc.counted = True
            raise
        except asyncio.CancelledError:
            model.metrics.request_failed("cancelled", time.perf_counter() - started, count())
            raise
        except Exception:
            model.metrics.request_failed("backend", time.perf_counter() - started, count())
            raise
        model.metrics.request_succeeded(time.perf_counter() - started, count(), timed)
        return result

    def submit(
        self, frame: Frame, deliver: Callable[[Ran | Exception], None]
    ) -> Callable[[], object]:
        """``run`` in a task of its own, which hands ``deliver`` the answer or the error in
        the step it ends (503 where it was cancelled: every caller went away, or the engine
        stops; also before its first step, from the task's end); what it returns cancels it."""
        delivered = False

        def once(outcome: Ran | Exception) -> None:
            nonlocal delivered
            if not delivered:
                delivered = True
                deliver(outcome)

        async def answer() -> None:
            try:
                ran = await self.run(frame)
            except asyncio.CancelledError:
                once(Unavailable("the engine is stopping"))
                raise
            except Exception as error:
                once(error)
                return
            once(ran)

        task = self._keep(asyncio.create_task(answer()))
        task.add_done_callback(lambda _: once(Unavailable("the engine is stopping")))
        return task.cancel

    async def run(self, frame: Frame) -> Ran:
        """Requests the data plane decoded, validated and gathered: their tensors go through
        the batcher as one entry (one queue entry and one future for all), and each gets the
        outputs it asked for, shaped. Each request is counted as one; its duration is the
        data plane's (``request_timed``), from its body to its encoded answer, in every
        process model."""
        model = self.models.get(frame.model, frame.version)
        if frame.serial and frame.serial != model.serial and not model.fits(frame.parts):
            # Decoded against the contract of a version a reload replaced, and not what this
            # one takes: the data plane checks them against the new contract.
            raise Reloaded(f"model {model.name!r} version {model.version!r} was reloaded; retry")
        parts = frame.parts

        arrived = min((p.arrived for p in parts if p.arrived is not None), default=None)

        async def work() -> list[Shaped]:
            model.batcher.admit(len(parts))
            rows = sum(part.rows for part in parts)
            every = [RequestedOutput(t.name, True) for t in model.spec.outputs]
            raw = await self._batched(
                model,
                [part.inputs for part in parts],
                rows,
                every,
                (frame.timeout_us, frame.priority),
                frame.client,
                time.monotonic() if arrived is None else arrived,
                len(parts),
            )
            outputs = {out.name: value for out, value in raw}
            answers, start = [], 0
            for part in parts:
                mine = outputs
                if len(parts) > 1:
                    mine = {key: value[start : start + part.rows] for key, value in outputs.items()}
                    start += part.rows
                answers.append([(out, shape_output(model, out, mine)) for out in part.wanted])
            return answers

        measured = self._measured(model, work, len(parts), timed=False)
        if tracing.tracer is not None and any(part.traceparent for part in parts):
            measured = tracing.tracer.engine([part.traceparent for part in parts], measured)
        return Ran(model.name, model.version, await measured)

    async def infer_raw(self, raw: Raw) -> Answer:
        """A V2 body that names shared-memory regions, decoded here where the regions are
        registered, batched and encoded (an output region too small for its output is this
        request's 400, counted as such)."""
        model = self.models.get(raw.name, raw.version)
        body, header_length, client = raw.body, raw.header_length, raw.client
        contract = model.contract

        async def work() -> Answer:
            arrived = time.monotonic()
            # Under overload most requests are refused: refuse before decoding, not after.
            model.batcher.admit()
            decoded = await decode_infer_async(
                contract, body, header_length, self.settings.limits, self.regions
            )
            request = decoded.request
            shaped = await self._batched(
                model,
                [request.inputs],
                decoded.rows,
                decoded.wanted,
                (request.timeout_us, request.priority),
                client,
                arrived,
            )
            content, headers = encode_response(
                model.name, model.version, request.id, shaped, self.regions
            )
            return Answer(model.name, model.version, headers, content)

        measured = self._measured(model, work)
        if tracing.tracer is not None and raw.traceparent:
            measured = tracing.tracer.engine([raw.traceparent], measured)
        return await measured

    async def _batched(
        self,
        model: LoadedModel,
        blocks: list[dict[str, np.ndarray]],
        rows: int,
        wanted: Sequence[RequestedOutput],
        scheduling: tuple[int | None, int],
        client: str,
        arrived: float,
        requests: int = 1,
    ) -> Shaped:
        """Through the batcher; ``blocks``: one request's tensors, or those of gathered ones
        (one batch key), in order; ``scheduling``: the timeout (us) and priority."""
        timeout_us, priority = scheduling
        model = model.current()  # a reload may have switched while this request decoded
        # The key of what the engine gets: normalised pixels batch with FP32 requests.
        engine_blocks = [model.inputs.for_engine(block) for block in blocks]
        key = batch_key(model.spec, engine_blocks[0])
        timeout = time_left(model.timeout_s(timeout_us), arrived)
        outputs = await model.batcher.infer(
            engine_blocks, rows, key, timeout, priority, client, requests
        )
        return [(out, shape_output(model, out, outputs)) for out in wanted]

    def submit_uploads(
        self, uploads: Uploads, deliver: Callable[[Classified | Exception], None]
    ) -> Callable[[], object] | None:
        """None: in one process an upload call is the engine's own coroutine, which the data
        plane awaits (``classify``); nothing crosses, so there is no turn to save."""
        return None

    async def classify(self, uploads: Uploads) -> Classified:
        """Uploads through the model's handler and batcher (``app.engine.uploads``): per
        request, one answer per image. ``name`` None: the default model."""
        model = self._upload_model(uploads.name, uploads.version)
        work = run_uploads(model, uploads, self.settings.limits, self._measured)
        if tracing.tracer is not None and uploads.traceparents:
            return await tracing.tracer.engine(uploads.traceparents, work)
        return await work

    def _upload_model(self, name: str | None, version: str | None) -> LoadedModel:
        if name is None:
            return self.models.default(self.settings.models.default_model)
        return self.models.get(name, version)


def shape_output(model: LoadedModel, out: RequestedOutput, outputs: Tensors) -> np.ndarray:
    value = outputs[out.name]
    if out.classification:
        return classify(value, out.classification, model.labels)
    return value
