"""The control channel's messages, declared once: what a front end asks an engine process and
what it answers.

Every call is a frozen ``msgspec`` struct tagged with its ``Op``; every answer is one of the
reply structs. The hot path's calls are typed each (``Run``, ``Infer``, ``Classify``, the
poll); every control operation is one ``Control`` naming the engine's method, which the
engine's control table allows (``Welcome``). A frame's header is ``CallHeader``: the call
number, the wire version and the message, so the engine decodes and checks a frame in one
step and dispatches it by type (``app.engine.process``). Tensors cross as ``TensorRef``: a
typed reference to bytes in the front end's arena or the frame's payload, never the bytes
themselves and never a pickle.

Every frame carries its sender's wire version: a frame of another version is answered with a
``BadFrame`` naming both versions (``checked``), and one that does not decode with a
``Failure`` that says why.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

WIRE_VERSION = 5
"""Raised whenever a message changes shape: front ends and engines of one release agree."""


class Op(enum.StrEnum):
    HELLO = "hello"
    CANCEL = "cancel"
    STATE = "state"
    DESCRIBE = "describe"
    RUN = "run"
    INFER = "infer"
    CLASSIFY = "classify"
    CONTROL = "control"


class Spread(enum.StrEnum):
    """Where a front end before several engines sends a control call, and what it makes of
    their answers (``RemoteEngine.control``); an engine declares it beside each of its
    control methods (``app.engine.local.control``)."""

    MODEL = "model"
    """To the one engine a request for the model its first two arguments name goes to."""
    ANY = "any"
    """To any one engine (they all hold the same)."""
    SUMMED = "summed"
    """To every engine; their statistics added up."""
    WORST = "worst"
    """To every engine; their repository indexes as one, each model at the state of the
    engine furthest from serving."""
    LABELLED = "labelled"
    """To every engine; their Prometheus texts as one, labelled by GPU (bytes)."""
    AT_ONCE = "at_once"
    """To every engine at once, refused while the front end drains; the contracts it cached
    are dropped (the served set changes)."""
    ALL_OR_NONE = "all_or_none"
    """To every engine in turn; where one refuses, undone on those that did it (``undo``)."""
    IN_TURN = "in_turn"
    """To every engine in turn."""
    ADOPTED = "adopted"
    """To every engine; the trace and log settings each answers with adopted here."""


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    """A call's fields; its tag (``op``) is its ``Op``."""


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """Where a tensor's bytes are: ``size`` bytes at ``offset`` in its slot, or in the frame's
    payload when the message has no slot."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    size: int


class SlotRef(msgspec.Struct, frozen=True, array_like=True):
    """The piece of a front end's arena lent to one request: ``capacity`` bytes at
    ``offset``."""

    offset: int
    capacity: int


class Wanted(msgspec.Struct, frozen=True, array_like=True):
    """An output a request asked for; ``classification``: top-k labels instead of values."""

    name: str
    classification: int = 0


class Durations(msgspec.Struct, frozen=True, array_like=True):
    """How long a front end's requests of one model version took: histogram bucket counts
    and the total."""

    model: str
    version: str
    counts: tuple[int, ...]
    total: float


class Refused(msgspec.Struct, frozen=True, array_like=True):
    """HTTP refusals a front end made since its last poll (status, reason, how many)."""

    status: int
    reason: str
    count: float


class Failed(msgspec.Struct, frozen=True, array_like=True):
    """Requests a front end refused before they reached an engine (it could not decode
    them): counted with the model's own failures."""

    model: str
    version: str
    reason: str
    count: int
    mean_s: float


class Serving(msgspec.Struct, frozen=True, array_like=True):
    """A model version an engine answers, with the most rows it takes in one request."""

    model: str
    version: str
    max_batch: int


# -- calls ---------------------------------------------------------------------------------


class Hello(_Message, frozen=True, tag=Op.HELLO.value):
    """The first call on a connection: the front end's arena (its wire version is the
    frame's, checked as every frame's is); answered with a ``Welcome``."""

    arena: str
    slot_bytes: int


class Cancel(_Message, frozen=True, tag=Op.CANCEL.value):
    """Every caller of call ``of`` went away: drop it if it has not run (no answer of its
    own; call ``of`` is still answered once)."""

    of: int


