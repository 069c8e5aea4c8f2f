"""The gRPC connections one client address may hold: its share of ``max_connections``.

grpc core caps a process's connections (``grpc.max_allowed_incoming_connections``) but not
an address's, and grpc.aio tells Python nothing per connection: 1,000 idle connections from
one address, each kept past the idle timeout by a ``ServerLive`` now and then, locked every
other client out. So ``ConnectionShares`` looks at the process's own sockets once a second:
the TCP connections on the gRPC port, by peer address (``/proc/self/fd``, as ``ss -p`` does);
an address holding more than ``max_share_per_address`` of ``max_connections`` has its
newest ones shut down (the peer sees the connection end, as over its share over HTTP; grpc
core sees a closed peer and lets the socket go). A flood is thus undone within a second,
the other addresses keep the rest of the cap, and a connection under its address's share
is never touched. With no ``/proc`` (not Linux) nothing is looked at.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc

from app.metrics import http_refused
from app.settings import LimitSettings

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
_ESTABLISHED = 1  # tcp_info's tcpi_state of an open connection (linux/tcp.h)
FDS = Path("/proc/self/fd")


def _host(address: str) -> str:
    """A peer's host as the limits name it: an IPv4 address mapped into IPv6 as IPv4."""
    with contextlib.suppress(ValueError):
        mapped = ipaddress.ip_address(address)
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            return str(mapped.ipv4_mapped)
    return address


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


def connections(port: int) -> dict[str, list[tuple[int, socket.socket]]]:
    """This process's established TCP connections whose local port is ``port``, by peer
    host, each as its socket's inode and a socket of its own on the same connection (a
    duplicate descriptor: the caller closes it), in descriptor order. One that is closing
    (shut down here, or by its peer, and not yet let go by grpc core) is not counted."""
    found: dict[str, list[tuple[int, socket.socket]]] = defaultdict(list)
    for inode, sock in sockets_on(port):
        try:
            if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _ESTABLISHED:
                found[_host(sock.getpeername()[0])].append((inode, sock))
                continue
        except OSError:
            pass  # a listener, or a connection already gone
        sock.close()
    return found


def _all(
    found: dict[str, list[tuple[int, socket.socket]]],
) -> list[tuple[int, socket.socket]]:
    return [entry for entries in found.values() for entry in entries]


class ConnectionShares:
    """Holds every client address to its share of this process's gRPC connections on
    ``port`` (the module's docstring), once ``run`` runs."""

    def __init__(self, limits: LimitSettings, port: int) -> None:
        self.port = port
        self.per_address = max(1, int(limits.max_connections * limits.max_share_per_address))
        self._sweeps = 0
        self._first_seen: dict[int, int] = {}
        """The sweep that first saw each connection (by its socket's inode): the newest of
        an address's connections are the ones closed, those it held longest kept."""

    def sweep(self) -> int:
        """Shut down what each address holds past its share; how many were."""
        self._sweeps += 1
        try:
            # Fewer descriptors than a share: no address can be over it.
            if len(os.listdir(FDS)) <= self.per_address:
                self._first_seen.clear()
                return 0
        except OSError:
            return 0
        found = connections(self.port)
        seen = {inode: self._first_seen.get(inode, self._sweeps) for inode, _ in _all(found)}
        self._first_seen = seen
        closed = 0
        for host, socks in found.items():
            socks.sort(key=lambda entry: seen[entry[0]])  # stable: descriptor order next
            for _, sock in socks[self.per_address :]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
            for _, sock in socks:
                sock.close()
            if len(socks) > self.per_address:
                log.warning(
                    "closed %d gRPC connection(s) of %s past its share of "
                    "limits.max_connections (%d)",
                    len(socks) - self.per_address,
                    host,
                    self.per_address,
                )
        if closed:
            http_refused(503, "grpc_connections", closed)
        return closed

    async def run(self, server: grpc.aio.Server) -> None:
        """Sweep once every ``SWEEP_INTERVAL_S`` until ``server`` has stopped."""
        # wait_for_termination is True when it timed out: the server still serves.
        while await server.wait_for_termination(SWEEP_INTERVAL_S):
            try:
                self.sweep()
            except Exception as error:  # a sweep that failed must not end the sweeps
                log.error("gRPC connection sweep failed: %s", error, exc_info=error)
