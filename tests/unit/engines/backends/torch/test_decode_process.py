"""A JPEG decoder in a process of its own (on the CPU, Pillow standing in for nvJPEG, the rows
in shared memory where a GPU has them in CUDA IPC memory): the rows it hands back are the
in-process decoder's, they stay the caller's after the next batch, a batch larger than its
buffer goes in parts, a child that dies costs only the batch it held, and closing ends it;
with two slots, the next batch goes to the child while it decodes the last, each caller gets
its own rows, and a child that dies fails the batches it held.
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from engines.preprocess import ImagePreprocess, preprocess
from tests.conftest import sample_jpegs

pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")

SPEC = ImagePreprocess(datatype="UINT8")


def start(rows: int, **options: Any) -> Any:
    from engines.backends.torch.decode_process import DecodeProcess
    from engines.backends.torch.images import pillow_decode_jpeg

    return DecodeProcess(SPEC, "cpu", rows, pillow_decode_jpeg, label="test", **options)


@pytest.fixture(scope="module")
def process() -> Iterator[Any]:
    decoder = start(rows=4)
    yield decoder
    decoder.close()


def in_process(uploads: list[bytes | None]) -> tuple[np.ndarray, list[bool]]:
    from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg

    rows, ok = TorchImageDecoder(SPEC, "cpu", pillow_decode_jpeg).decode(uploads)
    return np.asarray(rows), ok


def test_the_rows_from_the_process_are_the_in_process_decoders(process: Any) -> None:
    uploads: list[bytes | None] = [*sample_jpegs()[:3], b"\xff\xd8bad"]
    rows, ok = process(uploads)
    want, want_ok = in_process(uploads)
    assert ok == want_ok == [True, True, True, False]
    np.testing.assert_array_equal(np.asarray(rows), want)
    for data, row in zip(uploads[:3], np.asarray(rows), strict=False):
        assert isinstance(data, bytes)
        pillow = preprocess(Image.open(io.BytesIO(data)).convert("RGB"), SPEC)
        assert np.abs(row.astype(np.int16) - pillow).max() <= 1


def test_a_batch_larger_than_the_buffer_goes_through_it_in_parts(process: Any) -> None:
    photos = sample_jpegs()
    uploads: list[bytes | None] = [*photos, None, photos[0], b"\xff\xd8bad", photos[1]]
    rows, ok = process(uploads)  # 9 images through a buffer of 4: three parts
    assert len(rows) == len(uploads) and rows.shape[1:] == SPEC.row_shape()
    assert ok == [True] * 5 + [False, True, False, True]
    host = np.asarray(rows)
    for i, data in enumerate(uploads):
        if ok[i]:
            alone, _ = in_process([data])
            assert np.abs(host[i].astype(np.int16) - alone[0]).max() <= 1, i
        else:
            assert not host[i].any()  # left for the caller's CPU decode


def test_the_childs_time_is_summed_by_part_and_images() -> None:
    """Each part a child decodes adds its batch, its images and its seconds to the parent's
    ``times`` (logged at close): 5 images through a buffer of 2 rows are 3 parts."""
    decoder = start(rows=2)
    try:
        decoder(sample_jpegs()[:5])
        decoder([sample_jpegs()[0]])
        times = decoder.times
        assert (times.batches, times.images) == (4, 6)
        assert times.decode > 0 and times.resize > 0
        assert "4 batches of 1.5 images" in times.describe()
    finally:
        decoder.close()


def test_a_batch_within_the_queues_bounds_crosses_in_one_part() -> None:
    """A batch the decode queue forms (at most ``rows`` photos and a slot's bytes: the
    served ``uploads.decode_batch_photos`` and ``decode_batch_bytes``) goes to the child
    whole, one part and one answer, not cut again by the process."""
    photos = sample_jpegs()
    uploads: list[bytes | None] = [photos[i % len(photos)] for i in range(40)]
    decoder = start(rows=64)
    try:
        rows, ok = decoder(uploads)
        assert ok == [True] * 40 and (decoder.times.batches, decoder.times.images) == (1, 40)
        want, _ = in_process(uploads)
        assert np.abs(np.asarray(rows).astype(np.int16) - want).max() <= 1
    finally:
        decoder.close()


def test_parts_fit_the_shared_input_and_a_larger_image_goes_over_the_pipe() -> None:
    """With an input slot smaller than the largest photo (as if it were a 20 MB upload),
    batches split by bytes as well as rows, the photos over the limit cross the pipe
    alone, and every row is still the in-process decoder's."""
    photos = sample_jpegs()
    sizes = sorted(len(photo) for photo in photos)
    slot_bytes = (sizes[0] + sizes[-1]) // 2
    assert any(len(photo) > slot_bytes for photo in photos)
    decoder = start(rows=4, slot_bytes=slot_bytes)
    try:
        uploads: list[bytes | None] = [*photos, *reversed(photos)]
        for _ in range(3):  # the same area reused part after part
            rows, ok = decoder(uploads)
            assert ok == [True] * len(uploads)
            for data, row in zip(uploads, np.asarray(rows), strict=True):
                alone, _ = in_process([data])
                assert np.abs(row.astype(np.int16) - alone[0]).max() <= 1  # padded otherwise
    finally:
        decoder.close()


