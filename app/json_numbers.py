"""A V2 JSON document whose large numeric ``data`` arrays are read by simdjson into numpy.

An image as V2 JSON is 150,528 numbers. orjson makes a Python float of each and numpy reads
them back (13 of the 21 ms ``decode_infer`` took for a 1.6 MB FP32 image on the 2-core EPYC);
simdjson parses the same text into one buffer of doubles or integers, with no Python object a
number. ``loads`` parses a document with orjson as before, but first lifts each input's
``"data"`` array of at least ``LIFTED_BYTES`` out of the text, leaving a placeholder string
in its place; after the parse the placeholders become ``Numbers``, which
``app.tensor_data.from_json`` reads with the element-wise path's checks and messages.

The lifting changes no answer. A lifted span is one whole JSON value, checked by simdjson,
at a value's place (after ``"data":``), so the text with a string in its place is valid JSON
exactly when the original is (a span inside a string would break that string). Where it
cannot vouch for the document (a span that is not one valid value, holds a number simdjson
cannot hold or nests deeper than orjson takes it in place; a placeholder that does not end up
as an input's ``data``, as with a duplicate key or a ``"data"`` key elsewhere), orjson parses
the original whole, as before. ``Numbers.values`` is None where the
element-wise path must decide (a boolean, null or non-number, a float for an integer type, a
number out of the buffer's range, a datatype simdjson has no buffer for); the property tests
hold the two paths to the same arrays and refusals.
"""

from __future__ import annotations

import re
import secrets
from contextlib import suppress
from typing import Any, Literal

import numpy as np
import orjson
import simdjson
from numpy.typing import NDArray

Array = NDArray[Any]

LIFTED_BYTES = 64 * 1024
"""Smaller ``data`` arrays stay in the document: orjson reads them in microseconds."""
_MOST_LIFTS = 64
# orjson refuses a document nested past 1024 levels; an input's "data" sits three levels down.
_DEEPEST = 1024 - 3
_KEY = re.compile(rb'"data"[ \t\r\n]*:[ \t\r\n]*\[')
# A placeholder no client can send: the nonce is drawn once a process.
_MARK = "\x00stoker-lifted-" + secrets.token_hex(16) + "-"
# The buffer simdjson fills for each datatype it converts exactly as numpy converts the
# Python values orjson makes (BF16 is left out, as in ``tensor_data``: ml_dtypes rounds a
# float64 through float32).
_KINDS: dict[str, tuple[Literal["d", "i", "u"], type[np.generic]]] = {
    **dict.fromkeys(("FP16", "FP32", "FP64"), ("d", np.float64)),
    **dict.fromkeys(("INT8", "INT16", "INT32", "INT64"), ("i", np.int64)),
    **dict.fromkeys(("UINT8", "UINT16", "UINT32", "UINT64"), ("u", np.uint64)),
}
# The datatypes whose JSON numbers numpy (or simdjson) converts in one call exactly as the
# element-wise path converts each: ``app.tensor_data`` takes its one-call paths for these.
CONVERTED = frozenset(_KINDS)


class Numbers:
    """One input's lifted ``data``: its JSON text and, where simdjson read every element as
    the datatype's kind of number, those numbers flattened row-major."""

    __slots__ = ("depth", "text", "values")

    def __init__(self, text: memoryview, depth: int, values: Array | None) -> None:
        self.text = text
        self.depth = depth
        """How deep its lists nest (``nesting``)."""
        self.values = values

    def json(self) -> Any:
        """The data as orjson reads it in place: what the element-wise path takes."""
        return orjson.loads(self.text)