class State(_Message, frozen=True, tag=Op.STATE.value):
    """The poll: the engine's state, carrying what the front end measured since the last."""

    durations: tuple[Durations, ...] = ()
    refused: tuple[Refused, ...] = ()
    failed: tuple[Failed, ...] = ()


class Describe(_Message, frozen=True, tag=Op.DESCRIBE.value):
    """The contract of a model version (``app.contract.Contract``); ``name`` None: the
    default model's (the one ``POST /infer`` serves)."""

    name: str | None
    version: str | None = None


class RunItem(msgspec.Struct, frozen=True, array_like=True):
    """One decoded request of a ``Run``: its inputs, rows, the outputs it wants, its slot."""

    inputs: tuple[TensorRef, ...]
    rows: int
    outputs: tuple[Wanted, ...]
    slot: SlotRef | None = None
    traceparent: str | None = None
    """Where the request is traced: the W3C context of its front end's ``engine call`` span,
    which the engine's spans continue (``app.tracing``)."""


class Run(_Message, frozen=True, tag=Op.RUN.value):
    """Requests a front end decoded and gathered (one batch key, deadline, priority and
    client), run as one queue entry."""

    name: str
    version: str
    timeout_us: int | None
    priority: int
    client: str
    items: tuple[RunItem, ...]
    spent_us: int = 0
    """How long its oldest request has been on its way: its deadline counts from there."""
    serial: int = 0
    """The serial of the contract its requests were decoded against (``Contract.serial``):
    one a reload replaced is refused, to be decoded again."""
    sent_ns: int = 0
    """When the front end wrote it (wall clock): a traced request's ``engine`` span notes
    it, so its way to the engine splits into the front end's, the link's and the engine's."""


class Infer(_Message, frozen=True, tag=Op.INFER.value):
    """A V2 body as it came, for the engine to decode: it names shared-memory regions, which
    the engine holds. In ``slot`` (its first ``length`` bytes) or the payload."""

    name: str
    version: str | None
    header_length: int | None
    client: str
    slot: SlotRef | None = None
    length: int = 0
    traceparent: str | None = None
    """As ``RunItem.traceparent``."""


class Classify(_Message, frozen=True, tag=Op.CLASSIFY.value):
    """Image uploads of ``sizes`` bytes each, one after the other in ``slot`` or the payload;
    ``counts``: the images of each request a front end gathered (empty: one request)."""

    name: str | None
    version: str | None
    k: int | None
    sizes: tuple[int, ...]
    client: str
    slot: SlotRef | None = None
    counts: tuple[int, ...] = ()
    row_preprocess: dict[str, Any] | None = None
    """Set where the front end made each image an input row itself: the preprocessing it
    used (``ImagePreprocess`` as JSON), each image then a UINT8 row."""
    traceparents: tuple[str | None, ...] = ()
    """Each request's trace context where any is traced (as ``RunItem.traceparent``)."""
    sent_ns: int = 0
    """When the front end wrote it (as ``Run.sent_ns``)."""


class Control(_Message, frozen=True, tag=Op.CONTROL.value):
    """A control operation: the engine's method ``method`` (one its control table names,
    ``Welcome.control``) called with ``args``; answered with a ``Value`` of what it returns
    (bytes: ``Done``, the bytes in the payload)."""

    method: str
    args: tuple[Any, ...] = ()


Call = Hello | Cancel | State | Describe | Run | Infer | Classify | Control

# -- replies -------------------------------------------------------------------------------


class _Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="reply"):
    pass


class Failure(_Reply, frozen=True, tag="failure"):
    """A refusal or an error, with the HTTP status and the metrics' reason it carries."""

    error: str
    status: int
    reason: str = "other"


class Done(_Reply, frozen=True, tag="done"):
    """Done, nothing to say (bytes a control method returned are in the payload)."""


class Rule(msgspec.Struct, frozen=True, array_like=True):
    """How a control method's calls spread over several engines; ``undo``: the method that
    undoes one (``Spread.ALL_OR_NONE``), called with the first argument; ``restore``: the
    method that gives an engine one entry of the list this one reports, called with the
    entry's values (a front end copies that state to an engine that came back without it)."""

    spread: Spread
    undo: str | None = None
    restore: str | None = None


