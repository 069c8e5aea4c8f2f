"""The data plane: requests in, answers out, for every model the registry serves.

Routes parse HTTP and serialise what a method here returns; this module decodes a request,
validates it against the model, keys it for batching once, runs it through the model's
batcher and shapes the answer. Models are loaded, served and closed by ``app.engine.models``. It is
created in the lifespan (never at import) and lives in ``app.state.plane``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np
from prometheus_client import generate_latest

from app.engine.batcher import Tensors
from app.errors import BadRequest, DeadlineExceeded, StokerError, Unavailable
from app.engine.handlers import check_uploads
from app.engine.models import LoadedModel
from app.protocol import (
    InferRequest,
    Regions,
    RequestedOutput,
    classify,
    decode_request,
    encode_response,
)
from app.engine.registry import Registry
from app.settings import Settings
from app.engine.shared_memory import SharedRegions
from engines.spec import ModelSpec, TensorSpec, v2_datatype

log = logging.getLogger(__name__)
T = TypeVar("T")
# Bodies above this are decoded on a worker thread so a large JSON tensor never stalls the loop.
THREADED_DECODE_BYTES = 256 * 1024


@dataclass
class Slot:
    """A lent piece of shared memory a request body is read into (``app.frontend.remote``): at
    ``offset`` in its front end's arena, ``len(view)`` bytes."""

    offset: int
    view: memoryview
    engine_holds: bool = False
    """Set while the engine may still read it (sent, not answered): not reusable yet."""
    returned: bool = False


@dataclass(frozen=True)
class Answer:
    """What one request gets: which model and version answered, and the payload."""

    model: str
    version: str
    request_id: str | None
    outputs: list[tuple[RequestedOutput, np.ndarray]]
    headers: dict[str, str]
    content: bytes
    """The encoded response (the data plane encodes it as part of the request's work)."""

    def encode(self) -> tuple[bytes, dict[str, str]]:
        """The response body and its HTTP headers."""
        return self.content, self.headers


@dataclass(frozen=True)
class Contract:
    """What decoding and validating a V2 request for one served model version takes: the
    model's tensors, which input also takes UINT8 pixels, its priority levels. A front end
    holds a copy (``as_json``/``from_json``) and decodes requests itself, so only tensors
    reach the engine."""

    model: str
    version: str
    spec: ModelSpec
    pixels: str | None
    priority_levels: int

    @classmethod
    def of(cls, model: LoadedModel) -> Contract:
        levels = model.entry.config.dynamic_batching.priority_levels
        return cls(model.name, model.version, model.spec, model.inputs.pixels, levels)

    def as_json(self) -> dict[str, Any]:
        def tensors(specs: Sequence[TensorSpec]) -> list[list[Any]]:
            return [[t.name, t.datatype, list(t.shape)] for t in specs]

        spec = self.spec
        return {
            "model": self.model,
            "version": self.version,
            "name": spec.name,
            "inputs": tensors(spec.inputs),
            "outputs": tensors(spec.outputs),
            "max_batch_size": spec.max_batch_size,
            "pixels": self.pixels,
            "priority_levels": self.priority_levels,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Contract:
        def tensors(items: list[list[Any]]) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(n, d, tuple(shape)) for n, d, shape in items)

        spec = ModelSpec(
            value["name"],
            tensors(value["inputs"]),
            tensors(value["outputs"]),
            int(value["max_batch_size"]),
        )
        return cls(
            value["model"], value["version"], spec, value["pixels"], value["priority_levels"]
        )


@dataclass(frozen=True)
class Decoded:
    """A V2 request decoded and validated against its model's ``Contract``."""

    request: InferRequest
    rows: int
    wanted: list[RequestedOutput]


def decode_infer(
    contract: Contract,
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    max_json_depth: int,
    regions: Regions | None,
) -> Decoded:
    """Decode a V2 request and check it against the model: inputs, rows, outputs,
    priority. Every refusal is a ``BadRequest``."""
    spec = contract.spec
    request = decode_request(body, header_length, spec, max_json_depth, regions)
    rows = validate_inputs(spec, request.inputs, contract.pixels)
    wanted = requested_outputs(spec, request)
    if request.priority > contract.priority_levels:
        raise BadRequest(
            f"priority {request.priority} exceeds the model's {contract.priority_levels} level(s)"
        )
    return Decoded(request, rows, wanted)


