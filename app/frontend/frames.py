"""A frame's crossing to one engine process: its pieces sent in the turn it is sent, and
their replies handed back in the turn each is read; an upload call's (``send_uploads``) the
same way.

A frame larger than the engine takes goes as pieces (``packing.split_frame``), each one call
on the link (``EngineLink.request`` with a callback, not a future: no task wakes up between
the reply and the frame's requests). Each piece's slots stay lent until the engine's last
word on it; the frame is answered once every piece is, with its outputs in order or its
first error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from app import wire
from app.contract import Classified, Frame, Ran, Uploads
from app.frontend.arena import Arena, Slot, slot_of
from app.frontend.links import EngineLink, Then, answered
from app.frontend.packing import (
    classified_answers,
    classify_call,
    ran_outputs,
    run_call,
    split_frame,
)

Released = Callable[[Sequence[Slot], wire.Reply | None], None]
"""What the engine client does at the engine's last word on a call: its slots given back,
its reply (None where the link went away) looked at."""


@dataclass(eq=False)
class Pieces:
    """The answers to a frame's pieces, delivered as one ``Ran`` once the last is in, or as
    the first error."""

    deliver: Callable[[Ran | Exception], None]
    label: str
    left: int
    ran: dict[int, Ran] = field(default_factory=dict)
    error: Exception | None = None

    def add(self, index: int, outcome: Ran | Exception) -> None:
        if isinstance(outcome, Exception):
            self.error = self.error or outcome
        else:
            self.ran[index] = outcome
        self.left -= 1
        if self.left:
            return
        if self.error is not None:
            self.deliver(self.error)
            return
        ran = [self.ran[i] for i in sorted(self.ran)]
        outputs = [one for each in ran for one in each.outputs]
        self.deliver(Ran(ran[0].model, ran[0].version, outputs, self.label, time.time_ns()))


def send_frame(
    link: EngineLink,
    frame: Frame,
    deliver: Callable[[Ran | Exception], None],
    released: Released,
) -> Callable[[], None]:
    """Send ``frame`` over ``link`` now (its bytes written in this turn), split into pieces
    of at most the engine's max batch; ``deliver`` gets its answer or error once. Returns
    what tells the engine it may drop the pieces (every caller went away). Raises where
    nothing could be sent; where a later piece cannot be, those sent are dropped and the
    frame fails with that error once they are answered."""
    pieces = split_frame(frame, link.max_batch(frame.model, frame.version))
    answers = Pieces(deliver, link.label, len(pieces))
    numbers: list[int] = []
    try:
        for index, piece in enumerate(pieces):
            call, payload = run_call(piece)
            slots = [held for part in piece.parts if (held := slot_of(part)) is not None]
            then = partial(piece_answered, link, answers, index, piece)
            numbers.append(
                held_request(link, call, payload, slots, len(piece.parts), then, released)
            )
        if link.writer is not None:
            link.writer.flush()
    except Exception as error:
        if not numbers:
            raise  # nothing was sent: the caller answers its requests with it
        cancel_all(link, numbers)
        for index in range(len(numbers), len(pieces)):
            answers.add(index, error)
    return partial(cancel_all, link, numbers)


def send_uploads(
    link: EngineLink,
    uploads: Uploads,
    slot: Slot | None,
    deliver: Callable[[Classified | Exception], None],
    arena: Arena,
    released: Released,
) -> Callable[[], None]:
    """Send the call of ``uploads`` (their bytes in ``slot`` of ``arena``, or the payload)
    now; ``deliver`` gets the answer or error once, in the turn the reply is read, and the
    slot goes back at the engine's last word (at once where nothing could be sent, which
    raises). Returns what tells the engine nobody waits for it any more."""
    slots = [slot] if slot is not None else []

    def settle(outcome: tuple[wire.Reply, bytes] | Exception) -> None:
        if isinstance(outcome, Exception):
            deliver(outcome)
            return
        reply, data = outcome
        try:
            classified = answered(reply, wire.ClassifiedReply)
            answers = classified_answers(data)
        except Exception as error:
            deliver(error)
            return
        deliver(Classified(classified.model, classified.version, answers, time.time_ns()))

    try:
        call, payload = classify_call(uploads, slot)
        requests = len(uploads.counts) or 1
        number = held_request(link, call, payload, slots, requests, settle, released)
    except BaseException:
        for held in slots:  # nothing was sent
            arena.give_back(held)
        raise
    for held in slots:
        held.abandoned = True  # no caller gives it back: the engine's last word does
    if link.writer is not None:
        link.writer.flush()
    return partial(link.cancel, number)


def held_request(
    link: EngineLink,
    call: wire.Call,
    payload: bytes,
    slots: Sequence[Slot],
    requests: int,
    then: Then,
    released: Released,
) -> int:
    """Send a call of ``requests`` requests whose ``slots`` the engine may read until its
    last word on it: counted in the link's work in flight and the slots held until then;
    at its reply (or the link's end) ``released``, then ``then``. Every call that lends
    slots to an engine goes through here. Returns its number (``EngineLink.cancel``)."""

    def last_word(outcome: tuple[wire.Reply, bytes] | Exception) -> None:
        link.in_flight -= requests
        released(slots, None if isinstance(outcome, Exception) else outcome[0])
        then(outcome)

    number = link.request(call, payload, last_word)
    link.in_flight += requests
    for slot in slots:
        slot.engine_holds = True
    return number


def piece_answered(
    link: EngineLink,
    answers: Pieces,
    index: int,
    piece: Frame,
    outcome: tuple[wire.Reply, bytes] | Exception,
) -> None:
    """The engine's reply to one piece (or the link's end), its slots released: its
    requests' outputs read from them or the reply's payload."""
    if isinstance(outcome, Exception):
        answers.add(index, outcome)
        return
    reply, data = outcome
    try:
        ran = answered(reply, wire.RanReply)
        outputs = ran_outputs(piece.parts, ran, data)
    except Exception as error:
        answers.add(index, error)
        return
    answers.add(index, Ran(ran.model, ran.version, outputs, link.label))


def cancel_all(link: EngineLink, numbers: Sequence[int]) -> None:
    """Tell the engine it may drop these calls: nobody waits for them any more."""
    for number in numbers:
        link.cancel(number)
