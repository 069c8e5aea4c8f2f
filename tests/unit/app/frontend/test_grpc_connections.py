"""The connection shares' pieces without a gRPC server: how peers are counted, the socket
filter that holds a blocked address's new connections back, and how long a block lasts."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from app.frontend.grpc import connections
from app.frontend.grpc.connections import ConnectionShares, _host, _prefix, attach
from app.settings import LimitSettings


def test_peers_are_counted_by_ipv4_address_and_ipv6_64() -> None:
    assert _host("10.1.2.3") == "10.1.2.3"
    assert _host("::ffff:10.1.2.3") == "10.1.2.3"
    assert _host("2001:db8:1:2:aaaa::1") == _host("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert _host("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert _prefix("10.1.2.3") == bytes([10, 1, 2, 3])
    assert _prefix("2001:db8:1:2::/64") == bytes.fromhex("20010db800010002")


@contextlib.contextmanager
def listener(family: int, host: str) -> Iterator[socket.socket]:
    with socket.socket(family) as sock:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, 0))
        sock.listen()
        yield sock


def connects(source: str, target: tuple[str, int]) -> bool:
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((source, 0))
        sock.settimeout(0.5)  # a dropped SYN is retried only after a second
        try:
            sock.connect(target)
        except TimeoutError:
            return False
        return True


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")])
def test_the_filter_holds_back_only_the_blocked_addresses(family: int, host: str) -> None:
    with listener(family, host) as sock:
        port = sock.getsockname()[1]
        attach(sock, [_prefix("127.0.0.2"), _prefix("2001:db8::/64")])
        assert connects("127.0.0.1", ("127.0.0.1", port))
        assert not connects("127.0.0.2", ("127.0.0.1", port))
        assert connects("127.0.0.3", ("127.0.0.1", port))
        attach(sock, [])
        assert connects("127.0.0.2", ("127.0.0.1", port))


def test_the_filter_matches_an_ipv6_64() -> None:
    with listener(socket.AF_INET6, "::1") as sock:
        port = sock.getsockname()[1]
        attach(sock, [_prefix("2001:db8::/64")])
        assert connects("::1", ("::1", port))  # ::/64 is not blocked
        attach(sock, [_prefix(_host("::1")), _prefix("127.0.0.2")])
        assert not connects("::1", ("::1", port))


def test_a_block_lasts_longer_each_time_it_comes_back_soon() -> None:
    shares = ConnectionShares(LimitSettings(max_connections=8), port=1)
    shares._block("10.0.0.1", 100.0)
    assert shares.blocked == {"10.0.0.1": 105.0}
    shares._block("10.0.0.1", 103.0)  # still blocked: as long again from now
    assert shares.blocked == {"10.0.0.1": 108.0}
    del shares.blocked["10.0.0.1"]  # its block ended
    shares._block("10.0.0.1", 110.0)
    assert shares.blocked == {"10.0.0.1": 120.0}
    for _ in range(5):
        del shares.blocked["10.0.0.1"]
        shares._block("10.0.0.1", 130.0)
    assert shares.blocked == {"10.0.0.1": 130.0 + connections.MAX_COOL_DOWN_S}
    assert shares.urgent