class Welcome(_Reply, frozen=True, tag="welcome"):
    """The answer to ``Hello``: the engine's control methods and how each spreads."""

    control: dict[str, Rule]


class Value(_Reply, frozen=True, tag="value"):
    """A JSON document the front end passes on as it is (metadata, config, statistics); of
    a ``Spread.ADOPTED`` call, the answer and the settings the engine runs with now."""

    value: Any


class EngineState(_Reply, frozen=True, tag="state"):
    alive: bool
    ready: bool
    queued: int
    """Requests queued or running over every version: what routing weighs."""
    serving: tuple[Serving, ...]
    generation: int = 0
    """Moves whenever a model is loaded, reloaded or unloaded: a front end then drops the
    contracts it cached from this engine."""
    observed: dict[str, Any] | None = None
    """The trace and log settings it runs with (``app.observed``'s snapshot): a front end
    adopts them where they are newer than its own."""


GONE = EngineState(alive=False, ready=False, queued=0, serving=())
"""What a front end holds for an engine it cannot reach."""


class ItemReply(msgspec.Struct, frozen=True, array_like=True):
    """One request's outputs of a ``Run``: in its slot (``in_slot``), else in the payload."""

    outputs: tuple[TensorRef, ...]
    in_slot: bool


class RanReply(_Reply, frozen=True, tag="ran"):
    model: str
    version: str
    items: tuple[ItemReply, ...]


class Inferred(_Reply, frozen=True, tag="inferred"):
    """An encoded V2 answer: in the request's slot (its first ``slot_length`` bytes) or the
    payload."""

    model: str
    version: str
    headers: dict[str, str]
    slot_length: int | None = None


class ClassifiedReply(_Reply, frozen=True, tag="classified"):
    """Per request, its top-k labels per upload or its failure: JSON in the payload (k labels
    per image can be megabytes), a list of ``{"answers": [...]}`` or ``{"error": ...,
    "status": ..., "reason": ...}``, one per request."""

    model: str
    version: str


Reply = Failure | Done | Welcome | Value | EngineState | RanReply | Inferred | ClassifiedReply

CANCELLED = Failure("cancelled", 499, "cancelled")


class CallHeader(msgspec.Struct, frozen=True, array_like=True):
    """A call's header: its number, the sender's wire version and the message."""

    id: int
    wire: int
    message: msgspec.Raw


class ReplyHeader(msgspec.Struct, frozen=True, array_like=True):
    """A reply's header: the number of the call it answers and the reply."""

    id: int
    reply: Reply


class BadFrame(ValueError):
    """A call that is not one of ours: its number (-1 if unknown) and why."""

    def __init__(self, number: int, why: str) -> None:
        super().__init__(why)
        self.number = number


_frame = msgspec.json.Decoder(CallHeader)
_call: msgspec.json.Decoder[Call] = msgspec.json.Decoder(Call)
_answer = msgspec.json.Decoder(ReplyHeader)
_encoder = msgspec.json.Encoder()


def encode_call(number: int, call: Call) -> bytes:
    return _encoder.encode(CallHeader(number, WIRE_VERSION, msgspec.Raw(_encoder.encode(call))))


def decode_call(header: bytes) -> tuple[int, Call]:
    """A frame's number and call; ``BadFrame`` for one of another wire version, an unknown
    op or fields that do not fit it."""
    try:
        frame = _frame.decode(header)
    except msgspec.DecodeError as error:
        raise BadFrame(-1, f"not a Stoker frame: {error}") from None
    if frame.wire != WIRE_VERSION:
        raise BadFrame(
            frame.id,
            f"a front end of wire version {frame.wire}; this engine speaks {WIRE_VERSION} "
            "(run front ends and engines of one release)",
        )
    try:
        return frame.id, _call.decode(frame.message)
    except msgspec.DecodeError as error:
        raise BadFrame(frame.id, f"a call this engine does not know: {error}") from None


def encode_answer(number: int, reply: Reply) -> bytes:
    return _encoder.encode(ReplyHeader(number, reply))


def decode_answer(header: bytes) -> ReplyHeader:
    return _answer.decode(header)
