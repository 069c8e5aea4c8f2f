"""A front end's shared-memory arena: request bodies are read from the socket straight into
a slot of it, the engine reads their tensors there and writes its answers back into the same
slot, so tensor bytes never cross the control channel."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

from app.contract import Part, Raw
from app.errors import Unavailable
from app.tensor_data import pack_tensor
from app.wire import TensorRef
from engines.devices import SHM_ROOT

log = logging.getLogger(__name__)
PAGE = 4096


@dataclass
class Slot:
    """A lent piece of the arena a request body is read into: at ``offset`` in the arena,
    ``len(view)`` bytes."""

    offset: int
    view: memoryview
    engine_holds: bool = False
    """Set while an engine may still read it (sent, not answered): not reusable yet."""
    abandoned: bool = False
    """Its request went away while an engine held it: given back at the engine's answer."""
    returned: bool = False


@dataclass(frozen=True)
class InSlot(Part):
    """A request whose body was read into ``slot`` (``body_length`` bytes of it, its binary
    tensors views there): an engine process reads them in place (``place_inputs``) and
    writes the outputs back there. In one process it is a ``Part`` like any other."""

    slot: Slot | None = None
    body_length: int = 0


@dataclass(frozen=True)
class RawInSlot(Raw):
    """A V2 body forwarded as it came (``Raw``) that was read into ``slot``."""

    slot: Slot | None = None


def slot_of(item: Part | Raw) -> Slot | None:
    """Where a request's body lies in the arena, if it was read into it."""
    return item.slot if isinstance(item, InSlot | RawInSlot) else None


@dataclass(eq=False)
class Waiting:
    """A body waiting for pages: its size, its client's address and share, its slot."""

    size: int
    client: str
    share: float
    future: asyncio.Future[Slot]


class ArenaShare(Unavailable):
    """A body that would take its address past its share of an arena (503 at once)."""