@dataclass(frozen=True)
class Part:
    """One decoded request of those ``DataPlane.run`` runs together."""

    inputs: dict[str, np.ndarray]
    rows: int
    wanted: Sequence[RequestedOutput]


class Plane(Protocol):
    """What the routes call: this process's ``DataPlane``, or, in a front-end process, the
    ``app.frontend.remote.RemotePlane`` that forwards to the engine process."""

    draining: bool
    failed: BaseException | None

    @property
    def alive(self) -> bool: ...
    @property
    def is_ready(self) -> bool: ...
    @property
    def max_images(self) -> int: ...
    def engines(self) -> list[dict[str, object]]: ...
    async def start(self) -> None: ...
    def begin_drain(self) -> None: ...
    def drain_time_left(self) -> float: ...
    async def drain(self) -> None: ...
    async def stop(self) -> None: ...
    async def check(self, name: str, version: str | None = None) -> None: ...
    async def metadata(self, name: str, version: str | None = None) -> dict[str, object]: ...
    async def version_ready(self, name: str, version: str | None = None) -> dict[str, object]: ...
    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]: ...
    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> list[object]: ...
    async def repository_index(self) -> list[dict[str, str]]: ...
    async def metrics_text(self) -> bytes: ...
    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None: ...
    async def shm_unregister(self, name: str | None = None) -> None: ...
    async def shm_status(self, name: str | None = None) -> list[dict[str, object]]: ...
    def body_buffer(self, declared: int | None) -> AbstractAsyncContextManager[Slot | None]: ...
    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        slot: Slot | None = None,
        client: str = "",
    ) -> Answer: ...
    async def classify_images(
        self,
        name: str | None,
        version: str | None,
        uploads: Sequence[bytes],
        k: int | None,
        client: str = "",
    ) -> tuple[str, str, list[Any]]: ...


