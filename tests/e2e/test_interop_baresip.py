"""A softphone nobody here wrote (baresip, headless, `aufile` playing espeak-ng speech) calls
`ttg serve` running on uvloop, over UDP and over TCP: PCMA, RFC 4733 DTMF, a final transcript per
call, and the hang-up from either side (baresip's BYE; the gateway's BYE when it shuts down). Over UDP
the gateway asks for digest credentials. baresip 1.0 (libre 1.1) knows only MD5 and refuses a 401
that also offers SHA-256, whatever the order, so this gateway is set to challenge with MD5 alone
(TTG_SIP__DIGEST_ALGORITHMS, documented for such peers)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Serve
from tests.e2e.peers import Baresip, call_ended, speech_wav, the_call

pytestmark = [pytest.mark.redis, pytest.mark.slow]

DIGITS = "12#"


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Long enough to outlast the dialing, the key presses and the hang-up (aufile ends a call at EOF).
    return speech_wav(
        tmp_path_factory.mktemp("baresip-speech"),
        ["Thank you for calling, how can I help you today?", "I would like to check my balance."],
        tail_silence_s=6.0,
    )


PASSWORD = "s3cret-trunk"


@pytest.fixture
def baresip(tmp_path: Path, speech: Path) -> Iterator[Baresip]:
    phone = Baresip(tmp_path, speech, codecs="PCMA", password=PASSWORD)
    try:
        yield phone.start()
    finally:
        phone.stop()


async def call_with_digits(phone: Baresip, uri: str) -> None:
    await asyncio.to_thread(phone.command, "dial", uri)
    await asyncio.to_thread(phone.wait_event, "CALL_ESTABLISHED")
    await asyncio.sleep(1.0)  # some speech first
    for digit in DIGITS:
        await asyncio.to_thread(phone.command, "sndcode", digit)
        await asyncio.sleep(0.6)
    await asyncio.sleep(1.0)


async def test_baresip_over_udp_with_digest_auth_pcma_dtmf_and_its_own_hangup(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, baresip: Baresip
) -> None:
    auth = {
        "TTG_SIP__DIGEST_USER": "trunk",
        "TTG_SIP__DIGEST_PASSWORD": PASSWORD,
        "TTG_SIP__DIGEST_ALGORITHMS": '["MD5"]',
    }
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env=auth)
    await asyncio.to_thread(gw.start)
    assert "event loop uvloop" in gw.log()
    await call_with_digits(baresip, f"sip:1000@127.0.0.1:{gw.sip_port}")
    await asyncio.to_thread(baresip.command, "hangup")
    await asyncio.to_thread(baresip.wait_event, "CALL_CLOSED")
    await call_ended(redis_url, gw)
    start, events, end = the_call(redis_url)
    assert (start["codec"], start["transport"]) == ("PCMA", "udp")
    assert [e["text"] for e in events if e["type"] == "dtmf"] == list(DIGITS)
    assert any(e["type"] == "final" for e in events)
    assert (end["reason"], end["rtp_codec"], end["asr"]) == ("bye", "PCMA", "finished")
    assert int(end["rtp_packets"]) > 100 and end["rtp_invalid"] == "0"
    assert gw.metric("ttg_sip_responses_total", code="401") >= 1  # it was challenged, and answered
    assert gw.metric("ttg_sip_auth_failures_total") == 0


async def test_baresip_over_tcp_and_the_gateway_hangs_up_at_shutdown(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, baresip: Baresip
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env={"TTG_DAEMON__SHUTDOWN_GRACE_S": "0"})
    await asyncio.to_thread(gw.start)
    assert "event loop uvloop" in gw.log()
    await call_with_digits(baresip, f"sip:1000@127.0.0.1:{gw.sip_port};transport=tcp")
    gw.signal(signal.SIGTERM)  # no grace: the gateway sends BYE (Reason: shutdown) at once
    await asyncio.to_thread(baresip.wait_event, "CALL_CLOSED")
    assert await asyncio.to_thread(gw.wait, 60) == 0
    start, events, end = the_call(redis_url)
    assert (start["codec"], start["transport"]) == ("PCMA", "tcp")
    assert [e["text"] for e in events if e["type"] == "dtmf"] == list(DIGITS)
    assert any(e["type"] == "final" for e in events)
    assert (end["reason"], end["asr"]) == ("shutdown", "finished")
    assert "CALL_ESTABLISHED" in baresip.events
