"""What both rooms agree on about a request: a served model version's contract, a V2 request
decoded and validated against it, the batch key, and an encoded answer.

A front end decodes requests with the ``Contract`` its engine described, so only tensors
reach the engine; the engine keys its batches with the same ``batch_key``. Light on purpose
(numpy and the V2 codec): importing it loads no engine code.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.decode_plans import MAX_HEADER_BYTES, DecodePlans, Plan, PlanKey
from app.errors import BadRequest, Forbidden, StokerError, Unavailable, client_text
from app.json_bounds import LARGE_DECODES, check_json_size, json_part
from app.protocol import InferRequest, Regions, RequestedOutput, decode_request
from app.settings import LimitSettings, ModelRepositorySettings
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec, v2_datatype

# Bodies above this are decoded on a worker thread so a large JSON tensor never stalls the loop.
THREADED_DECODE_BYTES = 256 * 1024

PLANS = DecodePlans()
"""The process's plans of binary requests' JSON (``app.decode_plans``), shared by its models:
a plan's key names its model's terms."""


def draining() -> Unavailable:
    """What a request gets once the server drains (every room refuses with it)."""
    return Unavailable("server is shutting down; retry on another replica")


def control_refusal(models: ModelRepositorySettings, keyed: bool) -> StokerError | None:
    """What a model load or unload gets under ``models`` (its ``control`` mode and
    ``control_without_keys``) on a server with API keys or not (``keyed``); None: taken. The
    data plane refuses with it before reading the body, the engine again on arrival."""
    if models.control == "none":
        return BadRequest(
            "model control is off (models.control is none: the models are fixed at "
            "start); set STOKER_MODELS__CONTROL=explicit to load and unload models"
        )
    if models.control == "poll":
        return BadRequest(
            "explicit model load / unload is not allowed in poll mode (models.control "
            "is poll: changes to the repository's files load and unload models)"
        )
    if not keyed and not models.control_without_keys:
        # A load reads the server's files and builds engines: Triton, too, keeps model
        # control to its operators.
        return Forbidden(
            "model control needs API keys (auth.api_keys or auth.api_keys_file); to "
            "allow it without keys, set STOKER_MODELS__CONTROL_WITHOUT_KEYS=true"
        )
    return None


@dataclass(frozen=True)
class Answer:
    """What one V2 request gets: which model and version answered, and the encoded body."""

    model: str
    version: str
    headers: dict[str, str]
    content: bytes

    def encode(self) -> tuple[bytes, dict[str, str]]:
        """The response body and its HTTP headers."""
        return self.content, self.headers


@dataclass(frozen=True)
class Contract:
    """What decoding and validating a V2 request for one served model version takes: the
    model's tensors, which input also takes UINT8 pixels, its priority levels. An engine
    describes it (``as_json``) and a front end decodes requests with it (``from_json``)."""

    model: str
    version: str
    spec: ModelSpec
    pixels: str | None
    priority_levels: int
    serial: int = 0
    """Names the contract's terms (``serial_of``: equal terms, equal serial, in every engine
    process): an engine serving other terms since a reload checks a request decoded against
    these before it runs it (``app.errors.Reloaded`` if it does not fit). 0: unnamed."""
    row_preprocess: ImagePreprocess | None = None
    """How a front end may make the model's input rows of its uploads itself (UINT8): set
    where the engine would decode them on the CPU (``LoadedModel.row_preprocess``)."""

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
            "serial": self.serial,
            "row_preprocess": None
            if self.row_preprocess is None
            else self.row_preprocess.model_dump(mode="json"),
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
            value["model"],
            value["version"],
            spec,
            value["pixels"],
            value["priority_levels"],
            value.get("serial", 0),
            None
            if value.get("row_preprocess") is None
            else ImagePreprocess(**value["row_preprocess"]),
        )


def serial_of(spec: ModelSpec, pixels: str | None, priority_levels: int) -> int:
    """The ``Contract.serial`` of these terms: a digest of them, so that every engine
    process, and a reload that keeps them, names them alike (never 0)."""

    def tensors(specs: Sequence[TensorSpec]) -> list[list[Any]]:
        return [[t.name, t.datatype, list(t.shape)] for t in specs]

    terms = [tensors(spec.inputs), tensors(spec.outputs), spec.max_batch_size, pixels]
    digest = hashlib.blake2b(json.dumps([*terms, priority_levels]).encode(), digest_size=8)
    return (int.from_bytes(digest.digest(), "big") >> 1) or 1


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
    priority. Every refusal is a ``BadRequest`` (``PayloadTooLarge`` for JSON that holds
    more than the model can take, before it is parsed). A binary request whose JSON a
    request of the same terms sent before is read by that decode's plan (``PLANS``)."""
    header = json_part(body, header_length)
    key: PlanKey | None = None
    binary = memoryview(body)[len(header) :]  # what follows the JSON (a binary request's tensors)
    planned = header_length is not None and header_length > 0 and len(header) <= MAX_HEADER_BYTES
    if planned and contract.serial:
        key = (contract.serial, max_json_depth, bytes(header), len(binary))
        plan = PLANS.get(key)
        if plan is not None:
            return Decoded(*plan.decode(binary))
    check_json_size(contract.spec, header)
    request = decode_request(body, header_length, contract.spec, max_json_depth, regions)
    decoded = checked(contract, request)
    if key is not None and PLANS.again(key) and plannable(key[2]):
        plan = Plan.of(request, decoded.rows, decoded.wanted, binary)
        if plan is not None:
            PLANS.keep(key, plan)
    return decoded


