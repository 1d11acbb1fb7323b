"""The SIP endpoint's socket limits over real loopback sockets, on both event loops the daemon runs
(asyncio and uvloop): TCP framing through uvloop's transport, idle and slow-message time-outs, the
per-source connection cap, the UDP receive buffer, and the auth-failure log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from gateway.sip.agent import AgentConfig, AuthFailure, UserAgent
from gateway.sip.endpoint import SipEndpoint, TransportConfig, _log_auth_failure
from tests.gateway.sip.factories import invite, request, status_of
from tests.gateway.sip.test_endpoint import AnsweringApp, metric

LoopRun = Callable[[Callable[[], Awaitable[None]]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def on_loop(request: pytest.FixtureRequest) -> LoopRun:
    """Run a scenario on a fresh event loop of the kind the daemon picks (gateway.daemon._run_loop)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def run(scenario: Callable[[], Awaitable[None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(scenario())  # type: ignore[arg-type]

    return run


LIMITS = TransportConfig(tcp_max_per_source=3, tcp_idle_timeout_s=0.4, tcp_header_timeout_s=0.3)


@contextlib.asynccontextmanager
async def running_endpoint(limits: TransportConfig = LIMITS) -> AsyncIterator[SipEndpoint]:
    app = AnsweringApp()
    ua = UserAgent(AgentConfig(host="127.0.0.1", port=0))
    ep = SipEndpoint(ua, app, host="127.0.0.1", port=0, transport=limits)
    app.endpoint = ep
    await ep.start()
    try:
        yield ep
    finally:
        await ep.close()


async def options_over(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    writer.write(request("OPTIONS", transport="TCP"))
    await writer.drain()
    return status_of(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2))


async def closed_by_peer(reader: asyncio.StreamReader, within_s: float = 3.0) -> bool:
    """The gateway closed the connection: EOF, or a reset (what a write after its close earns)."""
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except ConnectionResetError:
        return True
    except (ConnectionError, TimeoutError):
        return False


def test_sip_over_tcp_is_answered_on_this_event_loop(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            assert await options_over(reader, writer) == 200
            assert endpoint.tcp_connections == 1
            writer.close()

    on_loop(scenario)


def test_an_idle_tcp_connection_is_closed_after_the_idle_timeout(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            before = metric("ttg_sip_errors_total", reason="tcp_idle")
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            assert await options_over(reader, writer) == 200
            assert await closed_by_peer(reader)
            assert metric("ttg_sip_errors_total", reason="tcp_idle") - before == 1
            writer.close()

    on_loop(scenario)


def test_traffic_keeps_a_connection_open_past_the_idle_timeout(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            for _ in range(5):  # 5 x 0.2 s = 1 s, over twice the idle timeout
                writer.write(b"\r\n\r\n")  # RFC 5626 keep-alive
                await writer.drain()
                assert await asyncio.wait_for(reader.readexactly(2), 2) == b"\r\n"
                await asyncio.sleep(0.2)
            assert await options_over(reader, writer) == 200
            writer.close()

    on_loop(scenario)


def test_a_message_not_completed_within_the_header_timeout_closes_the_connection(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            before = metric("ttg_sip_errors_total", reason="tcp_incomplete")
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            msg = request("OPTIONS", transport="TCP")
            for i in range(0, 40, 4):  # a slow sender: a few bytes every 0.1 s, never the whole message
                if reader.at_eof() or writer.transport.is_closing():
                    break
                try:
                    writer.write(msg[i : i + 4])
                    await writer.drain()
                except (ConnectionError, RuntimeError):  # closed under us (uvloop: RuntimeError)
                    break
                await asyncio.sleep(0.1)
            assert await closed_by_peer(reader)
            assert metric("ttg_sip_errors_total", reason="tcp_incomplete") - before == 1
            writer.close()

    on_loop(scenario)


def test_a_slow_sender_is_cut_at_the_header_timeout_even_with_a_long_idle_timeout(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        limits = TransportConfig(tcp_idle_timeout_s=60.0, tcp_header_timeout_s=0.3)
        async with running_endpoint(limits) as endpoint:
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            await asyncio.sleep(0.2)  # connected, quiet (the idle timer runs)
            writer.write(request("OPTIONS", transport="TCP")[:30])  # a message begins, never ends
            await writer.drain()
            assert await closed_by_peer(reader, within_s=5.0)
            writer.close()

    on_loop(scenario)


def test_one_source_may_hold_only_its_share_of_tcp_connections(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            before = metric("ttg_sip_errors_total", reason="tcp_source_limit")
            held = [await asyncio.open_connection("127.0.0.1", endpoint.port) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert endpoint.tcp_connections == 3
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)  # the 4th
            assert await closed_by_peer(reader, 1.0)
            assert metric("ttg_sip_errors_total", reason="tcp_source_limit") - before == 1
            # UDP from the same host is unaffected, and a freed slot can be taken again.
            held[0][1].close()
            await asyncio.sleep(0.05)
            reader5, writer5 = await asyncio.open_connection("127.0.0.1", endpoint.port)
            assert await options_over(reader5, writer5) == 200
            for _, w in [*held, (reader, writer), (reader5, writer5)]:
                w.close()

    on_loop(scenario)


def test_the_udp_receive_buffer_is_raised(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            assert endpoint._udp is not None
            sock = endpoint._udp.get_extra_info("socket")
            got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as plain:
                default = plain.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            # Root (CI) may force it past net.core.rmem_max; otherwise it is raised up to that limit.
            assert got > default or got >= LIMITS.udp_recv_buffer_bytes

    on_loop(scenario)


def test_an_auth_failure_is_one_log_line_with_source_user_and_count(caplog: pytest.LogCaptureFixture) -> None:
    before = metric("ttg_sip_auth_failures_total")
    with caplog.at_level(logging.WARNING, logger="gateway.sip.endpoint"):
        _log_auth_failure(AuthFailure(("192.0.2.5", 5071), 'tr"unk\n\x1b[31m', "ttg", "bad credentials", 2))
    (line,) = caplog.messages
    assert line == (
        'SIP auth failed: source=192.0.2.5:5071 user="tr\\x22unk\\n\\x1b[31m" realm="ttg" '
        'reason="bad credentials" failures=2'
    )
    assert metric("ttg_sip_auth_failures_total") - before == 1


def test_a_quiet_tcp_connection_that_carries_a_live_call_stays_open(on_loop: LoopRun) -> None:
    async def scenario() -> None:
        async with running_endpoint() as endpoint:
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            writer.write(invite(transport="TCP"))
            await writer.drain()
            head = b""
            while b" 200 OK" not in head:  # 100 Trying, then the 200 the test app answers with
                head += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            assert not await closed_by_peer(reader, within_s=3 * LIMITS.tcp_idle_timeout_s)
            assert endpoint.tcp_connections == 1
            writer.close()

    on_loop(scenario)
