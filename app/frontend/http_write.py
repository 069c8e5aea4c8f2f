"""One socket write per response: uvicorn's httptools cycle writes a response's status line
and headers, then its body, as two ``transport.write`` calls. On a kept-alive connection
each is a ``send`` system call (the kernel's whole loopback or NIC path, and with
``TCP_NODELAY`` a segment of its own that wakes the client once more): about a tenth of the
event loop's time for a small answer (BENCHMARKS.md, "A request's budget"). ``HeadHeld``
stands in for the cycle's transport and holds the head back until the body's first write,
which carries both, or until the end of this turn of the loop (a streamed response whose
first chunk comes later still gets its head at once).
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeadHeld:
    """The transport one request's response cycle writes through; every other call goes to
    the connection's transport as it is."""

    __slots__ = ("_held", "_started", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._started = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._started:  # the head
            self._started = True
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self.flush)
            return
        held = self._held
        if held is None:
            self._transport.write(data)
            return
        self._held = None
        # One call, one system call: uvloop sends the pieces with one writev, no join.
        self._transport.writelines((held, data))

    def flush(self) -> None:
        """Write what is held, if anything."""
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
