"""What a front end's requests become on the control channel to an engine process, and
what their answers come back as: a frame's tensors described by reference into their slots
or the payload (``place_inputs``), its outputs read back as arrays; uploads one after the
other in a slot or the payload, their answers per request. No I/O: ``RemoteEngine`` sends
the calls and waits for the replies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from app import wire
from app.contract import Frame, Part, Uploads
from app.errors import StokerError
from app.frontend.arena import InSlot, Slot, place_inputs, slot_of
from app.frontend.links import RemoteError
from app.protocol import RequestedOutput
from app.tensor_data import unpack_tensor

Shaped = list[tuple[RequestedOutput, np.ndarray]]


def split_frame(frame: Frame, most: int) -> list[Frame]:
    """``frame`` as frames of at most ``most`` rows each (0: no bound), its requests in
    order and each whole; ``[frame]`` itself when it fits."""
    pieces: list[list[Part]] = [[]]
    rows = 0
    for part in frame.parts:
        if most and pieces[-1] and rows + part.rows > most:
            pieces.append([])
            rows = 0
        pieces[-1].append(part)
        rows += part.rows
    if len(pieces) == 1:
        return [frame]
    return [dataclasses.replace(frame, parts=p) for p in pieces]


def run_call(frame: Frame) -> tuple[wire.Run, bytes]:
    """The ``Run`` of a frame and its payload: each request's tensors stay where its body
    put them in its slot, or travel in the payload (offsets from the payload's start)."""
    items, payloads, base = [], [], 0
    for part in frame.parts:
        held = part.slot if isinstance(part, InSlot) else None
        length = part.body_length if isinstance(part, InSlot) else 0
        described, payload = place_inputs(part.inputs, held, length)
        slot = None
        if held is not None and not payload:
            slot = wire.SlotRef(held.offset, len(held.view))
        if payload:
            described = [
                wire.TensorRef(t.name, t.datatype, t.shape, t.offset + base, t.size)
                for t in described
            ]
            payloads.append(payload)
            base += len(payload)
        wanted = tuple(wire.Wanted(o.name, o.classification) for o in part.wanted)
        items.append(wire.RunItem(tuple(described), part.rows, wanted, slot, part.traceparent))
    arrivals = [part.arrived for part in frame.parts if part.arrived is not None]
    spent = int((time.monotonic() - min(arrivals)) * 1e6) if arrivals else 0
    call = wire.Run(
        frame.model,
        frame.version,
        frame.timeout_us,
        frame.priority,
        frame.client,
        tuple(items),
        spent,
        frame.serial,
        time.time_ns(),
    )
    return call, b"".join(payloads)


def ran_outputs(parts: Sequence[Part], ran: wire.RanReply, data: bytes) -> list[Shaped]:
    """Each request's outputs, read from its slot or the reply's payload (``data``) as the
    engine's answer says; none for a request whose caller left and whose slot is lent anew
    (nobody reads it)."""
    outputs: list[Shaped] = []
    for part, item in zip(parts, ran.items, strict=True):
        held = slot_of(part)
        if held is not None and held.returned:
            outputs.append([])
            continue
        source = held.view if held is not None and item.in_slot else memoryview(data)
        outputs.append(
            [
                (
                    out,
                    unpack_tensor(
                        out.name,
                        t.datatype,
                        list(t.shape),
                        source[t.offset : t.offset + t.size],
                    ),
                )
                for out, t in zip(part.wanted, item.outputs, strict=True)
            ]
        )
    return outputs


def classify_call(uploads: Uploads, slot: Slot | None) -> tuple[wire.Classify, bytes]:
    """The ``Classify`` of uploads and its payload: the images one after the other in
    ``slot`` (written there now), or in the payload without one."""
    sizes = tuple(len(image) for image in uploads.images)
    payload, place = b"", None
    if slot is not None:
        at = 0
        for image in uploads.images:
            slot.view[at : at + len(image)] = image
            at += len(image)
        place = wire.SlotRef(slot.offset, len(slot.view))
    else:
        payload = b"".join(uploads.images)
    made = uploads.row_preprocess
    row_preprocess = None if made is None else made.model_dump(mode="json")
    call = wire.Classify(
        uploads.name,
        uploads.version,
        uploads.k,
        sizes,
        uploads.client,
        place,
        uploads.counts,
        row_preprocess,
        uploads.traceparents,
        time.time_ns(),
    )
    return call, payload


def classified_answers(data: bytes) -> list[list[Any] | StokerError]:
    """Per request, its answers or its failure (counted by the engine), from the JSON of a
    ``Classified`` reply's payload."""
    answers: list[list[Any] | StokerError] = []
    for entry in orjson.loads(data):
        if "error" in entry:
            answers.append(RemoteError(entry["error"], entry["status"], entry["reason"]))
        else:
            answers.append(entry["answers"])
    return answers
