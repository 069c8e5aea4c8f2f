"""JPEG decoding in processes of their own, beside the engine's; the rows handed over on the device.

A ``TorchImageDecoder`` holds its process's GIL from one launch to the next: about 190 us of
CPU an image, 5.5k images/s alone on an H200 and 2.2k inside the engine process, whose event
loop and runner threads want the same GIL (BENCHMARKS.md, runs 26 and 27). A
``DecodeProcess`` runs one decoder in a spawned child instead. Per batch only the JPEG bytes
cross (into a slot of a shared input area, a short message on a pipe); the child decodes,
resizes and crops as the in-process decoder does and writes the rows into a buffer the
parent allocated and shared with it at start (CUDA IPC on a GPU, shared memory on the CPU,
which is how it is tested); it answers which images it decoded, and the parent copies the
rows out of the buffer on the device (one copy, ~10 us for 64 rows on an H200), which frees
the buffer for the next batch. Nothing decoded goes through the host.

Each process takes ``slots`` batches at once (``uploads.decode_in_flight``), and decodes them
at once: a decoder, a stream and a thread a slot in the child. torchvision's nvJPEG calls
take one lock in a process, so what overlaps is one batch's decode with another's resize,
copies and Python; four decoder threads of one process still made 2.0x the photos of one on
an H200, where two processes made 1.3x (BENCHMARKS.md, run 45), and threads add no CUDA
context. In the service at 256 clients it changed nothing measurable (run 47).
A slot is a part of the input area and of the rows buffer; the child answers in the order it
was sent (a batch that finishes early waits for the ones sent before it), and each caller
takes its answer in that order.

A child that dies or hangs costs the batches it held (the callers decode them on the CPU) and is
started again for the next one; one that cannot start is tried again ``RETRY_S`` later, the
batches meanwhile refused at once (decoded on the CPU), not each paying for a start.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch
import torch.multiprocessing as torch_mp

from engines.backends.torch.images import DecodeTimes, DeviceRows, JpegDecode, TorchImageDecoder
from engines.devices import SHM_ROOT
from engines.heap import freeze_heap
from engines.preprocess import ImagePreprocess
from engines.sampler import sampled

log = logging.getLogger(__name__)
# A child's import of torch and torchvision and its CUDA context: seconds, more on a busy host.
START_TIMEOUT_S = 120.0
# One batch in the child; far above what a batch takes (milliseconds), so only a hung child.
BATCH_TIMEOUT_S = 10.0
# The shared input area of a slot, by default: the JPEG bytes of one batch (256 photos of
# 128 KB, ``uploads.decode_batch_bytes``), taken from /dev/shm at start.
SLOT_BYTES = 32 << 20
# After a start that failed, batches go to the CPU for this long before the next try.
RETRY_S = 30.0
# A child's answer to a batch: ("ok", whether each image decoded, the batch's times) or
# ("error", why, None).
Answer = tuple[str, Any, DecodeTimes | None]


class DecodeProcess:
    """A batch decoder (``app.engine.images.BatchDecode``) whose work runs in a child process.

    Called by up to ``slots`` threads at once (``DecodeQueue`` threads), each batch in a
    slot of its own: ``rows`` images in the shared rows buffer and ``slot_bytes`` of JPEG
    bytes in the shared input area. The decode queue forms batches within those bounds, so a
    batch crosses in one part; only a request larger than them (or a batch of a queue with
    other bounds) goes through its slot in parts, and a photo larger than the input slot over
    the pipe. ``decode_jpeg`` as for ``TorchImageDecoder`` (None: torchvision's), a
    module-level function the child imports.
    """

    def __init__(
        self,
        spec: ImagePreprocess,
        device: str,
        rows: int,
        decode_jpeg: JpegDecode | None = None,
        label: str = "jpeg",
        slots: int = 1,
        slot_bytes: int = SLOT_BYTES,
        kernel: bool | None = None,
    ) -> None:
        self.spec = spec
        self._kernel = kernel  # the child's TorchImageDecoder's (None: its default)
        self.device = torch.device(device)
        self.label = label
        self.slots = max(1, slots)
        self._decode_jpeg = decode_jpeg
        self._rows = max(1, rows)
        self._input_bytes = self.slots * max(1, slot_bytes)
        self._buffer = torch.zeros(
            (self.slots * self._rows, *spec.row_shape()), dtype=torch.uint8, device=self.device
        )
        if self.device.type == "cpu":
            self._buffer.share_memory_()  # type: ignore[no-untyped-call]
        self._streams = [
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self.device.type == "cuda"
            else None
            for _ in range(self.slots)
        ]
        self._lock = threading.Lock()  # the child's start and stop, and each part's sending
        self._free = list(range(self.slots))
        self._slot_free = threading.Condition()
        self._process: Any = None
        self._conn: Connection | None = None
        self._input: mmap.mmap | None = None
        self._turns: _Turns | None = None
        self._closed = False
        self._retry_at = 0.0
        self.starts = 0
        self.times = DecodeTimes()  # the children's batches, summed; logged at close
        self._start()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def __call__(self, jpegs: Sequence[bytes | None]) -> tuple[DeviceRows, list[bool]]:
        """The batch's rows on the device (the parent's copy) and, per image, whether it was
        decoded (False for None and for an image the device refused: the caller fills it).
        Raises RuntimeError when the child fails (the caller decodes the batch elsewhere)."""
        slot = self._take_slot()
        try:
            ok: list[bool] = []
            stream = self._streams[slot]
            held = self._buffer[slot * self._rows : (slot + 1) * self._rows]
            with torch.no_grad(), self._on_stream(stream):
                rows = torch.empty(
                    (len(jpegs), *self.spec.row_shape()), dtype=torch.uint8, device=self.device
                )
                for part in self._parts(jpegs):
                    # Each part's rows out of the slot before the child writes the next.
                    at = len(ok)
                    ok += self._decode_part(slot, part)
                    rows[at : len(ok)].copy_(held[: len(part)])
                    if stream is not None:
                        stream.synchronize()
            return DeviceRows(rows), ok
        finally:
            with self._slot_free:
                self._free.append(slot)
                self._slot_free.notify_all()

    def _take_slot(self) -> int:
        with self._slot_free:
            while not self._free:
                self._slot_free.wait()
            return self._free.pop()

    def _slot_bytes(self) -> int:
        return self._input_bytes // self.slots

    def _parts(self, jpegs: Sequence[bytes | None]) -> Iterator[Sequence[bytes | None]]:
        """The batch in parts of at most ``rows`` images whose bytes fit a slot of the input
        area (an image larger than it alone)."""
        start, size, limit = 0, 0, self._slot_bytes()
        for at, data in enumerate(jpegs):
            length = 0 if data is None else len(data)
            if at > start and (at - start == self._rows or size + length > limit):
                yield jpegs[start:at]
                start, size = at, 0
            size += length
        if start < len(jpegs):
            yield jpegs[start:]

    def _decode_part(self, slot: int, jpegs: Sequence[bytes | None]) -> list[bool]:
        """One part through the child, its rows left in the slot; whether each decoded."""
        lengths = [None if data is None else len(data) for data in jpegs]
        with self._lock:  # one part's bytes and message together, and its turn
            if self._closed:
                raise RuntimeError(f"decode process {self.label} is closed")
            if self._conn is None:
                if time.monotonic() < self._retry_at:
                    raise RuntimeError(f"decode process {self.label} is down; retried later")
                self._start()
            conn, area, turns = self._conn, self._input, self._turns
            assert conn is not None and area is not None and turns is not None
            slot_bytes = len(area) // self.slots
            shared = sum(length or 0 for length in lengths) <= min(self._slot_bytes(), slot_bytes)
            try:
                if shared:  # the bytes first: the child reads them as soon as it has the message
                    at = slot * slot_bytes
                    for data in jpegs:
                        if data is not None:
                            area[at : at + len(data)] = data
                            at += len(data)
                conn.send((slot, shared, lengths))
                if not shared:
                    conn.send_bytes(b"".join(data for data in jpegs if data is not None))
            except (OSError, EOFError) as exc:
                self._failed(turns, exc)
            turn = turns.take()
        try:
            turns.wait_for(turn)  # the child answers in the order it was sent
            try:
                if not conn.poll(BATCH_TIMEOUT_S):
                    raise TimeoutError(f"no answer in {BATCH_TIMEOUT_S:g} s")
                kind, value, times = conn.recv()
            except (OSError, EOFError, TimeoutError) as exc:
                process = self._process
                if self._turns is turns and process is not None:
                    # Killed before the lock is taken: a sender that holds it, blocked on
                    # the pipe of a hung child, gets its error (EPIPE) and lets it go.
                    process.kill()
                with self._lock:
                    self._failed(turns, exc)
            if times is not None:
                self.times.add(times)  # in turn: one answer at a time
        finally:
            turns.done()
        if kind != "ok":
            raise RuntimeError(f"decode process {self.label}: {value}")
        return list(value)

    def _failed(self, turns: _Turns, exc: BaseException) -> NoReturn:
        """The child of ``turns`` failed: stopped (unless a new child already runs), and this
        part's error raised. Called with ``_lock`` held."""
        if self._turns is turns:
            self._stop(kill=True)
        raise RuntimeError(f"decode process {self.label} failed: {exc}") from exc

    def _start(self) -> None:
        """Start a child and wait until it is ready; on any failure nothing is left behind
        (no process, pipe or /dev/shm file), the error is a RuntimeError and the next start
        waits ``RETRY_S``."""
        context = torch_mp.get_context("spawn")
        started = time.perf_counter()
        path = None
        parent = child = process = area = None
        try:
            parent, child = context.Pipe()
            # A file mapped by both, unlinked once the child has it: nothing is left behind.
            fd, path = tempfile.mkstemp(
                prefix="stoker-decode-", dir=SHM_ROOT if SHM_ROOT.is_dir() else None
            )
            try:
                # Taken now: a full /dev/shm is this error, not a SIGBUS at the first write.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, self._input_bytes)
                else:
                    os.ftruncate(fd, self._input_bytes)
                area = mmap.mmap(fd, self._input_bytes)
            finally:
                os.close(fd)
            process = context.Process(
                target=serve,
                args=(
                    child,
                    self.spec,
                    str(self.device),
                    self._buffer,
                    self._decode_jpeg,
                    path,
                    self.slots,
                    self._kernel,
                ),
                name=f"stoker-decode-{self.label}",
                daemon=True,
            )
            process.start()
            child.close()
            if not parent.poll(START_TIMEOUT_S):
                raise TimeoutError(f"not ready in {START_TIMEOUT_S:g} s")
            kind, value = parent.recv()
            if kind != "ready":
                raise RuntimeError(str(value))
        except BaseException as exc:
            if process is not None and process.pid is not None:
                process.kill()
                process.join()
            for end in (parent, child):
                if end is not None:
                    end.close()
            if area is not None:
                area.close()
            self._retry_at = time.monotonic() + RETRY_S
            if not isinstance(exc, Exception):
                raise
            raise RuntimeError(f"decode process {self.label} did not start: {exc}") from exc
        finally:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._process, self._conn, self._input = process, parent, area
        self._turns = _Turns()
        self.starts += 1
        log.info(
            "decode process %s (pid %d) ready on %s in %.1f s",
            self.label,
            process.pid,
            self.device,
            time.perf_counter() - started,
        )

    def _stop(self, kill: bool = False) -> None:
        process, conn, area = self._process, self._conn, self._input
        self._process = self._conn = self._input = self._turns = None
        if area is not None:
            area.close()
        if conn is not None:
            if not kill:
                with contextlib.suppress(OSError):
                    conn.send(None)
            conn.close()
        if process is not None:
            if kill:
                process.kill()
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    def close(self) -> None:
        """Refuse new batches, let those in flight finish, then stop the child."""
        with self._lock:
            self._closed = True
        with self._slot_free:
            while len(self._free) < self.slots:
                self._slot_free.wait()
        with self._lock:
            self._stop()
        log.info("decode process %s: %s", self.label, self.times.describe())

    @staticmethod
    def _on_stream(stream: Any) -> contextlib.AbstractContextManager[object]:
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)