def loads(text: bytes | bytearray | memoryview) -> tuple[Any, bytes | bytearray | memoryview]:
    """``orjson.loads(text)``, with each input's ``data`` array of ``LIFTED_BYTES`` or more as
    ``Numbers``; and the text orjson parsed (without the lifted arrays). orjson's errors are
    the original text's own."""
    if len(text) < LIFTED_BYTES:
        return orjson.loads(text), text
    whole = bytes(text)
    spans = _spans(whole)
    if not spans:
        return orjson.loads(whole), whole
    pieces: list[bytes] = []
    at = 0
    for index, (start, end) in enumerate(spans):
        pieces += (whole[at:start], orjson.dumps(f"{_MARK}{index}"))
        at = end
    pieces.append(whole[at:])
    rest = b"".join(pieces)
    try:
        document = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return orjson.loads(whole), whole
    view = memoryview(whole)
    if not _restore(document, [view[start:end] for start, end in spans]):
        return orjson.loads(whole), whole
    return document, rest


def nesting(text: memoryview) -> int:
    """How deep the lists of a JSON array of numbers nest (1 for a flat list): the deepest
    point of its running count of brackets opened and closed. Two byte comparisons at numpy's
    speed, then work in the number of brackets only."""
    codes = np.frombuffer(text, np.uint8)
    opens = np.flatnonzero(codes == ord("["))
    if len(opens) <= 1:
        return len(opens)
    closes = np.flatnonzero(codes == ord("]"))
    order = np.argsort(np.concatenate((opens, closes)), kind="stable")
    return int(np.cumsum(np.where(order < len(opens), 1, -1)).max())


def _spans(whole: bytes) -> list[tuple[int, int]]:
    """Where the arrays after ``"data":`` keys lie, each of ``LIFTED_BYTES`` or more: from its
    ``[`` to the last ``]`` before the next quote or closing brace (which no array of numbers
    holds). Each byte is searched about once, at C speed, however many keys there are."""
    spans: list[tuple[int, int]] = []
    size = len(whole)
    quote = brace = -1
    at = 0
    while len(spans) < _MOST_LIFTS:
        found = _KEY.search(whole, at)
        if found is None:
            break
        start = at = found.end() - 1
        if quote < start:
            quote = whole.find(b'"', start)
            quote = size if quote < 0 else quote
        if brace < start:
            brace = whole.find(b"}", start)
            brace = size if brace < 0 else brace
        # Its last "]" before them: what follows it (spaces, a comma, anything stray) stays
        # in the text, where orjson judges it.
        end = whole.rfind(b"]", start, min(quote, brace)) + 1
        if end - start >= LIFTED_BYTES:
            spans.append((start, end))
            at = end
    return spans


def _restore(document: Any, texts: list[memoryview]) -> bool:
    """Put each lifted text back, read, where its placeholder is an input's ``data``; False
    unless every placeholder is found there once and each text is one valid JSON value."""
    inputs = document.get("inputs") if type(document) is dict else None
    if type(inputs) is not list:
        return False
    found = 0
    for entry in inputs:
        data = entry.get("data") if type(entry) is dict else None
        if type(data) is not str or not data.startswith(_MARK):
            continue
        index = int(data[len(_MARK) :])
        try:
            parsed = simdjson.Parser().parse(texts[index])
        except (ValueError, RuntimeError):
            # Not one valid value, or one simdjson cannot hold (an integer past 64 bits, which
            # orjson reads as a float; nesting past 1024 levels): orjson decides.
            return False
        if not isinstance(parsed, simdjson.Array):
            return False  # a span begins with "[": this is for the type checker
        depth = nesting(texts[index])
        if depth > _DEEPEST:
            return False  # orjson refuses the whole document, with its own message
        datatype = entry.get("datatype")
        kind = _KINDS.get(datatype) if type(datatype) is str else None
        values: Array | None = None
        if kind is not None:
            # A non-number, or a number out of the kind's range: the element-wise path's.
            with suppress(TypeError, ValueError, RuntimeError):
                values = np.frombuffer(parsed.as_buffer(of_type=kind[0]), kind[1])
        entry["data"] = Numbers(texts[index], depth, values)
        found += 1
    return found == len(texts)
