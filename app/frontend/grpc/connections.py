"""The gRPC connections one client address may hold: its share of ``max_connections``.

grpc core caps a process's connections (``grpc.max_allowed_incoming_connections``) but not
an address's, and grpc.aio tells Python nothing per connection: 1,000 idle connections from
one address, each kept past the idle timeout by a ``ServerLive`` now and then, locked every
other client out; closing them was not enough either, as a client that reopens each one at
once fills the cap again before anyone else connects. So ``ConnectionShares`` looks at the
process's own sockets (``/proc/self/fd``, as ``ss -p`` does): the TCP connections on the
gRPC port, by peer (an IPv6 client by its /64: one host has many of its addresses), and
grpc core's listening socket. An address that holds its share (``max_share_per_address``
of ``max_connections``) or more is **blocked**: a socket filter on the listener drops its
new connections' SYNs in the kernel (its client's retries wait, as for a full backlog), so
they never reach grpc core and never count; its newest connections past the share are shut
down (the peer sees the connection end; grpc core lets the socket go); the block lasts
``COOL_DOWN_S`` after the address was last seen at its share (twice its last block's
length, up to ``MAX_COOL_DOWN_S``, if it is blocked again soon after). While the process holds
more than ``max_connections`` less half of what a share leaves to the others (the
reserve: 125 of 1,000 at a share of 0.75), every address holding the reserve or more is
blocked too, so large holders cannot refill the cap between them as their connections
close (what they hold stays until it closes: idle at ``server.keep_alive_s``). The
sweep runs every ``FAST_SWEEP_INTERVAL_S`` while an address was blocked lately or the cap is
near full, every ``SWEEP_INTERVAL_S`` otherwise. A connection under its address's
share is never touched. With no ``/proc`` (not Linux) nothing is looked at.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import struct
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc

from app.metrics import http_refused
from app.settings import LimitSettings

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
FAST_SWEEP_INTERVAL_S = 0.2
"""A sweep costs some 25 ms of the event loop per 1,000 connections: about 12% of a core at
this rate, while an address was blocked lately or the cap is near full."""
COOL_DOWN_S = 5.0
MAX_COOL_DOWN_S = 60.0
"""An address blocked again within this of its last block waits twice as long as then, up
to this: a client that reopens whatever closes is kept waiting, not let in every 5 s."""
MAX_BLOCKED = 256
"""Most addresses one filter drops (the largest holders first): its size stays bounded."""
_ESTABLISHED = 1  # tcp_info's tcpi_state (linux/tcp.h)
_LISTEN = 10
_SO_ATTACH_FILTER = 26  # asm-generic/socket.h
_SO_DETACH_FILTER = 27
FDS = Path("/proc/self/fd")

Found = dict[str, list[tuple[int, socket.socket]]]


def _host(address: str) -> str:
    """A peer as the shares count it: an IPv4 address (mapped into IPv6 or not) whole, an
    IPv6 address by its /64 ("2001:db8::/64")."""
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address


def _prefix(host: str) -> bytes:
    """The source-address bytes a filter matches for ``host`` (``_host``'s spelling): 4 for
    IPv4, the 8 of a /64."""
    if host.endswith("/64"):
        return ipaddress.IPv6Network(host).network_address.packed[:8]
    return ipaddress.IPv4Address(host).packed


def sockets_on(port: int) -> Iterator[tuple[int, socket.socket]]:
    """This process's TCP sockets whose local port is ``port`` (its listener and its
    connections), each once, as its inode and a socket of its own on it (a duplicate
    descriptor: the caller closes it), in descriptor order."""
    inodes: set[int] = set()
    try:
        fds = sorted(int(name) for name in os.listdir(FDS))
    except OSError:
        return
    for fd in fds:
        try:
            link = os.readlink(FDS / str(fd))
            if not link.startswith("socket:["):
                continue
            inode = int(link[8:-1])
            if inode in inodes:
                continue  # grpc core holds some connections by two descriptors
            inodes.add(inode)
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getsockname()[1] == port:
                yield inode, sock
                continue
        except OSError:
            pass  # gone meanwhile
        sock.close()


def connections(port: int) -> tuple[Found, list[socket.socket]]:
    """This process's established TCP connections whose local port is ``port``, by peer
    (``_host``), each as its socket's inode and a socket of its own on the same connection
    (a duplicate descriptor: the caller closes it), in descriptor order; and the listening
    sockets on ``port``, duplicated too. One that is closing (shut down here, or by its
    peer, and not yet let go by grpc core) is not counted."""
    found: Found = defaultdict(list)
    listeners: list[socket.socket] = []
    for inode, sock in sockets_on(port):
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            if state == _ESTABLISHED:
                found[_host(sock.getpeername()[0])].append((inode, sock))
                continue
            if state == _LISTEN:
                listeners.append(sock)
                continue
        except OSError:
            pass  # a connection already gone
        sock.close()
    return found, listeners


def _instruction(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


_NET = -0x100000  # SKF_NET_OFF: loads relative to the IP header
_LD_W, _LD_B, _RSH, _JA, _JEQ, _RET = 0x20, 0x30, 0x74, 0x05, 0x15, 0x06
_ACCEPT, _DROP = _instruction(_RET, 0xFFFFFFFF), _instruction(_RET, 0)


def drop_filter(prefixes: list[bytes]) -> bytes:
    """A classic BPF program that drops packets from the IPv4 addresses (4 bytes) and IPv6
    /64s (8 bytes) of ``prefixes`` and accepts the rest: each match is followed by its own
    drop, so every jump stays short."""

    def word(offset: int) -> bytes:
        return _instruction(_LD_W, _NET + offset)

    v4, v6 = [], []
    for prefix in prefixes:
        if len(prefix) == 4:
            v4 += [word(12), _instruction(_JEQ, int.from_bytes(prefix), 0, 1), _DROP]
        else:
            high, low = int.from_bytes(prefix[:4]), int.from_bytes(prefix[4:])
            v6 += [word(8), _instruction(_JEQ, high, 0, 3), word(12)]
            v6 += [_instruction(_JEQ, low, 0, 1), _DROP]
    return b"".join(
        [
            _instruction(_LD_B, _NET),  # the IP version, in the high nibble
            _instruction(_RSH, 4),
            _instruction(_JEQ, 6, 1, 0),
            _instruction(_JA, len(v6) + 1),  # IPv4: past the IPv6 part
            *v6,
            _ACCEPT,
            *v4,
            _ACCEPT,
        ]
    )


def attach(listener: socket.socket, prefixes: list[bytes]) -> None:
    """Drops the SYNs (and every other packet) of ``prefixes`` at ``listener``; none: no
    filter. The connections it accepts inherit the filter, harmlessly: their peer is never
    one it drops (it was not when they were accepted, and a later filter is not theirs)."""
    if not prefixes:
        with contextlib.suppress(OSError):  # ENOENT: none attached
            listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        return
    program = drop_filter(prefixes)
    code = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HP", len(program) // 8, ctypes.addressof(code))
    listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)


class ConnectionShares:
    """Holds every client address to its share of this process's gRPC connections on
    ``port`` (the module's docstring), once ``run`` runs."""

    def __init__(self, limits: LimitSettings, port: int) -> None:
        self.port = port
        self.cap = limits.max_connections
        self.per_address = max(1, int(self.cap * limits.max_share_per_address))
        # Half of what a share leaves to the others: past cap less this, large holders wait
        # (none with a share of 1: shares are off).
        self.reserve = (self.cap - self.per_address) // 2
        self._sweeps = 0
        self._first_seen: dict[int, int] = {}
        """The sweep that first saw each connection (by its socket's inode): the newest of
        an address's connections are the ones closed, those it held longest kept."""
        self.blocked: dict[str, float] = {}
        """Each blocked address, and when its block ends (``time.monotonic``)."""
        self._strikes: dict[str, tuple[float, float]] = {}
        """Each address blocked lately: its last block's length, and when that is forgotten
        (``MAX_COOL_DOWN_S`` after the block ended)."""
        self._attached: list[bytes] = []

    @property
    def urgent(self) -> bool:
        """Whether the next sweep comes soon (an address blocked lately, or the cap near
        full): one that reopens its connections at once is seen again within a sweep."""
        return bool(self._strikes) or self._near_full

    _near_full = False

    def sweep(self) -> int:
        """Blocks and cuts back each address at or past its share; how many connections
        were shut down."""
        self._sweeps += 1
        now = time.monotonic()
        self.blocked = {host: until for host, until in self.blocked.items() if until > now}
        self._strikes = {host: kept for host, kept in self._strikes.items() if kept[1] > now}
        try:
            # Fewer descriptors than a share: no address can be at it.
            if not self.blocked and len(os.listdir(FDS)) < self.per_address:
                self._first_seen.clear()
                self._near_full = False
                self._filter([], None)
                return 0
        except OSError:
            return 0
        found, listeners = connections(self.port)
        try:
            return self._cut(found, listeners, now)
        finally:
            for entries in found.values():
                for _, sock in entries:
                    sock.close()
            for listener in listeners:
                listener.close()

    def _cut(self, found: Found, listeners: list[socket.socket], now: float) -> int:
        seen = {
            inode: self._first_seen.get(inode, self._sweeps)
            for entries in found.values()
            for inode, _ in entries
        }
        self._first_seen = seen
        self._near_full = self.reserve > 0 and len(seen) > self.cap - self.reserve
        for host, socks in found.items():
            if len(socks) >= self.per_address or (self._near_full and len(socks) >= self.reserve):
                self._block(host, now)
        # The filter first: what is shut down below cannot be reopened meanwhile.
        self._filter(listeners, found)
        closed = 0
        for host, socks in found.items():
            if len(socks) <= self.per_address:
                continue
            socks.sort(key=lambda entry: seen[entry[0]])  # stable: descriptor order next
            for _, sock in socks[self.per_address :]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
            log.warning(
                "closed %d gRPC connection(s) of %s past its share of "
                "limits.max_connections (%d); its new ones wait %g s",
                len(socks) - self.per_address,
                host,
                self.per_address,
                self._strikes[host][0],
            )
        if closed:
            http_refused(503, "grpc_connections", closed)
        return closed

    def _block(self, host: str, now: float) -> None:
        """Blocks ``host`` from ``now``: as long as its block now if it still has one, else
        ``COOL_DOWN_S``, or twice its last block if that ended lately."""
        length, _ = self._strikes.get(host, (COOL_DOWN_S / 2, 0.0))
        if host not in self.blocked:
            length = min(2 * length, MAX_COOL_DOWN_S)
        self.blocked[host] = now + length
        self._strikes[host] = (length, now + length + MAX_COOL_DOWN_S)

    def _filter(self, listeners: list[socket.socket], found: Found | None) -> None:
        """Sets the listeners' filter to the blocked addresses, the largest holders first,
        where that changed."""
        held = found or {}
        hosts = sorted(self.blocked, key=lambda host: -len(held.get(host, ())))
        prefixes = []
        for host in hosts[:MAX_BLOCKED]:
            with contextlib.suppress(ValueError):  # not an IP address: nothing to match
                prefixes.append(_prefix(host))
        if prefixes == self._attached:
            return
        if found is None:  # the sweep that lifts the last block looks for the listeners
            _, listeners = connections(self.port)
        try:
            for listener in listeners:
                attach(listener, prefixes)
        finally:
            if found is None:
                for listener in listeners:
                    listener.close()
        self._attached = prefixes

    async def run(self, server: grpc.aio.Server) -> None:
        """Sweep every ``SWEEP_INTERVAL_S`` (``FAST_SWEEP_INTERVAL_S`` while ``urgent``)
        until ``server`` has stopped; nothing with a share of all (``max_share_per_address``
        1: behind a proxy every client has its address)."""
        if self.per_address >= self.cap:
            return
        # wait_for_termination is True when it timed out: the server still serves.
        while await server.wait_for_termination(
            FAST_SWEEP_INTERVAL_S if self.urgent else SWEEP_INTERVAL_S
        ):
            try:
                self.sweep()
            except Exception as error:  # a sweep that failed must not end the sweeps
                log.error("gRPC connection sweep failed: %s", error, exc_info=error)