class _Turns:
    """The order of one child's answers: each part sent takes the next turn, and takes its
    answer from the pipe once every earlier turn has taken its own (or failed)."""

    def __init__(self) -> None:
        self._next = 0
        self._answered = 0
        self._changed = threading.Condition()

    def take(self) -> int:
        turn, self._next = self._next, self._next + 1
        return turn

    def wait_for(self, turn: int) -> None:
        with self._changed:
            while self._answered != turn:
                self._changed.wait()

    def done(self) -> None:
        with self._changed:
            self._answered += 1
            self._changed.notify_all()


def serve(
    conn: Connection,
    spec: ImagePreprocess,
    device: str,
    buffer: torch.Tensor,
    decode_jpeg: JpegDecode | None,
    input_path: str,
    slots: int = 1,
    kernel: bool | None = None,
) -> None:
    """The child: decode each batch the parent sends (its bytes in its slot of the input area
    at ``input_path``, or over the pipe) into its slot of ``buffer``, until it sends None or
    goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's drain stops us, not a Ctrl-C
    sampler = sampled("decode")
    try:
        _serve(conn, spec, device, buffer, decode_jpeg, input_path, slots, kernel)
    finally:
        if sampler is not None:
            sampler.stop()


def _serve(
    conn: Connection,
    spec: ImagePreprocess,
    device: str,
    buffer: torch.Tensor,
    decode_jpeg: JpegDecode | None,
    input_path: str,
    slots: int,
    kernel: bool | None,
) -> None:
    try:
        with open(input_path, "r+b") as file:
            area = mmap.mmap(file.fileno(), 0)
        # A decoder (and its stream) a slot: the slots' batches decode at once, each in a
        # thread of its own, the parent's answers sent in the order it sent the batches.
        decoders = [TorchImageDecoder(spec, device, decode_jpeg, kernel) for _ in range(slots)]
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    freeze_heap()  # torch's objects: a full collection would scan them mid-batch
    conn.send(("ready", None))
    slot_bytes, slot_rows = len(area) // slots, len(buffer) // slots
    shared_bytes = memoryview(area)

    def decode(slot: int, blob: bytes | memoryview, lengths: list[int | None]) -> Answer:
        try:
            jpegs: list[bytes | memoryview | None] = []
            at = 0
            for length in lengths:
                jpegs.append(None if length is None else blob[at : at + length])
                at += 0 if length is None else length
            decoder = decoders[slot]
            # The rows are written straight into the slot's part of the shared buffer.
            _, ok = decoder.decode(jpegs, into=buffer[slot * slot_rows :][: len(jpegs)])
            return ("ok", ok, decoder.last)
        except Exception as exc:  # one batch fails; the child serves the next
            return ("error", f"{type(exc).__name__}: {exc}"[:500], None)

    answers: queue.SimpleQueue[Future[Answer] | None] = queue.SimpleQueue()

    def answer() -> None:
        while (future := answers.get()) is not None:
            try:
                conn.send(future.result())
            except (OSError, EOFError):
                return

    # This thread reads the pipe, the sender writes it: each direction has one user.
    sender = threading.Thread(target=answer, name="decode-answers", daemon=True)
    sender.start()
    with ThreadPoolExecutor(slots, thread_name_prefix="decode-slot") as pool:
        while True:
            try:
                message = conn.recv()
                if message is None:
                    break
                slot, shared, lengths = message
                blob: bytes | memoryview = (
                    shared_bytes[slot * slot_bytes : (slot + 1) * slot_bytes]
                    if shared
                    else conn.recv_bytes()
                )
            except (EOFError, OSError):
                break
            answers.put(pool.submit(decode, slot, blob, lengths))
    answers.put(None)
    sender.join()
