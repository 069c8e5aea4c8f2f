"""Triton's system shared-memory extension: regions a client on the same host registers, so
tensors cross without HTTP bodies at all.

A client creates a POSIX shared-memory object (``tritonclient.utils.shared_memory``), writes
its inputs there and registers it under a name (``key``, ``offset``, ``byte_size``); a request
then names the region, offset and size of each input instead of sending data, and may ask for
outputs to be written into a region too. Regions are files in ``/dev/shm/<key>`` (Linux); a
key is a single file name there, so a request can never reach another file.

A region is read and written through its open file (``pread``/``pwrite``), never mapped: a
client that shrinks the file after registering it gets a 400 for the bytes that are gone, not
a SIGBUS in the server, and a registration costs a file descriptor, not the file's size in
address space. A file with more than one name (a hard link, perhaps to a front end's arena)
and the server's own arenas (by device and inode) are refused. Refusals do not say whether a
file exists, what it is or how large it is: the client made it and knows.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from app.errors import BadRequest, NotFound, client_text
from engines.devices import SHM_ROOT

# The server's own arenas (front ends' slots; Python's default names): never a client region.
PRIVATE_PREFIXES = ("stoker-", "psm_")
MAX_REGIONS = 256
_KEY = re.compile(r"/?[A-Za-z0-9_.-]{1,200}")


# Offsets and sizes past this are no file's.
MAX_REGION_BYTES = (1 << 63) - 1


def check_window(offset: object, byte_size: object) -> None:
    """A registration's offset and byte size: integers, 0 <= offset, 0 < byte_size, both
    below 2^63."""
    for field, value in (("offset", offset), ("byte_size", byte_size)):
        if type(value) is not int or not 0 <= value <= MAX_REGION_BYTES:
            raise BadRequest(f'shared memory "{field}" must be an integer from 0 to 2^63 - 1')
    if byte_size == 0:
        raise BadRequest('shared memory "byte_size" must be positive')


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    descriptor: int

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SharedRegions:
    """The registered regions of this server, by name."""

    def __init__(self, root: Path = SHM_ROOT) -> None:
        self._root = root
        self._regions: dict[str, Region] = {}
        self.private: set[tuple[int, int]] = set()
        """(device, inode) of the server's own shared memory (front ends' arenas)."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name or len(name) > 200:
            raise BadRequest("a shared memory region needs a name of 1 to 200 characters")
        if name in self._regions:
            raise BadRequest(f"shared memory region {client_text(name)!r} is already registered")
        if len(self._regions) >= MAX_REGIONS:
            raise BadRequest(f"{MAX_REGIONS} shared memory regions are registered already")
        if type(key) is not str or not _KEY.fullmatch(key) or key.strip("/.") == "":
            raise BadRequest("a shared memory key is one name of letters, digits, '_', '.', '-'")
        check_window(offset, byte_size)
        leaf = key.lstrip("/")
        if leaf.startswith(PRIVATE_PREFIXES):
            raise BadRequest(f"shared memory key {key!r} is the server's own")
        # One answer for every refusal below: whether the file exists, what it is and how
        # large are not the client's to learn from the server.
        refused = BadRequest(
            f"shared memory key {key!r} is not a region of at least offset + byte_size bytes "
            "that this server's user created"
        )
        try:
            # Never through a link: a key names a file in /dev/shm itself.
            descriptor = os.open(self._root / leaf, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise refused from None
        try:
            facts = os.fstat(descriptor)
            if (
                not stat.S_ISREG(facts.st_mode)
                or facts.st_uid != os.getuid()
                or facts.st_nlink != 1
                or (facts.st_dev, facts.st_ino) in self.private
                or offset + byte_size > facts.st_size
            ):
                raise refused
        except BaseException:
            os.close(descriptor)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, descriptor)

    def unregister(self, name: str | None = None) -> None:
        """One region, or every region when ``name`` is None; an unknown name is a no-op,
        as with Triton."""
        names = list(self._regions) if name is None else [name]
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                os.close(region.descriptor)

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        if name is None:
            return [r.status() for r in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"no shared memory region {client_text(name)!r} is registered")
        return [region.status()]

    def _window(self, name: str, offset: int, size: int, what: str) -> tuple[Region, int]:
        region = self._regions.get(name)
        if region is None:
            raise BadRequest(f"{what}: no shared memory region {client_text(name)!r} is registered")
        if offset < 0 or size < 0 or offset + size > region.byte_size:
            raise BadRequest(
                f"{what}: offset {offset} + {size} bytes runs past shared memory region "
                f"{client_text(name)!r} ({region.byte_size} bytes)"
            )
        return region, region.offset + offset

    def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
        """``size`` bytes at ``offset`` into region ``name`` (for ``what``: an input), read
        from the file: a region its client shrank answers 400 for the bytes that are gone."""
        region, start = self._window(name, offset, size, what)
        data = bytearray(size)
        done = os.preadv(region.descriptor, [data], start) if size else 0
        if done != size:
            raise BadRequest(
                f"{what}: shared memory region {client_text(name)!r} is smaller than when it "
                "was registered"
            )
        return memoryview(data)

    def write(self, name: str, offset: int, data: bytes | memoryview, what: str) -> None:
        """``data`` into region ``name`` at ``offset`` (for ``what``: an output)."""
        region, start = self._window(name, offset, len(data), what)
        if os.fstat(region.descriptor).st_size < start + len(data):
            # Written anyway it would grow the file again: the client shrank it, say so.
            raise BadRequest(
                f"{what}: shared memory region {client_text(name)!r} is smaller than when it "
                "was registered"
            )
        written = 0
        view = memoryview(data).cast("B")
        while written < len(view):
            written += os.pwrite(region.descriptor, view[written:], start + written)

    def close(self) -> None:
        self.unregister()
