"""The replay UAC against a real peer: sipp as the UAS on loopback (built-in `uas` scenario with RTP
echo, and small scenarios that reject, or answer PCMA over TCP). sipp's exit status says whether every
call went through its scenario, i.e. whether our INVITE/ACK/BYE were what a UAS expects."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.replay import SippUas, write_burst_wav
from tools.replay import LoadConfig, MediaConfig, ReplayConfig, run_replay_async
from tools.replay.audio import load_library

pytestmark = pytest.mark.sipp

REJECT = """<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="reject">
  <recv request="INVITE" crlf="true"/>
  <send><![CDATA[

SIP/2.0 {code} {reason}
[last_Via:]
[last_From:]
[last_To:];tag=[pid]SIPpTag01[call_number]
[last_Call-ID:]
[last_CSeq:]
{extra}Content-Length: 0

  ]]></send>
  <recv request="ACK"/>
</scenario>
"""

PCMA_UAS = """<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="uas pcma">
  <recv request="INVITE" crlf="true"/>
  <send><![CDATA[

SIP/2.0 100 Trying
[last_Via:]
[last_From:]
[last_To:]
[last_Call-ID:]
[last_CSeq:]
Content-Length: 0

  ]]></send>
  <send><![CDATA[

SIP/2.0 200 OK
[last_Via:]
[last_From:]
[last_To:];tag=[pid]SIPpTag01[call_number]
[last_Call-ID:]
[last_CSeq:]
Contact: <sip:[local_ip]:[local_port];transport=[transport]>
Content-Type: application/sdp
Content-Length: [len]

v=0
o=uas 1 1 IN IP[local_ip_type] [local_ip]
s=-
c=IN IP[media_ip_type] [media_ip]
t=0 0
m=audio [media_port] RTP/AVP 8
a=rtpmap:8 PCMA/8000
a=ptime:20

  ]]></send>
  <recv request="ACK" crlf="true"/>
  <recv request="BYE"/>
  <send><![CDATA[

SIP/2.0 200 OK
[last_Via:]
[last_From:]
[last_To:]
[last_Call-ID:]
[last_CSeq:]
Content-Length: 0

  ]]></send>
</scenario>
"""


@pytest.fixture
def audio_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "audio"
    folder.mkdir()
    write_burst_wav(folder / "a.wav", [(200, 900), (1600, 2200)], 2400, "one two")
    return folder


def echoed_all_but_the_hangup_race(echoed: int, sent: int) -> bool:
    """sipp -rtp_echo sent back every packet, except perhaps the last one or two: the BYE follows the
    last packet at once, and sipp may end the call before its echo thread has read it (seen once in CI:
    139 of 140 on a loaded machine)."""
    return sent - 2 <= echoed <= sent


def config(uas: SippUas, audio_dir: Path, calls: int, **kw: object) -> ReplayConfig:
    return ReplayConfig(
        target=("127.0.0.1", uas.port),
        audio_dir=audio_dir,
        media=MediaConfig(lead_ms=100, tail_ms=300),
        load=LoadConfig(calls=calls, cps=50),
        redis_url=None,
        metrics_url=None,
        **kw,  # type: ignore[arg-type]
    )


async def test_calls_are_set_up_paced_and_torn_down_against_sipp_uas(
    sipp_uas: Callable[..., SippUas], audio_dir: Path
) -> None:
    uas = sipp_uas(calls=3)
    library = load_library(audio_dir, 600)
    rep = await run_replay_async(config(uas, audio_dir, 3), library)
    assert uas.wait() == 0, uas.errors()  # sipp saw 3 complete INVITE/ACK/BYE dialogs
    s = rep.summary
    assert (s.calls, s.completed, s.failed, s.rejected, s.peak_active_calls) == (3, 3, 0, 0, 3)
    expected_packets = (100 + 2400 + 300) // 20
    for c in rep.calls:
        assert c.codec == "PCMU" and c.ptime_ms == 20 and c.setup_s is not None and c.setup_s > 0
        assert c.rtp_planned == c.rtp_sent == expected_packets  # every packet of the plan left
        assert echoed_all_but_the_hangup_race(c.rtp_echoed, c.rtp_sent)  # ...and sipp echoed them
        assert c.rtp_send_errors == 0 and len(c.utterances) == 2
    assert len({c.sip_call_id for c in rep.calls}) == 3
    assert rep.harness.packets_sent == 3 * expected_packets and rep.harness.sip_parse_errors == 0
    assert rep.harness.send_lateness_ms.n == 3 * expected_packets


@pytest.mark.parametrize(
    ("code", "reason", "extra", "retry_after"),
    [
        (503, "Service Unavailable", "Retry-After: 7\n", 7.0),
        (403, "Forbidden", "", None),
        (488, "Not Acceptable Here", "", None),
    ],
)
async def test_rejected_calls_are_counted_by_status_and_acked(
    sipp_uas: Callable[..., SippUas],
    audio_dir: Path,
    code: int,
    reason: str,
    extra: str,
    retry_after: float | None,
) -> None:
    uas = sipp_uas(calls=2, scenario_xml=REJECT.format(code=code, reason=reason, extra=extra), rtp_echo=False)
    rep = await run_replay_async(config(uas, audio_dir, 2), load_library(audio_dir, 600))
    assert uas.wait() == 0, uas.errors()  # sipp got the ACK for each rejection
    s = rep.summary
    assert (s.calls, s.completed, s.rejected, s.failed) == (2, 0, 2, 0)
    assert s.rejected_by_status == {str(code): 2} and s.max_retry_after_s == retry_after
    assert all(c.status == code and c.rtp_sent == 0 for c in rep.calls)
    assert not rep.ok


async def test_a_pcma_answer_over_tcp_gets_pcma_packets(
    sipp_uas: Callable[..., SippUas], audio_dir: Path
) -> None:
    uas = sipp_uas(calls=2, scenario_xml=PCMA_UAS, transport="tcp")
    rep = await run_replay_async(config(uas, audio_dir, 2, transport="tcp"), load_library(audio_dir, 600))
    assert uas.wait() == 0, uas.errors()
    assert rep.summary.completed == 2
    assert all(c.codec == "PCMA" and c.rtp_sent == c.rtp_planned for c in rep.calls)
    assert all(echoed_all_but_the_hangup_race(c.rtp_echoed, c.rtp_sent) for c in rep.calls)
    assert all(c.invite_retransmits == 0 for c in rep.calls)  # TCP: no retransmissions


async def test_nothing_listening_at_the_target_fails_the_calls_with_timer_b(audio_dir: Path) -> None:
    from tools.ports import free_port

    cfg = ReplayConfig(
        target=("127.0.0.1", free_port()),
        audio_dir=audio_dir,
        load=LoadConfig(calls=1),
        redis_url=None,
        metrics_url=None,
        t1_s=0.02,  # Timer B = 64·T1 = 1.28 s
    )
    rep = await run_replay_async(cfg, load_library(audio_dir, 600))
    [c] = rep.calls
    assert c.outcome == "failed" and "Timer B" in c.detail and c.invite_retransmits >= 5