class Arena:
    """Shared memory this front end lends to request bodies: ``slots x slot_bytes`` bytes in
    4 KiB pages; a body takes the pages it needs (at most ``slot_bytes``), so many small
    bodies share the arena and a few large ones still fit."""

    def __init__(
        self, slots: int, slot_bytes: int, share: int = 1, name: str | None = None
    ) -> None:
        # /dev/shm is a tmpfs with a size (64 MB in a default Docker container): writing past
        # it kills the process with SIGBUS, so the arena takes at most half of what is free,
        # split over the ``share`` front ends.
        wanted = slots * slot_bytes
        fits = shm_bytes_free() // (2 * max(1, share))
        if fits < wanted:
            log.warning(
                "/dev/shm has room for %d of the %d bytes of this front end's shared-memory "
                "arena; bodies that find no room travel over the control socket (give the "
                "container a larger /dev/shm: docker --shm-size, or a memory-backed emptyDir)",
                fits,
                wanted,
            )
            wanted = int(fits)
        pages = wanted // PAGE
        # Whole pages: a body lent the pages it needs never exceeds what the engine allows.
        self.slot_bytes = min(slot_bytes, pages * PAGE) // PAGE * PAGE
        if name is None:
            name = f"stoker-{os.getpid()}-{secrets.token_hex(4)}"
        else:
            # A fixed name: what a crashed predecessor left is replaced, not leaked.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_ROOT / name)
        # A file of its own in /dev/shm, mapped here (not ``SharedMemory``: its finaliser
        # raises BufferError at exit while a request's view of the arena is still alive).
        self._name = name
        size = max(PAGE, pages * PAGE)
        descriptor = os.open(SHM_ROOT / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(descriptor, size)
            self.memory = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        # Free runs of pages, (first page, count), sorted and never adjacent.
        self._free: list[tuple[int, int]] = [(0, pages)] if pages else []
        self._free_pages = pages
        self.full_since: float | None = None
        """Since when less than a slot's bytes have been free (no room for a largest body,
        and little for others), or None: readiness reads it."""
        # Pages lent per client (address), and the client of each lent slot by its offset.
        self._by_client: dict[str, int] = {}
        self._owners: dict[int, str] = {}
        # Bodies waiting for pages, in arrival order.
        self._waiting: list[Waiting] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def free_bytes(self) -> int:
        return sum(count for _, count in self._free) * PAGE

    def lend(self, size: int) -> Slot | None:
        """Room for ``size`` bytes (first fit), or None when it is larger than a slot or no
        run of free pages is long enough."""
        if size > self.slot_bytes:
            return None
        need = max(1, -(-size // PAGE))
        for i, (first, count) in enumerate(self._free):
            if count >= need:
                if count == need:
                    del self._free[i]
                else:
                    self._free[i] = (first + need, count - need)
                start, length = first * PAGE, need * PAGE
                self._count_free(-need)
                return Slot(start, memoryview(self.memory)[start : start + length])
        return None

    def _count_free(self, pages: int) -> None:
        self._free_pages += pages
        if self._free_pages * PAGE >= self.slot_bytes:
            self.full_since = None
        elif self.full_since is None:
            self.full_since = time.monotonic()

    async def lend_within(
        self, size: int, wait_s: float, client: str = "", share: float = 1.0
    ) -> Slot | None:
        """Room for ``size`` bytes, waiting up to ``wait_s`` for pages to come back when the
        arena is full (back-pressure: a body never takes the slower road because others hold
        the pages); None only for a body larger than a slot. Past the wait: 503. One
        ``client`` (an address) holds at most ``share`` of the arena's pages: its body past
        that waits for its own pages to come back and holds up no one else's, so one address
        cannot fill the arena with declared bodies and lock every other client out."""
        if size > self.slot_bytes:
            return None
        entry = Waiting(size, client, share, asyncio.get_running_loop().create_future())
        if not self._waiting and self._may_take(entry):  # no overtaking those waiting
            slot = self.lend(size)
            if slot is not None:
                return self._held_by(slot, client)
        self._waiting.append(entry)
        self._serve_waiting()
        future = entry.future
        claimed = False
        try:
            slot = await asyncio.wait_for(asyncio.shield(future), wait_s)
            claimed = True
            return slot
        except TimeoutError:
            if not self._may_take(entry):
                held = self._by_client.get(client, 0) * PAGE
                raise ArenaShare(
                    f"this address holds {held} bytes of this front end's "
                    f"{self.size_bytes}-byte shared-memory arena, and a {size}-byte body "
                    f"would take it past its share ({share:g}) for {wait_s:g} s; retry later"
                ) from None
            raise Unavailable(
                f"this front end's shared-memory arena ({self.size_bytes} bytes) had no room "
                f"for a {size}-byte body for {wait_s:g} s; retry later"
            ) from None
        finally:
            if not future.done():
                future.cancel()
            elif not claimed and not future.cancelled():
                self.give_back(future.result())  # lent as the wait ended: not taken
            if entry in self._waiting:
                self._waiting.remove(entry)
                self._serve_waiting()  # those it held up may fit now

    def lend_now(self, size: int, client: str = "", share: float = 1.0) -> Slot | None:
        """Room for ``size`` bytes in this turn, as ``lend_within`` would give it at once, or
        None where it would wait (no room, bodies already waiting, the address at its
        share) or the body is larger than a slot: the caller then awaits ``lend_within``."""
        if self._waiting or not self._within_share(size, client, share):
            return None
        slot = self.lend(size)
        return None if slot is None else self._held_by(slot, client)

    def _may_take(self, entry: Waiting) -> bool:
        """Whether the body's pages keep its address within its share."""
        return self._within_share(entry.size, entry.client, entry.share)

    def _within_share(self, size: int, client: str, share: float) -> bool:
        if not client or share >= 1.0:
            return True
        need = max(1, -(-size // PAGE))
        held = self._by_client.get(client, 0)
        return held + need <= share * (self.size_bytes // PAGE)

    def _serve_waiting(self) -> None:
        """Lend freed pages to the bodies waiting, in order of arrival; the first that does
        not fit yet stops the others behind it (no stream of small bodies starves a large
        one; each waits at most its bound). A body whose address is at its share is passed
        over: it waits for its own address's pages, not the others'."""
        for entry in list(self._waiting):
            if entry.future.done():
                self._waiting.remove(entry)
                continue
            if not self._may_take(entry):
                continue
            slot = self.lend(entry.size)
            if slot is None:
                return
            self._waiting.remove(entry)
            entry.future.set_result(self._held_by(slot, entry.client))

    @property
    def size_bytes(self) -> int:
        return len(self.memory)

    def _held_by(self, slot: Slot, client: str) -> Slot:
        if client:
            self._owners[slot.offset] = client
            self._by_client[client] = self._by_client.get(client, 0) + len(slot.view) // PAGE
        return slot

    def give_back(self, slot: Slot) -> None:
        """Make a slot's pages lendable again (once: a second call is a no-op)."""
        if slot.returned:
            return
        slot.returned = True
        first, count = slot.offset // PAGE, len(slot.view) // PAGE
        owner = self._owners.pop(slot.offset, None)
        if owner is not None:
            left = self._by_client[owner] - count
            if left > 0:
                self._by_client[owner] = left
            else:
                del self._by_client[owner]
        slot.view.release()
        self._count_free(count)
        at = bisect.bisect(self._free, (first, 0))
        if at < len(self._free) and self._free[at][0] == first + count:  # joins the next run
            count += self._free.pop(at)[1]
        if at > 0 and sum(self._free[at - 1]) == first:  # and the previous one
            first, before = self._free[at - 1]
            self._free[at - 1] = (first, before + count)
        else:
            self._free.insert(at, (first, count))
        if self._waiting:
            self._serve_waiting()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_ROOT / self._name)
        # A view still held (a request being torn down) keeps the mapping until it goes.
        with contextlib.suppress(BufferError):
            self.memory.close()


def shm_bytes_free(root: str | os.PathLike[str] = SHM_ROOT) -> int:
    """Bytes free in the shared-memory file system (a large number where it cannot be read)."""
    try:
        stats = os.statvfs(root)
    except OSError:
        return 1 << 40
    return stats.f_bavail * stats.f_frsize


def address(buffer: bytes | memoryview) -> int:
    """Where ``buffer``'s first byte lies in this process's memory: through ctypes for a
    writable buffer (a slot and the views of it: ~1 us on a 2-core EPYC), through numpy
    (3-5 us there) for a read-only or empty one."""
    if isinstance(buffer, memoryview) and not buffer.readonly and buffer.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def place_inputs(
    inputs: dict[str, np.ndarray], slot: Slot | None, body_length: int
) -> tuple[list[TensorRef], bytes]:
    """Where the engine finds each input (``TensorRef``s into the slot), and the payload
    (empty when every input is in the slot). Inputs decoded from binary data are views of
    the slot already and stay where they are; others (JSON) are copied in after the body, or
    over it when no input lies in it; all go in the payload when they do not fit. (Offsets
    into the payload count from its start.)"""
    packed = [
        (name, *pack_tensor(name, array), list(array.shape)) for name, array in inputs.items()
    ]
    if slot is not None:
        capacity = len(slot.view)
        base = address(slot.view)

        def inside(chunk: bytes | memoryview) -> int | None:
            at = address(chunk) - base if len(chunk) else 0
            return at if at >= 0 and at + len(chunk) <= capacity else None

        where = [inside(chunk) for _, _, chunk, _ in packed]
        cursor = -(-body_length // 64) * 64 if any(at is not None for at in where) else 0
        copies = [
            len(chunk) for (_, _, chunk, _), at in zip(packed, where, strict=True) if at is None
        ]
        if cursor + sum(copies) <= capacity:
            described = []
            for (name, datatype, chunk, shape), at in zip(packed, where, strict=True):
                if at is None:
                    slot.view[cursor : cursor + len(chunk)] = chunk
                    at, cursor = cursor, cursor + len(chunk)
                described.append(TensorRef(name, datatype, tuple(shape), at, len(chunk)))
            return described, b""
    described, at = [], 0
    for name, datatype, chunk, shape in packed:
        described.append(TensorRef(name, datatype, tuple(shape), at, len(chunk)))
        at += len(chunk)
    return described, b"".join(chunk for _, _, chunk, _ in packed)
