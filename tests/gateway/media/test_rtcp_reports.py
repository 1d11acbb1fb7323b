"""RTCP receiver reports (RFC 3550 §6.4.2): what the media core sends its peer, when and where.

The gateway never sends RTP, so these reports are all a peer hears from it; linphone hangs up a call
after its `nortp_timeout` without them (tests/e2e/test_interop_linphone.py)."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import replace

import pytest

from gateway.rtp.media import MediaConfig, MediaCore, RtcpReport
from gateway.rtp.packet import RTCP_BYE, RTCP_RR, RTCP_SDES, RTCP_SR, parse_rtcp
from gateway.rtp.rtcp import MIN_INTERVAL_S, Reception, compound, report_interval
from gateway.rtp.sender import Impairments, RtpSender
from tests.gateway.media.helpers import PLAN_PCMU, SRC, Driver, speech_like

PEER_SSRC = 0xCAFE0001


def reports(driver: Driver) -> list[RtcpReport]:
    return [e for e in driver.events if isinstance(e, RtcpReport)]


def report_block(data: bytes) -> dict[str, int]:
    """The first report block of an RR, by field."""
    b0, pt, _, _ = struct.unpack_from("!BBHI", data)
    assert pt == RTCP_RR and b0 & 0x1F == 1, "one report block"
    ssrc, lost, highest, jitter, lsr, dlsr = struct.unpack_from("!IIIIII", data, 8)
    cumulative = lost & 0xFFFFFF
    return {
        "ssrc": ssrc,
        "fraction": lost >> 24,
        "cumulative": cumulative - (1 << 24) if cumulative & 0x800000 else cumulative,
        "highest": highest,
        "jitter": jitter,
        "lsr": lsr,
        "dlsr": dlsr,
    }


def stream(seconds: float, *, loss: set[int] | None = None, seq: int = 1000) -> Driver:
    """A PCMU stream of `seconds` from SRC, with the packets of `loss` lost; reports every 2–6 s."""
    driver = Driver(config=MediaConfig(idle_fill_after_s=0.0))
    driver.core = MediaCore(PLAN_PCMU, driver.config, 0.0, random.Random(7))
    sender = RtpSender("PCMU", ssrc=PEER_SSRC, seq=seq).audio(speech_like(int(8000 * seconds)))
    driver.play(Impairments.of(loss=loss or ()).apply(sender.packets))
    return driver


def sender_report(ntp: int, ssrc: int = PEER_SSRC) -> bytes:
    """An SR without report blocks: its sender info carries the 64-bit NTP timestamp."""
    return struct.pack("!BBHIIIIII", 0x80, RTCP_SR, 6, ssrc, ntp >> 32, ntp & 0xFFFFFFFF, 0, 0, 0)


def test_a_report_is_a_valid_compound_packet_rr_then_sdes_cname_and_at_the_end_bye() -> None:
    rec = Reception(PEER_SSRC, base=100, received=100)
    block = rec.block(highest=199, jitter=12.7, lsr=0, dlsr=0)
    for bye, types in ((None, (RTCP_RR, RTCP_SDES)), (b"call ended", (RTCP_RR, RTCP_SDES, RTCP_BYE))):
        data = compound(0x1234, b"cname-xyz", (block,), bye)
        info = parse_rtcp(data)  # App. A.2's validity checks: lengths, version, padding
        assert info.packet_types == types and info.sender_ssrc == 0x1234
        assert len(data) % 4 == 0
        assert b"cname-xyz" in data and (bye is None or b"call ended" in data)
    assert parse_rtcp(compound(0x1234, b"c")).packet_types == (RTCP_RR, RTCP_SDES)  # no source heard yet


def test_the_report_block_counts_loss_per_interval_and_in_total_as_appendix_a3() -> None:
    rec = Reception(PEER_SSRC, base=65530, received=90)
    highest = 65530 + 99  # seq wraps: cycles in the top
    first = report_block(compound(1, b"c", (rec.block(highest, 0.0, 0, 0),)))
    assert (first["cumulative"], first["fraction"], first["highest"]) == (10, 25, 65530 + 99)  # 10 of 100
    highest += 100
    rec.received += 100  # the next 100 all came
    second = report_block(compound(1, b"c", (rec.block(highest, 0.0, 0, 0),)))
    assert (second["cumulative"], second["fraction"]) == (10, 0)
    rec.received += 5  # duplicates count as received (A.3): the total falls, no fraction is lost
    third = report_block(compound(1, b"c", (rec.block(highest, 0.0, 0, 0),)))
    assert (third["cumulative"], third["fraction"]) == (5, 0)
    rec.received += 20
    assert report_block(compound(1, b"c", (rec.block(highest, 0.0, 0, 0),)))["cumulative"] == -15


def test_intervals_are_randomized_around_the_five_second_minimum_the_first_halved() -> None:
    rng = random.Random(3)
    first = [report_interval(rng, initial=True) for _ in range(500)]
    later = [report_interval(rng, initial=False) for _ in range(500)]
    low, high = 0.5 / (math.e - 1.5), 1.5 / (math.e - 1.5)
    assert MIN_INTERVAL_S / 2 * low <= min(first) and max(first) <= MIN_INTERVAL_S / 2 * high
    assert MIN_INTERVAL_S * low <= min(later) and max(later) <= MIN_INTERVAL_S * high
    assert max(later) - min(later) > 3.0  # randomized (§6.3.1: no synchronized reports)


def test_nothing_is_sent_before_the_peer_is_heard_and_nothing_with_reports_off() -> None:
    silent = Driver()
    silent.run_until(40.0)
    assert reports(silent) == []
    off = Driver(config=MediaConfig(rtcp_reports=False, idle_fill_after_s=0.0))
    off.play(RtpSender("PCMU", ssrc=PEER_SSRC).audio(speech_like(8000 * 20)).packets)
    off.close()
    assert reports(off) == [] and off.core.goodbye(off.now) is None


def test_reports_reach_the_latched_host_at_its_sdp_rtcp_port_every_few_seconds_with_the_loss() -> None:
    driver = stream(30.0, loss={50, 51, 52, 53, 54})
    sent = reports(driver)
    assert 5 <= len(sent) <= 14  # 30 s at 2–6 s a report
    assert {(r.addr, r.rtp_port) for r in sent} == {((SRC[0], PLAN_PCMU.remote_rtcp_port), False)}
    blocks = [report_block(r.data) for r in sent]
    assert {b["ssrc"] for b in blocks} == {PEER_SSRC}
    assert blocks[-1]["cumulative"] == 5 and sum(b["fraction"] for b in blocks) > 0
    assert [b["highest"] for b in blocks] == sorted(b["highest"] for b in blocks)
    assert driver.core.stats().rtcp_reports_sent == len(sent)


def test_with_rtcp_mux_reports_go_to_the_latched_rtp_address_from_our_rtp_port() -> None:
    driver = Driver(plan=replace(PLAN_PCMU, rtcp_mux=True, remote_rtcp_port=PLAN_PCMU.remote_port))
    driver.play(RtpSender("PCMU", ssrc=PEER_SSRC).audio(speech_like(8000 * 10)).packets)
    assert {(r.addr, r.rtp_port) for r in reports(driver)} == {(SRC, True)}


def test_reports_follow_the_peers_own_rtcp_and_take_its_sender_report_for_lsr_and_dlsr() -> None:
    driver = stream(3.0)
    natted = (SRC[0], 50123)  # the peer's RTCP comes from another port (a NAT): symmetric RTCP
    ntp = 0x1122334455667788
    driver.events += driver.core.rtcp_datagram(sender_report(ntp), natted, driver.now)
    heard_at = driver.now
    driver.run_until(heard_at + 7.0)
    later = [r for r in reports(driver) if r.addr == natted]
    assert later and all(not r.rtp_port for r in later)
    block = report_block(later[0].data)
    assert block["lsr"] == 0x33445566  # the middle 32 bits of the NTP timestamp
    delay = block["dlsr"] / 65536
    assert 0 < delay <= 7.0
    # RTCP from a host that is not the latched one neither moves the reports nor feeds LSR.
    driver.events += driver.core.rtcp_datagram(sender_report(0x99 << 40), ("198.51.100.9", 9), driver.now)
    so_far = len(reports(driver))
    driver.run_until(driver.now + 7.0)
    assert {r.addr for r in reports(driver)[so_far:]} == {natted}
    assert report_block(reports(driver)[-1].data)["lsr"] == 0x33445566


def test_a_stream_that_reported_says_goodbye_and_one_that_did_not_stays_silent() -> None:
    driver = stream(10.0)
    bye = driver.core.goodbye(driver.now)
    assert bye is not None and parse_rtcp(bye.data).packet_types == (RTCP_RR, RTCP_SDES, RTCP_BYE)
    assert bye.addr == (SRC[0], PLAN_PCMU.remote_rtcp_port)
    driver.close()
    assert driver.core.next_deadline() is None
    brief = stream(0.5)  # closed before its first report was due
    assert reports(brief) == [] and brief.core.goodbye(brief.now) is None


def test_reports_go_on_while_the_call_is_on_hold_and_stop_when_a_reinvite_moves_the_peer() -> None:
    driver = stream(4.0)
    driver.events += driver.core.rtcp_datagram(sender_report(1 << 40), (SRC[0], SRC[1] + 1), driver.now)
    driver.events += driver.core.update(replace(PLAN_PCMU, direction="sendonly", on_hold=True), driver.now)
    held_from = len(reports(driver))
    driver.run_until(driver.now + 20.0)
    assert len(reports(driver)) - held_from >= 3  # RFC 3264 §5.1: RTCP flows on hold
    moved = replace(PLAN_PCMU, remote_host="203.0.113.5", remote_port=30000, remote_rtcp_port=30001)
    driver.events += driver.core.update(moved, driver.now)
    before = len(reports(driver))
    driver.run_until(driver.now + 20.0)
    assert len(reports(driver)) == before  # none until the new address is heard (not to its old RTCP)
    first = RtpSender("PCMU", ssrc=7).audio(speech_like(160)).packets[0]
    driver.send(first.data, driver.now, ("203.0.113.5", 30000))
    driver.run_until(driver.now + 7.0)
    assert reports(driver)[-1].addr == ("203.0.113.5", 30001)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_sender_ssrc_and_cname_are_random_per_stream(seed: int) -> None:
    a = MediaCore(PLAN_PCMU, MediaConfig(), 0.0, random.Random(seed))
    b = MediaCore(PLAN_PCMU, MediaConfig(), 0.0, random.Random(seed + 10))
    for core in (a, b):
        core.datagram(RtpSender("PCMU", ssrc=PEER_SSRC).audio(speech_like(160)).packets[0].data, SRC, 0.0)
    ra = a.handle_timer(10.0)
    rb = b.handle_timer(10.0)
    (pa,) = [e for e in ra if isinstance(e, RtcpReport)]
    (pb,) = [e for e in rb if isinstance(e, RtcpReport)]
    assert parse_rtcp(pa.data).sender_ssrc != parse_rtcp(pb.data).sender_ssrc
    assert pa.data[-20:] != pb.data[-20:]  # the CNAMEs differ
