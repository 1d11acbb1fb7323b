"""A second softphone nobody here wrote (linphone-daemon: liblinphone, belle-sip, mediastreamer2) calls
`ttg serve`: its offer leads with Opus and speex and lists telephone-event at 48, 16 and 8 kHz, it may
advertise an IPv6 media address while sending from 127.0.0.1, it answers a digest challenge with SHA-256,
presses RFC 4733 keys, and hangs up, or is hung up on at shutdown.

linphone also ends a call by itself when neither RTP nor RTCP arrives for its `nortp_timeout` (30 s by
default; here 10 s, above the reports' longest interval of 6.2 s). The gateway sends no RTP, so what
keeps such a call up is its RTCP receiver reports: each call here outlasts the timeout twice over."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Serve
from tests.e2e.peers import Linphone, call_ended, speech_wav, the_call

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PASSWORD = "s3cret-trunk"
NORTP_TIMEOUT_S = 10
DIGITS = "47"


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Silence well past every call's end: the daemon crashes when its player reaches the end of file.
    return speech_wav(
        tmp_path_factory.mktemp("linphone-speech"),
        ["Thank you for calling, how can I help you today?", "I would like to check my balance."],
        tail_silence_s=120.0,
    )


@pytest.fixture
def phone(tmp_path: Path, speech: Path) -> Iterator[Callable[..., Linphone]]:
    phones: list[Linphone] = []

    def start(transport: str, **kwargs: object) -> Linphone:
        p = Linphone(tmp_path, speech, nortp_timeout_s=NORTP_TIMEOUT_S, **kwargs)  # type: ignore[arg-type]
        phones.append(p)
        return p.start(transport)

    try:
        yield start
    finally:
        for p in phones:
            p.stop()


async def talk(phone: Linphone, uri: str, seconds: float) -> None:
    """Dial, press the keys, and stay on the line `seconds` from the answer, checking the call holds."""
    await asyncio.to_thread(phone.dial, uri)
    loop = asyncio.get_running_loop()
    up_at = loop.time()
    await asyncio.sleep(2.0)
    for digit in DIGITS:
        await asyncio.to_thread(phone.command, "dtmf", digit)
        await asyncio.sleep(0.5)
    while loop.time() - up_at < seconds:
        assert await asyncio.to_thread(phone.state) == "LinphoneCallStreamsRunning", phone.log_tail()
        await asyncio.sleep(1.0)


async def test_linphone_over_udp_with_sha256_digest_outlasts_its_no_rtp_timeout_and_hangs_up(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, phone: Callable[..., Linphone]
) -> None:
    auth = {
        "TTG_SIP__DIGEST_USER": "trunk",
        "TTG_SIP__DIGEST_PASSWORD": PASSWORD,
        "TTG_SIP__DIGEST_ALGORITHMS": '["SHA-256"]',
    }
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env=auth)
    await asyncio.to_thread(gw.start)
    linphone = phone("udp", password=PASSWORD, algorithm="SHA-256")
    await talk(linphone, f"sip:1000@127.0.0.1:{gw.sip_port}", 2 * NORTP_TIMEOUT_S)
    await asyncio.to_thread(linphone.command, "terminate")
    await asyncio.to_thread(linphone.wait_state, "")
    await call_ended(redis_url, gw)
    start, events, end = the_call(redis_url)
    assert (start["codec"], start["transport"]) == ("PCMU", "udp")
    assert [e["text"] for e in events if e["type"] == "dtmf"] == list(DIGITS)
    assert any(e["type"] == "final" for e in events)
    assert (end["reason"], end["asr"]) == ("bye", "finished")
    assert int(end["duration_ms"]) >= 2000 * NORTP_TIMEOUT_S
    assert int(end["rtp_packets"]) > 500 and end["rtp_invalid"] == "0"
    assert gw.metric("ttg_sip_responses_total", code="401") >= 1
    assert gw.metric("ttg_sip_auth_failures_total") == 0
    assert gw.metric("ttg_rtcp_reports_sent_total") >= 3
    assert "receiving RTCP RR" in linphone.log_path.read_text(errors="replace")  # read as reports


async def test_linphone_over_tcp_with_pcma_is_hung_up_at_shutdown(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, phone: Callable[..., Linphone]
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env={"TTG_DAEMON__SHUTDOWN_GRACE_S": "0"})
    await asyncio.to_thread(gw.start)
    linphone = phone("tcp")
    await asyncio.to_thread(linphone.command, "audio-codec-disable", "0")  # PCMU off: PCMA it is
    await talk(linphone, f"sip:1000@127.0.0.1:{gw.sip_port};transport=tcp", NORTP_TIMEOUT_S + 4)
    gw.signal(signal.SIGTERM)  # no grace: the gateway sends BYE (Reason: shutdown) at once
    await asyncio.to_thread(linphone.wait_state, "")
    assert await asyncio.to_thread(gw.wait, 60) == 0
    start, events, end = the_call(redis_url)
    assert (start["codec"], start["transport"]) == ("PCMA", "tcp")
    assert [e["text"] for e in events if e["type"] == "dtmf"] == list(DIGITS)
    assert any(e["type"] == "final" for e in events)
    assert (end["reason"], end["asr"], end["rtp_codec"]) == ("shutdown", "finished", "PCMA")