def checked(contract: Contract, request: InferRequest) -> Decoded:
    """A decoded request checked against the model's contract (``decode_infer``'s checks;
    again against a new contract after a reload)."""
    spec = contract.spec
    rows = validate_inputs(spec, request.inputs, contract.pixels)
    wanted = requested_outputs(spec, request)
    if request.priority > contract.priority_levels:
        raise BadRequest(
            f"priority {request.priority} exceeds the model's {contract.priority_levels} level(s)"
        )
    return Decoded(request, rows, wanted)


async def decode_infer_async(
    contract: Contract,
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    limits: LimitSettings,
    regions: Regions | None,
) -> Decoded:
    """``decode_infer`` within ``limits`` where the event loop can afford it: small bodies on
    the loop, larger ones on a worker thread, and those with more than 256 KiB of JSON
    through ``LARGE_DECODES`` (at most ``limits.max_json_decodes`` at once in this process).
    The one V2 decoding, a front end's and an engine's."""

    def decode() -> Decoded:
        return decode_infer(contract, body, header_length, limits.max_json_depth, regions)

    if len(body) <= THREADED_DECODE_BYTES:
        return decode()
    header = json_part(body, header_length)
    if len(header) > THREADED_DECODE_BYTES:
        return await LARGE_DECODES.run(decode, limits.max_json_decodes)
    if not elementwise(header):
        # Small JSON before binary tensors that become views of the body: microseconds,
        # cheaper on the loop than a thread's hand-off (32 images are 4.8 MB of them).
        return decode()
    return await asyncio.to_thread(decode)


def elementwise(header: memoryview) -> bool:
    """Whether a V2 body's JSON may name a datatype whose binary data is decoded element by
    element (BYTES strings, BOOL), work in proportion to its bytes; every other datatype
    becomes a view of the body; or names a shared-memory region, read out of its file. A
    byte search, not a parse (an escaped letter could spell either name, so any ``\\u``
    escape counts too): a false alarm costs a thread."""
    data = bytes(header)
    return any(name in data for name in ELEMENTWISE)


ELEMENTWISE = (b"BYTES", b"BOOL", b"\\u", b"shared_memory_region")
"""What in a V2 body's JSON makes its decoding work in proportion to its bytes: the two
element-wise datatypes, an escape that could spell one, and a system shared-memory region
(the engine reads a region's bytes out of its file)."""


def plannable(header: bytes) -> bool:
    """Whether a decode of ``header`` may be kept as a plan (``app.decode_plans``): nothing
    decoded element by element (``elementwise``) and no shared-memory parameter at all
    (whether one is taken depends on the caller's regions, which no plan's key names)."""
    return not elementwise(memoryview(header)) and b"shared_memory" not in header


@dataclass(frozen=True)
class Part:
    """One decoded request of those an engine runs together (``Run``): its tensors, rows and
    wanted outputs (a front end's transport may say more of it: ``app.frontend.arena.InSlot``)."""

    inputs: dict[str, np.ndarray]
    rows: int
    wanted: Sequence[RequestedOutput]
    arrived: float | None = None
    """When it arrived (``time.monotonic``): its deadline counts from there, decoding and
    the trip to the engine included."""
    traceparent: str | None = None
    """Its trace context where it is traced (``app.tracing``)."""