def test_the_rows_handed_back_are_not_the_next_batchs(process: Any) -> None:
    first, second = sample_jpegs()[:2]
    rows, _ = process([first])
    kept = np.asarray(rows).copy()
    process([second])
    np.testing.assert_array_equal(np.asarray(rows), kept)


def killed(decoder: Any, photo: bytes) -> int:
    """Kill ``decoder``'s child: the batch it is given next fails (the caller decodes it
    elsewhere). The dead child's pid."""
    dead = decoder.pid
    assert dead is not None
    os.kill(dead, 9)
    with pytest.raises(RuntimeError, match="decode process test failed"):
        decoder([photo])
    return int(dead)


def test_a_child_that_dies_costs_its_batch_and_is_started_again() -> None:
    photo = sample_jpegs()[0]
    decoder = start(rows=2)
    try:
        dead = killed(decoder, photo)
        rows, ok = decoder([photo])  # a new child
        assert ok == [True] and decoder.starts == 2 and decoder.pid not in (None, dead)
        alone, _ = in_process([photo])
        np.testing.assert_array_equal(np.asarray(rows), alone)
    finally:
        decoder.close()


def shm_files() -> set[Path]:
    from engines.devices import SHM_ROOT

    return set(SHM_ROOT.glob("stoker-decode-*"))


def test_closing_ends_the_child_and_leaves_no_file() -> None:
    before = shm_files()
    decoder = start(rows=1)
    pid = decoder.pid
    assert pid is not None
    assert shm_files() == before  # unlinked once the child mapped it
    decoder.close()
    with pytest.raises(ProcessLookupError):  # exited and reaped
        os.kill(pid, 0)
    assert decoder.pid is None
    with pytest.raises(RuntimeError, match="closed"):  # and no new child for a late call
        decoder([sample_jpegs()[0]])
    assert decoder.starts == 1