class PlaneState:
    """What every plane keeps the same way: the drain's clock and the request limits."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.failed: BaseException | None = None
        self.draining = False
        self._drain_deadline = 0.0
        # Requests this plane has not answered yet: what a drain waits for.
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def engines(self) -> list[dict[str, object]]:
        """Each engine process and whether it is ready, where a front end has several (one
        per GPU); empty where there is one."""
        return []

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a request as unanswered while the block runs (``all_answered`` waits)."""
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def all_answered(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, for at most ``timeout_s``; whether none is."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def begin_drain(self) -> None:
        """From now on readiness is false and new inference requests get 503; the drain
        timeout starts. Sets plain attributes only, so a signal handler may call it."""
        if not self.draining:
            self.draining = True
            self._drain_deadline = time.monotonic() + self.settings.server.drain_timeout_s

    def drain_time_left(self) -> float:
        """Seconds left of the drain timeout (0 before a drain begins)."""
        return max(0.0, self._drain_deadline - time.monotonic())

    @property
    def max_images(self) -> int:
        """Most images one upload request may carry (the form parser stops past it)."""
        return self.settings.limits.max_images_per_request


class DataPlane(PlaneState):
    def __init__(self, settings: Settings, one_device: bool = False) -> None:
        super().__init__(settings)
        self.models = Registry(settings, one_device)
        self.regions = SharedRegions()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model (``Registry.load_all``); readiness follows."""
        await self.models.load_all()

    def begin_drain(self) -> None:
        """As ``PlaneState.begin_drain``, and a build running in a worker thread stops."""
        self.models.stopping.set()
        super().begin_drain()

    async def drain(self) -> None:
        """Begin draining, wait until every accepted request has its answer or the drain
        timeout passes, then fail what is still queued with 503 (a batch already running
        finishes: a runner's thread cannot be interrupted)."""
        self.begin_drain()
        if not await self.all_answered(self.drain_time_left()):
            log.warning("drain timeout: %d request(s) still in flight", self._active)
        await self.models.close_batchers(self.drain_time_left())

    async def stop(self) -> None:
        """Drain (if no drain ran yet), then free runners and engines in reverse order of
        loading."""
        self.begin_drain()
        await self.models.close_batchers(self.drain_time_left())
        await self.models.close()
        self.regions.close()

    # -- state --------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """The registry is ready (loading over, something serves, all of it healthy) and no
        drain has begun."""
        return self.models.ready and not self.draining

    @property
    def alive(self) -> bool:
        """False once loading failed or a model stopped on an unrecoverable engine fault: the
        process cannot heal itself, so liveness fails and the orchestrator restarts it."""
        return self.failed is None and self.models.healthy

    async def check(self, name: str, version: str | None = None) -> None:
        """Raise what a request to this model would get (404, 503) before its body is read."""
        self.models.get(name, version)

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

    async def version_ready(self, name: str, version: str | None = None) -> dict[str, object]:
        model = self.models.get(name, version)
        return {"name": model.name, "version": model.version, "ready": model.ready}

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model configuration, as its clients read it."""
        model = self.models.get(name, version)
        config = model.entry.config
        batching = config.dynamic_batching
        spec = model.spec

        def tensor(t: TensorSpec) -> dict[str, Any]:
            return {"name": t.name, "data_type": f"TYPE_{t.datatype}", "dims": list(t.shape)}

        return {
            "name": spec.name,
            "platform": f"{model.backend}_onnx",
            "backend": model.backend,
            "max_batch_size": spec.max_batch_size,
            "input": [tensor(t) for t in spec.inputs],
            "output": [tensor(t) for t in spec.outputs],
            "dynamic_batching": {
                "preferred_batch_size": batching.preferred_batch_size,
                "max_queue_delay_microseconds": batching.max_queue_delay_us,
                "priority_levels": batching.priority_levels,
                "default_queue_policy": {
                    "max_queue_size": batching.max_queue_size,
                    "default_timeout_microseconds": batching.default_timeout_us,
                },
            },
            "instance_group": [{"count": model.pool.size, "kind": model.backend}],
            "version_policy": {"specific": {"versions": self.models.versions(name)}},
            "default_version": config.default_precision,
            "labels": config.labels,
        }

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

    async def repository_index(self) -> list[dict[str, str]]:
        return self.models.index()

    # -- inference ----------------------------------------------------------------------

    async def _measured(
        self,
        model: LoadedModel,
        work: Callable[[], Awaitable[T]],
        requests: int = 1,
        timed: bool = True,
    ) -> T:
        """Run the work of one request (or of ``requests`` run together), counting the
        outcome and duration of each by reason; refuse it with 503 once the server drains,
        and track it until answered so a drain can wait."""
        started = time.perf_counter()
        try:
            if self.draining:
                raise Unavailable("server is shutting down; retry on another replica")
            with self.in_flight():
                result = await work()
        except StokerError as exc:
            model.metrics.request_failed(exc.reason, time.perf_counter() - started, requests)
            raise
        except asyncio.CancelledError:
            model.metrics.request_failed("cancelled", time.perf_counter() - started, requests)
            raise
        except Exception:
            model.metrics.request_failed("backend", time.perf_counter() - started, requests)
            raise
        model.metrics.request_succeeded(time.perf_counter() - started, requests, timed)
        return result

    def body_buffer(self, declared: int | None) -> AbstractAsyncContextManager[Slot | None]:
        """Where a request body of ``declared`` bytes is read into: in one process, nowhere
        in particular (None: ``read_body`` allocates)."""
        return contextlib.nullcontext(None)

    async def metrics_text(self) -> bytes:
        """The Prometheus exposition of this process."""
        return generate_latest()

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.regions.register(name, key, offset, byte_size)

    async def shm_unregister(self, name: str | None = None) -> None:
        self.regions.unregister(name)

    async def shm_status(self, name: str | None = None) -> list[dict[str, object]]:
        return self.regions.status(name)

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        slot: Slot | None = None,
        client: str = "",
    ) -> Answer:
        """Decode a V2 request, validate it against the model, batch it, shape the answer.
        (``slot``: the shared-memory slot the body was read into, for a plane in another
        process; ignored here.)"""
        model = self.models.get(name, version)
        contract = Contract.of(model)

        async def work() -> Answer:
            arrived = time.monotonic()
            # Under overload most requests are refused: refuse before decoding, not after.
            model.batcher.admit()
            depth = self.settings.limits.max_json_depth
            decode = partial(decode_infer, contract, body, header_length, depth, self.regions)
            if len(body) > THREADED_DECODE_BYTES:
                decoded = await asyncio.to_thread(decode)
            else:
                decoded = decode()
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
            # Encoded here, inside the measured work: an output region too small for its
            # output is this request's 400, counted as such, not a success.
            content, headers = encode_response(
                model.name, model.version, request.id, shaped, self.regions
            )
            return Answer(model.name, model.version, request.id, shaped, headers, content)

        return await self._measured(model, work)

    def serving(self) -> list[tuple[str, str, int]]:
        """The model versions this plane answers now (loaded, not stopped by a fault), each
        with the most rows it takes in one request: what a front end with several engines
        routes by (engines on different GPUs may have shrunk a version to different max
        batches)."""
        return [
            (model.name, model.version, model.spec.max_batch_size)
            for model in self.models.loaded()
            if model.ready
        ]

    def queued_requests(self) -> int:
        """Requests queued or executing over every loaded version: what a front end weighs
        when it chooses between engine processes."""
        return sum(model.batcher.pending for model in self.models.loaded())

    def contract(self, name: str, version: str | None = None) -> Contract:
        """What a front end needs to decode requests for this model version itself."""
        return Contract.of(self.models.get(name, version))

    async def run(
        self,
        name: str,
        version: str | None,
        parts: Sequence[Part],
        timeout_us: int | None,
        priority: int,
        client: str = "",
    ) -> tuple[str, str, list[list[tuple[RequestedOutput, np.ndarray]]]]:
        """Requests a front end decoded and validated (``decode_infer``) and gathered: one
        model, batch key, priority, deadline and client. Their tensors go through the
        batcher as one entry (rows joined: one queue entry and one future for all of them),
        and each gets the outputs it asked for, shaped, for the front end to encode. Each
        request is counted and measured as ``infer`` counts one."""
        model = self.models.get(name, version)

        async def work() -> list[list[tuple[RequestedOutput, np.ndarray]]]:
            arrived = time.monotonic()
            model.batcher.admit(len(parts))
            rows = sum(part.rows for part in parts)
            every = [RequestedOutput(t.name, True) for t in model.spec.outputs]
            raw = await self._batched(
                model,
                [part.inputs for part in parts],
                rows,
                every,
                (timeout_us, priority),
                client,
                arrived,
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

        # The front end times these from the body read to the encoded answer and sends the
        # durations with its state poll (``add_request_durations``): one definition of the
        # request duration in every process model.
        answered = await self._measured(model, work, len(parts), timed=False)
        return model.name, model.version, answered

    def add_request_durations(
        self, name: str, version: str, counts: list[int], total: float
    ) -> None:
        """Durations a front end measured for requests it sent through ``run``."""
        with contextlib.suppress(StokerError):
            self.models.get(name, version).metrics.add_request_durations(counts, total)

    def count_failures(
        self, name: str, version: str, reason: str, count: int, seconds: float
    ) -> None:
        """Requests a front end refused before they reached the engine (a request it could
        not decode): counted with this model's own failures."""
        with contextlib.suppress(StokerError):
            self.models.get(name, version).metrics.request_failed(reason, seconds, count)

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
    ) -> list[tuple[RequestedOutput, np.ndarray]]:
        """Through the batcher; ``blocks``: one request's tensors, or those of gathered ones
        (one batch key), in order; ``scheduling``: the timeout (us) and priority."""
        timeout_us, priority = scheduling
        # The key of what the engine gets: normalised pixels batch with FP32 requests.
        engine_blocks = [model.inputs.for_engine(block) for block in blocks]
        key = batch_key(model.spec, engine_blocks[0])
        timeout = time_left(model.timeout_s(timeout_us), arrived)
        outputs = await model.batcher.infer(
            engine_blocks,
            rows,
            key,
            timeout,
            priority,
            client,
            requests,
        )
        return [(out, shape_output(model, out, outputs)) for out in wanted]

    async def classify_images(
        self,
        name: str | None,
        version: str | None,
        uploads: Sequence[bytes],
        k: int | None,
        client: str = "",
    ) -> tuple[str, str, list[Any]]:
        """Uploads through the model's handler and batcher: one answer per upload (top-k
        labels for the image classifier). ``name`` None: the default model."""
        if name is None:
            model = self.models.default(self.settings.models.default_model)
        else:
            model = self.models.get(name, version)
        handler = model.handler
        if handler is None:
            raise BadRequest(f"model {model.name!r} does not take image uploads")
        top = k if k is not None else self.settings.limits.default_top_k
        if top < 1:
            raise BadRequest("k must be at least 1")
        check_uploads(uploads, self.settings.limits)

        async def work() -> list[Any]:
            arrived = time.monotonic()
            model.batcher.admit()
            inputs = await handler.decode(uploads)
            rows = len(next(iter(inputs.values())))
            timeout = time_left(model.timeout_s(None), arrived)
            step = model.spec.max_batch_size or 1
            key = batch_key(model.spec, inputs)
            chunks = [
                {n: value[i : i + step] for n, value in inputs.items()}
                for i in range(0, rows, step)
            ]
            results = await asyncio.gather(
                *(
                    model.batcher.infer(c, len(next(iter(c.values()))), key, timeout, 0, client)
                    for c in chunks
                )
            )
            outputs = {
                t.name: np.concatenate([r[t.name] for r in results]) for t in model.spec.outputs
            }
            return handler.encode(outputs, top)

        return model.name, model.version, await self._measured(model, work)


def shape_output(model: LoadedModel, out: RequestedOutput, outputs: Tensors) -> np.ndarray:
    value = outputs[out.name]
    if out.classification:
        return classify(value, out.classification, model.labels)
    return value


def time_left(timeout_s: float | None, arrived: float) -> float | None:
    """What is left of a request's deadline after decoding it; 504 if nothing is (it never
    reaches the queue, let alone a runner)."""
    if timeout_s is None:
        return None
    left = timeout_s - (time.monotonic() - arrived)
    if left <= 0:
        raise DeadlineExceeded(f"deadline of {timeout_s * 1000:g} ms passed while decoding")
    return left


def validate_inputs(
    spec: ModelSpec, inputs: dict[str, np.ndarray], pixels: str | None = None
) -> int:
    """Check a request's tensors against the model and return its rows. The ``pixels``
    input also takes UINT8 pixels of its declared shape."""
    missing = [t.name for t in spec.inputs if t.name not in inputs]
    if missing:
        raise BadRequest(f"missing input(s): {', '.join(missing)}")
    unknown = [name for name in inputs if spec.input(name) is None]
    if unknown:
        expected = ", ".join(t.name for t in spec.inputs)
        raise BadRequest(f"unknown input(s): {', '.join(unknown[:8])}; the model takes {expected}")
    rows: int | None = None
    for tensor in spec.inputs:
        value = inputs[tensor.name]
        if not (tensor.name == pixels and value.dtype == np.uint8):
            check_datatype(tensor, value, pixels=tensor.name == pixels)
        shape = tuple(value.shape)
        row_shape = shape[1:] if spec.batched else shape
        if spec.batched:
            if not shape:
                raise BadRequest(f"input {tensor.name!r} needs a batch dimension")
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise BadRequest(f"inputs disagree on the batch size ({rows} vs {shape[0]})")
        if not tensor.matches(row_shape):
            raise BadRequest(
                f"input {tensor.name!r}: shape {list(shape)} does not match "
                f"{spec.full_shape(tensor)}"
            )
    rows = rows if rows is not None else 1
    if spec.batched and not 1 <= rows <= spec.max_batch_size:
        raise BadRequest(f"batch of {rows} rows; the model takes 1 to {spec.max_batch_size}")
    return rows


def batch_key(spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """The batch key: requests share a batch only when every input has the same datatype
    and row shape (of what the engine gets, after the input policy)."""
    return tuple(
        (value.dtype.str, *(value.shape[1:] if spec.batched else value.shape))
        for value in (inputs[tensor.name] for tensor in spec.inputs)
    )


def check_datatype(tensor: TensorSpec, value: np.ndarray, pixels: bool = False) -> None:
    got = v2_datatype(value.dtype)
    if got != tensor.datatype:
        also = " (or UINT8 pixels)" if pixels else ""
        raise BadRequest(
            f"input {tensor.name!r}: datatype {got}, the model takes {tensor.datatype}{also}"
        )


def requested_outputs(spec: ModelSpec, request: InferRequest) -> list[RequestedOutput]:
    if not request.outputs:
        return [RequestedOutput(t.name, request.binary_data_output, 0) for t in spec.outputs]
    unknown = [o.name for o in request.outputs if spec.output(o.name) is None]
    if unknown:
        raise BadRequest(f"unknown output(s): {', '.join(unknown[:8])}")
    return list(request.outputs)
