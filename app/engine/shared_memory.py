"""Triton's system shared-memory extension: regions a client on the same host registers, so
tensors cross without HTTP bodies at all.

A client creates a POSIX shared-memory object (``tritonclient.utils.shared_memory``), writes
its inputs there and registers it under a name (``key``, ``offset``, ``byte_size``); a request
then names the region, offset and size of each input instead of sending data, and may ask for
outputs to be written into a region too. Regions are mapped from ``/dev/shm/<key>`` (Linux)
by the process that runs the models; a key is a single file name there, so a request can
never reach another file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from app.errors import BadRequest, NotFound

SHM_ROOT = Path("/dev/shm")
# The server's own arenas (front ends' slots; Python's default names): never a client region.
PRIVATE_PREFIXES = ("stoker-", "psm_")
MAX_REGIONS = 256
_KEY = re.compile(r"/?[A-Za-z0-9_.-]{1,200}")


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap

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

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name or len(name) > 200:
            raise BadRequest("a shared memory region needs a name of 1 to 200 characters")
        if name in self._regions:
            raise BadRequest(f"shared memory region {name!r} is already registered")
        if len(self._regions) >= MAX_REGIONS:
            raise BadRequest(f"{MAX_REGIONS} shared memory regions are registered already")
        if type(key) is not str or not _KEY.fullmatch(key) or key.strip("/.") == "":
            raise BadRequest("a shared memory key is one name of letters, digits, '_', '.', '-'")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise BadRequest(f'shared memory "{field}" must be a non-negative integer')
        if byte_size == 0:
            raise BadRequest('shared memory "byte_size" must be positive')
        leaf = key.lstrip("/")
        if leaf.startswith(PRIVATE_PREFIXES):
            raise BadRequest(f"shared memory key {key!r} is the server's own")
        try:
            # Never through a link: a key names a file in /dev/shm itself.
            descriptor = os.open(self._root / leaf, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise BadRequest(f"cannot open shared memory key {key!r}: {error.strerror}") from None
        try:
            facts = os.fstat(descriptor)
            if not stat.S_ISREG(facts.st_mode) or facts.st_uid != os.getuid():
                raise BadRequest(
                    f"shared memory key {key!r} is not a region this server's user created"
                )
            size = facts.st_size
            if offset + byte_size > size:
                raise BadRequest(
                    f"shared memory key {key!r} holds {size} bytes; offset {offset} + "
                    f"byte_size {byte_size} runs past it"
                )
            mapping = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        self._regions[name] = Region(name, key, offset, byte_size, mapping)

    def unregister(self, name: str | None = None) -> None:
        """One region, or every region when ``name`` is None; an unknown name is a no-op,
        as with Triton."""
        names = list(self._regions) if name is None else [name]
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                # A request still reading it keeps the mapping until its last view goes.
                with contextlib.suppress(BufferError):
                    region.mapping.close()

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        if name is None:
            return [r.status() for r in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"no shared memory region {name!r} is registered")
        return [region.status()]

    def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
        """``size`` bytes at ``offset`` into region ``name`` (for ``what``: an input or output)."""
        region = self._regions.get(name)
        if region is None:
            raise BadRequest(f"{what}: no shared memory region {name!r} is registered")
        if offset + size > region.byte_size:
            raise BadRequest(
                f"{what}: offset {offset} + {size} bytes runs past shared memory region "
                f"{name!r} ({region.byte_size} bytes)"
            )
        start = region.offset + offset
        return memoryview(region.mapping)[start : start + size]

    def close(self) -> None:
        self.unregister()
