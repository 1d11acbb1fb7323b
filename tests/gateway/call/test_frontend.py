"""TelephonyFrontEnd with hand-written SIP over loopback UDP, the in-process legs over a signalling-only
fake media manager and the recording ASR engine: the effects of the call core carried out on real
sockets (answers, refusals, re-INVITEs, drain and shutdown)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gateway.call.core import CallConfig
from gateway.call.frontend import FrontEndConfig, TelephonyFrontEnd
from gateway.call.legs import LocalLegs
from gateway.config import Settings
from tests.fixtures.telephony import FakeMediaManager, MemoryPublisher, RecordingEngine, UdpPeer
from tests.gateway.sip.factories import SDP_OFFER, header, invite, request, to_tag_of


def test_config_from_settings() -> None:
    settings = Settings(
        sip={"port": 5080, "max_calls": 7, "digest_user": "pbx", "digest_password": "pw", "invite_rate": 2.0,
             "dnis_languages": {"100": "de-DE"}, "answer_delay_ms": 250, "t1_ms": 250},
        asr={"language": "uk-UA"},
    )  # fmt: skip
    cfg = FrontEndConfig.from_settings(settings, model_name="nemotron")
    assert (cfg.sip_port, cfg.admission.max_calls, cfg.admission.invite_rate_per_s) == (5080, 7, 2.0)
    assert cfg.digest is not None and cfg.digest.username == "pbx"
    assert cfg.call.dnis_languages == {"100": "de-DE"} and cfg.call.default_language == "uk-UA"
    assert cfg.call.answer_delay_s == 0.25 and cfg.timers.t1 == 0.25 and cfg.call.model_name == "nemotron"


# --- the front end on loopback --------------------------------------------------------------------


class Rig:
    def __init__(self, frontend: TelephonyFrontEnd, engine: RecordingEngine, publisher: MemoryPublisher,
                 media: Any) -> None:  # fmt: skip
        self.frontend, self.engine, self.publisher, self.media = frontend, engine, publisher, media

    async def peer(self) -> UdpPeer:
        return await UdpPeer.open(self.frontend.sip_port)

    async def call(self, peer: UdpPeer, **kw: Any) -> bytes:
        """INVITE → 200 → ACK; returns the 200."""
        peer.send(invite(via_host=f"127.0.0.1:{peer.port}", **kw))
        ok = await peer.recv_status(200)
        peer.send(
            request(
                "ACK",
                via_host=f"127.0.0.1:{peer.port}",
                to_tag=to_tag_of(ok),
                call_id=kw.get("call_id", "call-1@127.0.0.1"),
            )
        )
        return ok

    async def settle(self) -> None:
        for _ in range(200):
            if not self.frontend.active_calls:
                return
            await asyncio.sleep(0.01)


RigFactory = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def rig() -> AsyncIterator[RigFactory]:
    made: list[Rig] = []

    async def make(*, engine: RecordingEngine | None = None, media: Any = None, **call: Any) -> Rig:
        cfg = FrontEndConfig(sip_host="127.0.0.1", sip_port=0, call=CallConfig(finish_timeout_s=2.0, **call))
        engine = engine or RecordingEngine()
        media = media or FakeMediaManager()
        publisher = MemoryPublisher()
        r = Rig(TelephonyFrontEnd(cfg, LocalLegs(engine, media), publisher), engine, publisher, media)
        await r.frontend.start()
        made.append(r)
        return r

    yield make
    for r in made:
        await r.frontend.close(timeout_s=0.5)


async def test_a_call_answers_with_our_sdp_and_a_bye_ends_it_with_call_end(rig: RigFactory) -> None:
    r = await rig()
    peer = await r.peer()
    ok = await r.call(peer)
    body = ok.split(b"\r\n\r\n", 1)[1].decode()
    (media,) = r.media.opened.values()
    assert (
        f"m=audio {media.port} RTP/AVP 0 101" in body
        and "a=recvonly" in body
        and "c=IN IP4 127.0.0.1" in body
    )
    peer.send(request("BYE", via_host=f"127.0.0.1:{peer.port}", to_tag=to_tag_of(ok), cseq=2))
    await peer.recv_status(200)
    await r.settle()
    (call_id,) = r.publisher.call_ids()
    assert r.publisher.types(call_id) == ["call_start", "final", "call_end"]
    assert media.closed
    peer.close()


async def test_offer_without_a_common_codec_is_488_and_never_becomes_a_session(rig: RigFactory) -> None:
    r = await rig()
    peer = await r.peer()
    g729 = SDP_OFFER.replace("RTP/AVP 0 8 101", "RTP/AVP 18").replace("a=rtpmap:0 PCMU/8000\r\n", "")
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}", body=g729))
    refusal = await peer.recv_status(488)
    assert "no common codec" in (header(refusal, "Warning") or "")
    assert r.publisher.events == [] and r.engine.streams == {}
    peer.close()


async def test_engine_down_is_503(rig: RigFactory) -> None:
    engine = RecordingEngine()
    engine.stopped = True
    r = await rig(engine=engine)
    peer = await r.peer()
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}"))
    await peer.recv_status(503)
    assert r.publisher.events == []
    peer.close()


async def test_unknown_language_falls_back_to_the_default(rig: RigFactory) -> None:
    r = await rig(engine=RecordingEngine(languages=("en-US",)))
    peer = await r.peer()
    await r.call(peer, extra=("X-Language: xx-YY",))
    (stream,) = r.engine.streams.values()
    assert stream.options.language == "en-US"
    assert r.publisher.events[0].lang == "en-US"
    peer.close()


async def test_no_rtp_port_is_503_and_the_session_still_closes_its_stream(rig: RigFactory) -> None:
    r = await rig(media=FakeMediaManager(fail=True))
    peer = await r.peer()
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}"))
    await peer.recv_status(503)
    await r.settle()
    (call_id,) = r.publisher.call_ids()
    assert r.publisher.types(call_id) == ["call_start", "final", "call_end"]
    assert r.publisher.ends()[call_id].extra["reason"] == "error"
    peer.close()


async def test_cancel_while_the_rtp_port_is_opening_closes_it_when_it_arrives(rig: RigFactory) -> None:
    media = FakeMediaManager(held=True)
    r = await rig(media=media)
    peer = await r.peer()
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}", branch="z9hG4bKslow"))
    await peer.recv_status(100)
    peer.send(request("CANCEL", via_host=f"127.0.0.1:{peer.port}", branch="z9hG4bKslow"))
    await peer.recv_status(200)
    await peer.recv_status(487)
    media.release.set()
    await r.settle()
    (opened,) = media.opened.values()
    assert opened.closed
    (call_id,) = r.publisher.call_ids()
    assert r.publisher.ends()[call_id].extra["reason"] == "cancel"
    peer.close()


async def test_reinvite_moves_the_media_to_hold_and_a_new_address(rig: RigFactory) -> None:
    r = await rig()
    peer = await r.peer()
    ok = await r.call(peer)
    tag = to_tag_of(ok)
    (media,) = r.media.opened.values()
    hold = SDP_OFFER.replace("a=sendrecv", "a=sendonly").replace("o=- 1 1", "o=- 1 2")
    moved = hold.replace("c=IN IP4 127.0.0.1", "c=IN IP4 127.0.0.2").replace("m=audio 6000", "m=audio 7000")
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}", to_tag=tag, cseq=2, body=moved))
    ok2 = await peer.recv_status(200)
    assert b"a=recvonly" in ok2 and b"o=ttg" in ok2
    (plan,) = media.updates
    assert plan.on_hold and (plan.remote_host, plan.remote_port) == ("127.0.0.2", 7000)
    peer.send(request("ACK", via_host=f"127.0.0.1:{peer.port}", to_tag=tag, cseq=2))
    # A broken re-offer is refused and changes nothing (RFC 3264 §8).
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}", to_tag=tag, cseq=3, body="v=0\r\nbogus\r\n"))
    await peer.recv_status(400)
    assert len(media.updates) == 1
    # An offerless re-INVITE (a refresh) gets our current SDP as the offer.
    peer.send(request("INVITE", via_host=f"127.0.0.1:{peer.port}", to_tag=tag, cseq=4))
    ok3 = await peer.recv_status(200)
    assert ok3.split(b"\r\n\r\n", 1)[1] == ok2.split(b"\r\n\r\n", 1)[1]
    peer.send(request("ACK", via_host=f"127.0.0.1:{peer.port}", to_tag=tag, cseq=4))
    peer.send(request("BYE", via_host=f"127.0.0.1:{peer.port}", to_tag=tag, cseq=5))
    await peer.recv_status(200)
    await r.settle()
    assert r.publisher.types(r.publisher.call_ids()[0])[-1] == "call_end"
    peer.close()


async def test_drain_refuses_new_calls_and_waits_for_the_current_ones(rig: RigFactory) -> None:
    r = await rig()
    peer = await r.peer()
    ok = await r.call(peer)
    r.frontend.stop_admitting()
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}", call_id="late@127.0.0.1"))
    refused = await peer.recv_status(503)
    assert header(refused, "Retry-After") == "5"
    assert not await r.frontend.drain(0.2)
    peer.send(request("BYE", via_host=f"127.0.0.1:{peer.port}", to_tag=to_tag_of(ok), cseq=2))
    assert await r.frontend.drain(2.0)
    peer.close()


async def test_close_hangs_up_ringing_calls_with_503(rig: RigFactory) -> None:
    r = await rig(answer_delay_s=5.0)
    peer = await r.peer()
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}"))
    await peer.recv_status(180)
    await r.frontend.close(timeout_s=2.0)
    await peer.recv_status(503)
    (end,) = r.publisher.ends().values()
    assert end.extra["reason"] == "shutdown"
    peer.close()


async def test_delayed_offer_gets_our_offer_and_the_acks_answer_moves_the_media(rig: RigFactory) -> None:
    r = await rig()
    peer = await r.peer()
    peer.send(request("INVITE", via_host=f"127.0.0.1:{peer.port}"))
    ok = await peer.recv_status(200)
    offer = ok.split(b"\r\n\r\n", 1)[1].decode()
    (media,) = r.media.opened.values()
    assert media.plan is None  # nothing accepted before the answer
    assert f"m=audio {media.port} RTP/AVP 0 8 13 101" in offer and "a=recvonly" in offer
    answer = SDP_OFFER.replace("RTP/AVP 0 8 101", "RTP/AVP 8 101").replace("a=sendrecv", "a=sendonly")
    peer.send(request("ACK", via_host=f"127.0.0.1:{peer.port}", to_tag=to_tag_of(ok), body=answer))
    for _ in range(100):
        if media.updates:
            break
        await asyncio.sleep(0.01)
    (plan,) = media.updates
    assert plan.codec == "PCMA" and not plan.on_hold  # sendonly is the normal answer to our recvonly
    peer.send(request("BYE", via_host=f"127.0.0.1:{peer.port}", to_tag=to_tag_of(ok), cseq=2))
    await peer.recv_status(200)
    await r.settle()
    assert r.publisher.events[0].extra["codec"] == ""
    peer.close()


async def test_delayed_offer_whose_ack_has_no_answer_is_hung_up(rig: RigFactory) -> None:
    r = await rig()
    peer = await r.peer()
    peer.send(request("INVITE", via_host=f"127.0.0.1:{peer.port}"))
    ok = await peer.recv_status(200)
    peer.send(request("ACK", via_host=f"127.0.0.1:{peer.port}", to_tag=to_tag_of(ok)))
    bye = await peer.recv()
    while not bye.startswith(b"BYE "):
        bye = await peer.recv()
    assert header(bye, "Reason") == 'SIP;cause=200;text="error"'
    await r.settle()
    (end,) = r.publisher.ends().values()
    assert end.extra["reason"] == "error"
    peer.close()


async def test_a_failure_inside_the_call_core_answers_500_and_leaves_no_call(rig: RigFactory) -> None:
    r = await rig(codecs=("G729",))  # a configuration the negotiation rejects with an exception
    peer = await r.peer()
    peer.send(invite(via_host=f"127.0.0.1:{peer.port}"))
    await peer.recv_status(500)
    await r.settle()
    assert r.frontend.active_calls == 0 and r.publisher.events == []
    peer.close()
