"""The demo's loopback ports: free, and below the kernel's ephemeral range, where no outgoing
connection (the gateway's Redis clients) can take one before the process it is meant for binds it."""

from __future__ import annotations

import contextlib
import socket

from tools.demo import _ephemeral_low, free_even_udp_port, free_port, free_sip_port


def _binds(port: int, *kinds: int) -> bool:
    with contextlib.ExitStack() as held:
        try:
            for kind in kinds:
                held.enter_context(socket.socket(socket.AF_INET, kind)).bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_gateways_sip_and_http_ports_are_free_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        sip, http = free_sip_port(), free_port()
        assert sip < low and http < low
        assert _binds(sip, socket.SOCK_DGRAM, socket.SOCK_STREAM) and _binds(http, socket.SOCK_STREAM)


def test_the_callers_rtp_port_is_even_with_the_three_above_it_free() -> None:
    for _ in range(20):
        rtp = free_even_udp_port()
        assert rtp % 2 == 0 and rtp + 3 < _ephemeral_low()
        assert all(_binds(p, socket.SOCK_DGRAM) for p in range(rtp, rtp + 4))
