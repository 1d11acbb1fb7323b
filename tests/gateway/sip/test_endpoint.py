"""The asyncio SIP adapter over real loopback sockets (UDP and TCP): framing, keep-alives, large
INVITEs, malformed input, metrics. The application here answers every call at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from prometheus_client import REGISTRY

from gateway.sip.agent import AgentConfig, CallEvent, CallOffered, CallReleased, UserAgent
from gateway.sip.endpoint import SipEndpoint
from tests.gateway.sip.factories import SDP_OFFER, header, invite, request, status_of, to_tag_of

ANSWER = (
    b"v=0\r\no=ttg 1 0 IN IP4 127.0.0.1\r\ns=ttg\r\n"
    b"c=IN IP4 127.0.0.1\r\nt=0 0\r\nm=audio 20000 RTP/AVP 0\r\n"
)
BIG_SDP = SDP_OFFER + "".join(f"a=x-filler-{i}:{'z' * 60}\r\n" for i in range(40))  # SIPREC-size


class AnsweringApp:
    def __init__(self) -> None:
        self.endpoint: SipEndpoint | None = None
        self.events: list[CallEvent] = []

    def on_sip_event(self, event: CallEvent) -> None:
        self.events.append(event)
        if isinstance(event, CallOffered) and self.endpoint is not None:
            self.endpoint.answer(event.call_ref, ANSWER)


class UdpPeer(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.queue.put_nowait(data)

    async def recv(self, timeout: float = 2.0) -> bytes:
        return await asyncio.wait_for(self.queue.get(), timeout)


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[SipEndpoint, AnsweringApp]]:
    app = AnsweringApp()
    ep = SipEndpoint(UserAgent(AgentConfig(host="127.0.0.1", port=0)), app, host="127.0.0.1", port=0)
    app.endpoint = ep
    await ep.start()
    try:
        yield ep, app
    finally:
        await ep.close()


async def udp_peer() -> tuple[UdpPeer, int]:
    loop = asyncio.get_running_loop()
    transport, peer = await loop.create_datagram_endpoint(UdpPeer, local_addr=("127.0.0.1", 0))
    return peer, int(transport.get_extra_info("sockname")[1])


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_udp_options_and_a_large_invite_are_answered(
    endpoint: tuple[SipEndpoint, AnsweringApp],
) -> None:
    ep, app = endpoint
    peer, port = await udp_peer()
    assert peer.transport is not None
    dest = ("127.0.0.1", ep.port)
    peer.transport.sendto(request("OPTIONS", via_host=f"127.0.0.1:{port}"), dest)
    assert status_of(await peer.recv()) == 200
    big = invite(via_host=f"127.0.0.1:{port}", body=BIG_SDP)
    assert len(big) > 3000  # over the 1300-byte MTU rule, still taken over UDP
    peer.transport.sendto(big, dest)
    assert status_of(await peer.recv()) == 100
    ok = await peer.recv()
    assert status_of(ok) == 200 and ok.endswith(ANSWER)
    peer.transport.sendto(request("ACK", via_host=f"127.0.0.1:{port}", to_tag=to_tag_of(ok)), dest)
    await asyncio.sleep(0.05)
    assert [type(e).__name__ for e in app.events] == ["CallOffered", "CallConfirmed"]
    peer.transport.close()


async def test_udp_junk_is_counted_and_the_endpoint_keeps_serving(
    endpoint: tuple[SipEndpoint, AnsweringApp],
) -> None:
    ep, _ = endpoint
    peer, port = await udp_peer()
    assert peer.transport is not None
    dest = ("127.0.0.1", ep.port)
    before_binary = metric("ttg_sip_errors_total", reason="binary")
    before_malformed = metric("ttg_sip_errors_total", reason="malformed")
    peer.transport.sendto(bytes(range(256)) * 8, dest)
    peer.transport.sendto(b"\xff" * 1400, dest)
    bad = request("OPTIONS", via_host=f"127.0.0.1:{port}").replace(b"CSeq: 1 OPTIONS", b"CSeq: 1 INVITE")
    peer.transport.sendto(bad, dest)
    r = await peer.recv()
    assert status_of(r) == 400
    peer.transport.sendto(request("OPTIONS", via_host=f"127.0.0.1:{port}"), dest)
    assert status_of(await peer.recv()) == 200
    assert metric("ttg_sip_errors_total", reason="binary") - before_binary == 2
    assert metric("ttg_sip_errors_total", reason="malformed") - before_malformed == 1
    peer.transport.close()


async def test_tcp_large_invite_keepalive_and_bye_on_the_same_connection(
    endpoint: tuple[SipEndpoint, AnsweringApp],
) -> None:
    ep, app = endpoint
    reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
    local_port = writer.get_extra_info("sockname")[1]
    via = f"127.0.0.1:{local_port}"
    big = invite(transport="TCP", via_host=via, body=BIG_SDP)
    writer.write(big[:1000])  # in pieces: framing by Content-Length (§18.3)
    await writer.drain()
    await asyncio.sleep(0.02)
    writer.write(big[1000:] + b"\r\n\r\n")  # ... followed by a keep-alive ping
    await writer.drain()

    async def read_message() -> bytes:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        length = int(header(head, "Content-Length") or 0)
        return head + (await reader.readexactly(length) if length else b"")

    assert status_of(await read_message()) == 100
    ok = await read_message()
    assert status_of(ok) == 200 and header(ok, "Contact") == f"<sip:127.0.0.1:{ep.port};transport=tcp>"
    assert await asyncio.wait_for(reader.readexactly(2), 2) == b"\r\n"  # RFC 5626 pong
    writer.write(request("ACK", transport="TCP", via_host=via, to_tag=to_tag_of(ok)))
    await writer.drain()
    await asyncio.sleep(0.05)
    ref = app.events[0].call_ref
    ep.hangup(ref, reason="test")
    bye = await read_message()
    assert bye.startswith(b"BYE sip:alice@127.0.0.1:5070 SIP/2.0")
    assert "SIP/2.0/TCP" in (header(bye, "Via") or "")
    writer.close()
    await writer.wait_closed()


async def test_tcp_stream_that_cannot_be_framed_is_closed_and_others_go_on(
    endpoint: tuple[SipEndpoint, AnsweringApp],
) -> None:
    ep, _ = endpoint
    before = metric("ttg_sip_errors_total", reason="framing")
    reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
    writer.write(request("OPTIONS", transport="TCP").replace(b"Content-Length: 0\r\n", b""))
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 2)  # a 400 for the request, then closed
    assert status_of(answer) == 400 and b"Content-Length is required" in answer
    assert metric("ttg_sip_errors_total", reason="framing") - before == 1
    reader2, writer2 = await asyncio.open_connection("127.0.0.1", ep.port)
    writer2.write(request("OPTIONS", transport="TCP"))
    await writer2.drain()
    head = await asyncio.wait_for(reader2.readuntil(b"\r\n\r\n"), 2)
    assert status_of(head) == 200
    writer.close()
    writer2.close()


async def test_sip_metrics_count_requests_and_responses(endpoint: tuple[SipEndpoint, AnsweringApp]) -> None:
    ep, _ = endpoint
    peer, port = await udp_peer()
    assert peer.transport is not None
    before_req = metric("ttg_sip_requests_total", method="OPTIONS")
    before_resp = metric("ttg_sip_responses_total", code="200")
    peer.transport.sendto(request("OPTIONS", via_host=f"127.0.0.1:{port}"), ("127.0.0.1", ep.port))
    await peer.recv()
    assert metric("ttg_sip_requests_total", method="OPTIONS") - before_req == 1
    assert metric("ttg_sip_responses_total", code="200") - before_resp == 1
    peer.transport.close()


class _ScriptedAgent(UserAgent):
    """The real core, except that answering also reports the call released at once: an action whose
    effects include a call event, as hangup/timer paths can."""

    def answer(
        self,
        call_ref: str,
        sdp: bytes,
        now: float,
        *,
        contact_host: str | None = None,
        recording: bool = False,
    ) -> list[Any]:
        answered = super().answer(call_ref, sdp, now, contact_host=contact_host, recording=recording)
        return [*answered, CallReleased(call_ref, 200)]


async def test_effects_of_an_action_taken_inside_a_handler_wait_their_turn() -> None:
    seen: list[tuple[str, bool]] = []

    class App:
        inside = False

        def on_sip_event(self, event: CallEvent) -> None:
            seen.append((type(event).__name__, self.inside))
            self.inside = True
            try:
                if isinstance(event, CallOffered):
                    ep.answer(event.call_ref, ANSWER)
                    seen.append(("answer returned", False))
            finally:
                self.inside = False

    ep = SipEndpoint(_ScriptedAgent(AgentConfig(host="127.0.0.1", port=0)), App(), host="127.0.0.1", port=0)
    await ep.start()
    try:
        peer, port = await udp_peer()
        assert peer.transport is not None
        peer.transport.sendto(invite(via_host=f"127.0.0.1:{port}"), ("127.0.0.1", ep.port))
        assert status_of(await peer.recv()) == 100
        assert status_of(await peer.recv()) == 200
        # Never re-entered: the release reported by `answer` came after the offer's handler returned.
        assert seen == [("CallOffered", False), ("answer returned", False), ("CallReleased", False)]
    finally:
        await ep.close()