def test_a_start_that_fails_leaves_nothing_and_batches_are_refused_until_the_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full /dev/shm at a restart: a RuntimeError (the caller decodes on the CPU), no file
    and no process left, and the batches that follow are refused at once rather than each
    paying for another start, until ``RETRY_S`` has passed."""
    from engines.backends.torch import decode_process

    photo = sample_jpegs()[0]
    before = shm_files()
    decoder = start(rows=2)
    try:
        killed(decoder, photo)

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)  # the module calls os.posix_fallocate
        monkeypatch.setattr(decode_process, "RETRY_S", 3600.0)
        with pytest.raises(RuntimeError, match=r"did not start.*No space left"):
            decoder([photo])
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="retried later"):
            decoder([photo])
        assert time.monotonic() - started < 5  # no spawn was tried
        assert decoder.starts == 1 and decoder.pid is None
        assert shm_files() == before
    finally:
        decoder.close()


def sleepy_decode(data: Any, device: Any = None) -> Any:
    """A decoder that hangs (a stand-in for a stuck device call)."""
    time.sleep(600)


def test_a_child_that_hangs_is_killed_after_the_batch_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engines.backends.torch import decode_process

    monkeypatch.setattr(decode_process, "BATCH_TIMEOUT_S", 1.0)
    decoder = decode_process.DecodeProcess(SPEC, "cpu", 2, sleepy_decode, label="test")
    try:
        pid = decoder.pid
        assert pid is not None
        with pytest.raises(RuntimeError, match="no answer in 1 s"):
            decoder([sample_jpegs()[0]])
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(pid, 0)
    finally:
        decoder.close()


def slow_decode(data: Any, device: Any = None) -> Any:
    """Pillow, a quarter of a second a batch: long enough for a second batch to arrive."""
    from engines.backends.torch.images import pillow_decode_jpeg

    time.sleep(0.25)
    return pillow_decode_jpeg(data, device)


class Recorded:
    """The parent's end of the pipe, with when each message went and each answer came."""

    def __init__(self, conn: Any, events: list[tuple[str, int]]) -> None:
        self._conn = conn
        self._events = events

    def send(self, message: Any) -> None:
        self._events.append(("sent", threading.get_ident()))
        self._conn.send(message)

    def recv(self) -> Any:
        answer = self._conn.recv()
        self._events.append(("answered", threading.get_ident()))
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_two_batches_in_flight_are_each_answered_with_their_own_rows() -> None:
    """Two threads call one process of two slots over and over, batches in parts (3 images
    through slots of 2 rows): every batch gets the rows the in-process decoder gives it
    (within a level: in parts, other images share a padded resize group)."""
    from engines.backends.torch.decode_process import DecodeProcess
    from engines.backends.torch.images import pillow_decode_jpeg

    photos = sample_jpegs()
    batches: list[list[bytes | None]] = [
        [photos[0], photos[1], photos[2]],
        [photos[3], None, photos[1]],
    ]
    wanted = [in_process(batch) for batch in batches]
    decoder = DecodeProcess(SPEC, "cpu", 2, pillow_decode_jpeg, label="test", slots=2)
    failures: list[str] = []

    def caller(which: int) -> None:
        for _ in range(6):
            rows, ok = decoder(batches[which])
            want_rows, want_ok = wanted[which]
            got = np.asarray(rows).astype(np.int16)
            if ok != want_ok or got.shape != want_rows.shape or np.abs(got - want_rows).max() > 1:
                failures.append(f"batch {which}: other rows")

    try:
        threads = [threading.Thread(target=caller, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        assert failures == [] and decoder.starts == 1
    finally:
        decoder.close()


def test_the_next_batch_goes_to_the_child_before_the_last_is_answered() -> None:
    from engines.backends.torch.decode_process import DecodeProcess

    photo = sample_jpegs()[0]
    decoder = DecodeProcess(SPEC, "cpu", 2, slow_decode, label="test", slots=2)
    events: list[tuple[str, int]] = []
    decoder._conn = Recorded(decoder._conn, events)  # type: ignore[assignment]
    try:
        first = threading.Thread(target=decoder, args=([photo],))
        first.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:  # the first batch is in the child
            time.sleep(0.01)
        second = threading.Thread(target=decoder, args=([photo],))
        second.start()
        first.join(timeout=60)
        second.join(timeout=60)
        kinds = [kind for kind, _ in events]
        assert kinds == ["sent", "sent", "answered", "answered"], kinds
        assert events[0][1] == events[2][1] == first.ident  # each took its own answer
        assert events[1][1] == events[3][1] == second.ident
    finally:
        decoder.close()


def test_a_child_that_dies_with_two_batches_fails_both_and_the_next_gets_a_new_one() -> None:
    from engines.backends.torch.decode_process import DecodeProcess

    photo = sample_jpegs()[0]
    decoder = DecodeProcess(SPEC, "cpu", 2, slow_decode, label="test", slots=2)
    events: list[tuple[str, int]] = []
    decoder._conn = Recorded(decoder._conn, events)  # type: ignore[assignment]
    errors: list[str] = []

    def call() -> None:
        try:
            decoder([photo])
        except RuntimeError as error:
            errors.append(str(error))

    try:
        dead = decoder.pid
        assert dead is not None
        threads = [threading.Thread(target=call) for _ in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(events) < 2 and time.monotonic() < deadline:  # both sent, none answered
            time.sleep(0.01)
        assert [kind for kind, _ in events] == ["sent", "sent"]
        os.kill(dead, 9)
        for thread in threads:
            thread.join(timeout=60)
        assert len(errors) == 2 and all("decode process test failed" in e for e in errors)
        rows, ok = decoder([photo])  # a new child
        assert ok == [True] and decoder.starts == 2 and decoder.pid not in (None, dead)
        np.testing.assert_array_equal(np.asarray(rows), in_process([photo])[0])
    finally:
        decoder.close()


def test_closing_lets_the_batch_in_flight_finish() -> None:
    from engines.backends.torch.decode_process import DecodeProcess

    photo = sample_jpegs()[0]
    decoder = DecodeProcess(SPEC, "cpu", 2, slow_decode, label="test", slots=2)
    events: list[tuple[str, int]] = []
    decoder._conn = Recorded(decoder._conn, events)  # type: ignore[assignment]
    answers: list[list[bool]] = []
    caller = threading.Thread(target=lambda: answers.append(decoder([photo])[1]))
    caller.start()
    deadline = time.monotonic() + 60
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    decoder.close()  # while the child decodes it
    caller.join(timeout=60)
    assert answers == [[True]] and decoder.pid is None


PAIRED = threading.Barrier(2)
SMALLER_DONE = threading.Event()


def paired_decode(data: Any, device: Any = None) -> Any:
    """Pillow once two batches decode at once in the child (each waits for the other there);
    the larger batch, sent first, then waits until the smaller one is decoded: it finishes
    last."""
    from engines.backends.torch.images import pillow_decode_jpeg

    PAIRED.wait(timeout=60)
    if isinstance(data, list) and len(data) > 1:
        if not SMALLER_DONE.wait(timeout=60):
            raise RuntimeError("the smaller batch was never decoded")
        return pillow_decode_jpeg(data, device)
    decoded = pillow_decode_jpeg(data, device)
    SMALLER_DONE.set()
    return decoded


def test_the_slots_batches_decode_at_once_and_are_answered_in_the_order_sent() -> None:
    """Two slots' batches decode side by side in the child (a decoder that waits for a second
    batch to be decoding would time out in a child that decoded one at a time), and the one
    that finishes first is still answered second, so each caller gets its own rows."""
    from engines.backends.torch.decode_process import DecodeProcess

    photos = sample_jpegs()
    batches: list[list[bytes | None]] = [[photos[0], photos[1]], [photos[2]]]
    decoder = DecodeProcess(SPEC, "cpu", 2, paired_decode, label="test", slots=2)
    events: list[tuple[str, int]] = []
    decoder._conn = Recorded(decoder._conn, events)  # type: ignore[assignment]
    results: dict[int, tuple[Any, list[bool]]] = {}
    try:
        first = threading.Thread(target=lambda: results.setdefault(0, decoder(batches[0])))
        first.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:  # the first batch is in the child
            time.sleep(0.01)
        second = threading.Thread(target=lambda: results.setdefault(1, decoder(batches[1])))
        second.start()
        first.join(timeout=120)
        second.join(timeout=120)
        assert sorted(results) == [0, 1]
        for i, batch in enumerate(batches):
            rows, ok = results[i]
            assert ok == [True] * len(batch)
            np.testing.assert_array_equal(np.asarray(rows), in_process(batch)[0])
        assert decoder.starts == 1
    finally:
        decoder.close()