@dataclass(frozen=True)
class Frame:
    """Decoded requests that run as one queue entry: one model version, batch key, deadline
    (``timeout_us``), priority and client (``app.frontend.gathering`` gathers them)."""

    model: str
    version: str
    parts: Sequence[Part]
    timeout_us: int | None
    priority: int
    client: str
    serial: int = 0
    """The serial of the contract its requests were decoded against (``Contract.serial``)."""


@dataclass(frozen=True)
class Raw:
    """A V2 body as it came, for the engine to decode (it names shared-memory regions, which
    the engine holds)."""

    name: str
    version: str | None
    body: bytes | bytearray | memoryview
    header_length: int | None
    client: str
    traceparent: str | None = None
    """Its trace context where it is traced (``app.tracing``)."""


@dataclass(frozen=True)
class Uploads:
    """Image uploads for a model's handler: ``name`` None is the default model; ``k``: how
    many labels each answer has (None: the server's default). ``counts``: the images of each
    request, in order, where a front end gathered several (``app.frontend.gathering``;
    empty: one)."""

    name: str | None
    version: str | None
    images: Sequence[bytes | memoryview]
    k: int | None
    client: str
    counts: tuple[int, ...] = ()
    row_preprocess: ImagePreprocess | None = None
    """Set where the front end made each image a model input row with this preprocessing
    (``Contract.row_preprocess``): the images are those rows (UINT8), not files."""
    traceparents: tuple[str | None, ...] = ()
    """Each request's trace context where any is traced (``app.tracing``; empty: none)."""

    def requests(self) -> list[Sequence[bytes | memoryview]]:
        """Each request's images."""
        if not self.counts:
            return [self.images]
        parts, at = [], 0
        for count in self.counts:
            parts.append(self.images[at : at + count])
            at += count
        return parts


@dataclass(frozen=True)
class Classified:
    """What an engine answered uploads: the model version, and per request its answers
    (one per image) or the error that request alone gets (an image that is not one)."""

    model: str
    version: str
    answers: list[list[Any] | StokerError]
    received_ns: int = 0
    """When a front end read the engine's answer (wall clock; 0 in one process): a traced
    request's ``engine call`` span notes it."""


@dataclass(frozen=True)
class Ran:
    """What an engine answered a frame: the model version and each request's shaped outputs;
    ``engine``: which engine answered (its label), so durations go to its histograms."""

    model: str
    version: str
    outputs: list[list[tuple[RequestedOutput, np.ndarray]]]
    engine: str = ""
    received_ns: int = 0
    """When a front end read the engine's last answer to the frame (wall clock; 0 in one
    process): a traced request's ``engine call`` span notes it."""


def validate_inputs(
    spec: ModelSpec, inputs: dict[str, np.ndarray], pixels: str | None = None
) -> int:
    """Check a request's tensors against the model and return its rows. The ``pixels``
    input also takes UINT8 pixels of its declared shape."""
    missing = [t.name for t in spec.inputs if t.name not in inputs]
    unknown = [name for name in inputs if spec.input(name) is None]
    if missing or unknown:
        raise BadRequest(input_mismatch(spec, missing, unknown))
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


def input_mismatch(spec: ModelSpec, missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """What is wrong with a request's input names: the model's inputs it lacks, the names
    the model has no input of (cut short, at most 8), and what the model takes."""
    problems = []
    if missing:
        problems.append(f"missing input(s): {', '.join(missing)}")
    if unexpected:
        named = ", ".join(client_text(name) for name in unexpected[:8])
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        problems.append(f"unexpected input(s): {named}{more}")
    expected = ", ".join(t.name for t in spec.inputs)
    return f"{'; '.join(problems)}; the model takes {expected}"


def batch_key(spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """Which requests may share a batch, decided once for both rooms: every input of the
    same datatype and row shape. A front end gathers requests into one frame by it (of what
    they sent); the engine's batcher keys its queue by it (of what the engine gets, after
    the input policy turned UINT8 pixels into the model's datatype)."""
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
        raise BadRequest(f"unknown output(s): {', '.join(client_text(n) for n in unknown[:8])}")
    return list(request.outputs)
