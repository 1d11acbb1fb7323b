"""Ports handed to the processes the tests, the demo and the benches start: free when handed out, and
below the kernel's ephemeral range, where no outgoing connection (the gateway's Redis clients) can take
one before the process it is meant for binds it."""

from __future__ import annotations

import contextlib
import socket

from tools.ports import _ephemeral_low, free_port, port_block


def _binds(port: int, *kinds: int) -> bool:
    with contextlib.ExitStack() as held:
        try:
            for kind in kinds:
                held.enter_context(socket.socket(socket.AF_INET, kind)).bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_free_port_binds_over_udp_and_tcp_below_the_ephemeral_range() -> None:
    for _ in range(20):
        port = free_port()
        assert port < _ephemeral_low()
        assert _binds(port, socket.SOCK_DGRAM, socket.SOCK_STREAM)


def test_a_block_is_even_consecutive_free_and_not_the_block_handed_out_before() -> None:
    first = port_block(200)
    with contextlib.ExitStack() as held:  # the first block's process has bound its ports
        for port in range(first, first + 200):
            held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)).bind(("127.0.0.1", port))
        second = port_block(4)
    assert first % 2 == 0 and second % 2 == 0
    assert not first <= second < first + 200
    assert second + 3 < _ephemeral_low()
    assert all(_binds(p, socket.SOCK_DGRAM) for p in range(second, second + 4))
