"""The per-call media core on a fake clock: every receiver rule of gateway/rtp/media.py."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from gateway.audio import g711
from gateway.audio.resample import UpsampleBatch
from gateway.rtp.dtmf import TelephoneEvent
from gateway.rtp.media import AudioBlock, DtmfDigit, MediaConfig, MediaEvent, MediaTimeout
from gateway.rtp.packet import RtpPacket, parse_rtp
from gateway.rtp.sender import Impairments, RtpSender
from tests.gateway.media.helpers import (
    PLAN_PCMA,
    PLAN_PCMU,
    SRC,
    Driver,
    assert_audio_matches,
    oracle,
    read_pcap_rtp,
    speech_like,
    upsample,
)

NO_IDLE = MediaConfig(idle_fill_after_s=0.0)


def test_a_clean_stream_comes_out_sample_exact_in_fixed_blocks() -> None:
    sender = RtpSender(seq=1000, timestamp=5000, ssrc=1).audio(speech_like(8000))
    d = Driver()
    d.play(sender.packets)
    d.close(sender.packets[-1].at + 0.1)  # before idle fill would add silence
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)
    assert [b.start_ms for b in d.blocks] == [80 * k for k in range(len(d.blocks))]
    stats = d.core.stats()
    assert (stats.packets_received, stats.lost, stats.late, stats.duplicate, stats.invalid) == (
        50,
        0,
        0,
        0,
        0,
    )
    assert stats.audio_ms == 1000 and stats.concealed_ms == 0 and stats.source == "192.0.2.7:40000"


def test_the_acceptance_scenario_timeline_dtmf_and_counters_are_exact() -> None:
    """Loss, reordering, duplicates, seq and timestamp wrap, CN, DTX, DTMF, an SSRC change."""
    pcm = speech_like(16000, seed=3)
    sender = RtpSender("PCMU", ssrc=0xA, seq=65500, timestamp=2**32 - 4000)
    sender.audio(pcm[:9600]).silence(400, comfort_noise=True).audio(pcm[9600:12800])
    sender.dtmf("5", 200).audio(pcm[12800:16000])
    sender.change_ssrc(0xB, seq=1000, timestamp=123456).audio(pcm[:4800]).dtmf("#", 120).audio(pcm[4800:6400])
    net = Impairments.of(loss={10, 11, 45}, duplicate={20, 21}, delay={30: 0.03, 70: 0.035})
    wire = net.apply(sender.packets)
    d = Driver(config=NO_IDLE)
    d.play(wire)
    d.close(wire[-1].at + 1.0)

    expected = oracle(wire)
    assert_audio_matches(d.audio, expected.pcm8k)
    assert d.digits == expected.digits
    assert [digit for digit, _, _ in d.digits] == ["5", "#"]
    assert [n for _, _, n in d.digits] == [200, 120]
    stats = d.core.stats()
    assert (stats.lost, stats.late, stats.duplicate, stats.ssrc_changes, stats.dtmf_events) == (3, 0, 2, 1, 2)
    assert stats.packets_received == len(wire) and stats.invalid == 0
    assert d.core.cn_level == 60


def test_a_packet_later_than_the_playout_delay_is_counted_late_and_concealed() -> None:
    sender = RtpSender(seq=10, timestamp=0, ssrc=1).audio(speech_like(4000))
    wire = Impairments.of(delay={7: 0.2}).apply(sender.packets)
    d = Driver(config=NO_IDLE)
    d.play(wire)
    d.close(2.0)
    stats = d.core.stats()
    assert (stats.late, stats.lost) == (1, 0)  # it did arrive, after its audio was concealed
    concealed = [p for p in wire if p.index != 7]
    assert_audio_matches(d.audio, oracle(concealed).pcm8k)


def test_reordering_at_the_very_start_loses_nothing() -> None:
    sender = RtpSender(seq=10, timestamp=0, ssrc=1).audio(speech_like(1600))
    wire = Impairments.of(delay={0: 0.03}).apply(sender.packets)
    assert wire[0].index == 1
    d = Driver(config=NO_IDLE)
    d.play(wire)
    d.close(1.0)
    assert d.core.stats().lost == 0
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_dtmf_end_packets_sent_three_times_make_one_event_and_no_duplicates() -> None:
    for same_seq in (True, False):
        sender = (
            RtpSender(seq=1, timestamp=0, ssrc=1)
            .audio(speech_like(800))
            .dtmf("9", 160, repeat_same_seq=same_seq)
        )
        sender.audio(speech_like(800))
        d = Driver(config=NO_IDLE)
        d.play(sender.packets)
        d.close(1.0)
        assert d.digits == [("9", 100, 160)]
        assert d.core.stats().duplicate == 0
        assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)  # the 160 ms are silence


def test_a_dtmf_event_whose_end_packets_are_all_lost_is_reported_once_by_timeout() -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).dtmf("7", 200, drop_end=True)
    d = Driver(config=NO_IDLE)
    d.play(sender.packets)
    last = sender.packets[-1].at
    d.run_until(last + 0.29)
    assert d.digits == []
    d.run_until(last + 0.31)
    assert d.digits == [("7", 100, 180)]  # the last duration heard
    d.close(last + 2)
    assert len(d.digits) == 1


def test_a_key_press_at_the_end_of_the_call_is_covered_by_the_timeline() -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).dtmf("1", 240)
    d = Driver(config=NO_IDLE)
    d.play(sender.packets)
    d.close(2.0)
    assert d.digits == [("1", 100, 240)]
    assert len(d.audio) == 2 * (800 + 240 * 8)


def test_a_timestamp_jump_is_filled_but_capped_at_max_gap() -> None:
    config = replace(NO_IDLE, max_gap_ms=1000)
    sender = (
        RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).silence(3000).audio(speech_like(800, 1))
    )
    d = Driver(config=config)
    d.play(sender.packets)
    d.close(5.0)
    assert len(d.audio) == 2 * (800 + 8000 + 800)
    assert d.core.stats().timeline_adjustments == 1
    assert d.core.stats().concealed_ms == 1000


def test_idle_fill_feeds_silence_in_real_time_during_dtx_and_keeps_the_timeline_exact() -> None:
    sender = (
        RtpSender(seq=1, timestamp=0, ssrc=1)
        .audio(speech_like(1600))
        .silence(2000)
        .audio(speech_like(1600, 1))
    )
    d = Driver()  # idle fill after 0.5 s
    first_part = [p for p in sender.packets if p.at < 1.0]
    d.play(first_part)
    d.run_until(2.19)  # still in the pause (it ends at 2.2 s)
    filled_ms = d.blocks[-1].start_ms + 80
    assert filled_ms >= 1500  # the last packet arrived at 0.18 s: silence keeps pace 0.5 s behind
    d.play([p for p in sender.packets if p.at >= 1.0])
    d.close()
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)
    assert d.core.stats().timeline_adjustments == 0


def test_idle_fill_overshoot_re_anchors_so_no_audio_is_dropped() -> None:
    # This sender does not advance its timestamps during the pause (some do not): 2 s of wall time,
    # 0 ms of timestamps. Idle fill has already emitted ~1.5 s when audio resumes.
    second = RtpSender(seq=51, timestamp=8000, ssrc=1).audio(speech_like(1600, 1))
    first = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(8000))
    d = Driver()
    d.play(first.packets)
    d.play(second.packets, start=3.0)  # resumes at t = 3 s
    d.close()
    audio = d.audio
    stats = d.core.stats()
    assert stats.timeline_adjustments == 1 and stats.lost == 0
    # Both talk spurts are complete; the pause between them is what idle fill emitted.
    gap = len(audio) // 2 - 8000 - 1600
    assert 1.3 * 8000 <= gap <= 1.6 * 8000
    head = upsample(oracle(first.packets).pcm8k)[:15000]  # away from the resampler's edge
    assert np.abs(audio[:15000] - head).max() < 1e-5


def test_no_idle_fill_while_on_hold() -> None:
    d = Driver(plan=replace(PLAN_PCMU, direction="sendonly", on_hold=True))
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).packets)
    d.run_until(10.0)
    assert d.core.timeline_samples == 800


def test_inactivity_fires_once_after_the_timeout() -> None:
    d = Driver(config=MediaConfig(inactivity_timeout_s=30.0))
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).packets)
    d.run_until(30.05)
    assert d.timeouts == []
    d.run_until(30.2)
    assert len(d.timeouts) == 1 and not d.timeouts[0].on_hold
    d.run_until(100.0)
    assert len(d.timeouts) == 1 and d.core.stats().timed_out


def test_inactivity_counts_from_open_when_no_rtp_ever_arrives() -> None:
    d = Driver(config=MediaConfig(inactivity_timeout_s=5.0))
    d.run_until(5.0)
    assert len(d.timeouts) == 1


def test_on_hold_the_hold_timeout_applies_and_zero_disables_it() -> None:
    held = replace(PLAN_PCMU, direction="inactive", on_hold=True)
    d = Driver(plan=held, config=MediaConfig(inactivity_timeout_s=5.0, hold_timeout_s=60.0))
    d.run_until(59.0)
    assert d.timeouts == []
    d.run_until(60.0)
    assert len(d.timeouts) == 1 and d.timeouts[0].on_hold
    forever = Driver(plan=held, config=MediaConfig(inactivity_timeout_s=5.0, hold_timeout_s=0.0))
    forever.run_until(10_000.0)
    assert forever.timeouts == [] and forever.core.next_deadline() is None


def test_a_reinvite_restarts_the_inactivity_clock_and_resume_rearms_the_normal_timeout() -> None:
    d = Driver(
        plan=replace(PLAN_PCMU, direction="sendonly", on_hold=True),
        config=MediaConfig(inactivity_timeout_s=5.0),
    )
    d.run_until(100.0)
    assert d.timeouts == []
    d.events += d.core.update(PLAN_PCMU, d.now)  # resume
    d.run_until(104.9)
    assert d.timeouts == []
    d.run_until(105.0)
    assert len(d.timeouts) == 1


def test_packets_from_another_source_are_dropped_while_the_latched_one_talks() -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(1600))
    intruder = RtpSender(seq=500, timestamp=99, ssrc=2).audio(speech_like(160, 9)).packets[0]
    d = Driver(config=NO_IDLE)
    d.play(sender.packets[:5])
    d.send(intruder.data, 0.09, addr=("198.51.100.66", 5000))
    d.play(sender.packets[5:])
    d.close(1.0)
    stats = d.core.stats()
    assert stats.invalid_reasons == {"wrong_source": 1} and stats.ssrc_changes == 0
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_the_same_stream_from_a_new_address_after_relatch_after_moves_the_latch() -> None:
    """A NAT rebinding: the sender keeps its SSRC and sequence; only its public port changed."""
    d = Driver(config=replace(NO_IDLE, relatch_after_s=2.0))
    a = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800))
    d.play(a.packets)
    b = RtpSender(seq=6, timestamp=800, ssrc=1).audio(speech_like(800))
    new = ("192.0.2.99", 41000)
    d.send(b.packets[0].data, 1.0, addr=new)  # 0.9 s after the last packet: too soon
    assert d.core.latched == SRC
    d.play(b.packets[1:], start=2.2, addr=new)
    assert d.core.latched == new
    assert d.core.stats().invalid_reasons == {"wrong_source": 1}


def test_a_hijacker_with_a_new_ssrc_does_not_take_over_a_silent_call() -> None:
    d = Driver(config=replace(NO_IDLE, relatch_after_s=2.0))
    caller = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800))
    d.play(caller.packets)
    hijacker = RtpSender(seq=7, timestamp=960, ssrc=0x666).audio(speech_like(4000, 9))
    evil = ("198.51.100.66", 5000)
    d.play(hijacker.packets, start=10.0, addr=evil)  # long after the caller went quiet (DTX, hold)
    assert d.core.latched == SRC
    assert d.core.stats().invalid_reasons == {"wrong_source": len(hijacker.packets)}
    # The caller's own stream is still taken when it speaks again, from where it was.
    d.play(RtpSender(seq=6, timestamp=800, ssrc=1).audio(speech_like(800)).packets, start=11.0)
    assert d.core.stats().packets_received == 2 * len(caller.packets)


def test_the_current_ssrc_with_a_sequence_that_does_not_continue_does_not_move_the_latch() -> None:
    d = Driver(config=replace(NO_IDLE, relatch_after_s=2.0))
    d.play(RtpSender(seq=100, timestamp=0, ssrc=1).audio(speech_like(800)).packets)  # seq 100-104
    evil = ("198.51.100.66", 5000)
    replayed = RtpSender(seq=100, timestamp=0, ssrc=1).audio(speech_like(800))  # old packets again
    far = RtpSender(seq=104 + 3000, timestamp=0, ssrc=1).audio(speech_like(800))  # a guessed jump
    d.play(replayed.packets, start=5.0, addr=evil)
    d.play(far.packets, start=6.0, addr=evil)
    assert d.core.latched == SRC
    assert d.core.stats().invalid_reasons == {"wrong_source": 10}


def test_relatch_zero_means_only_a_reinvite_moves_the_latch() -> None:
    d = Driver(config=replace(NO_IDLE, relatch_after_s=0.0))
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).packets)
    new = ("192.0.2.99", 41000)
    later = RtpSender(seq=6, timestamp=800, ssrc=1).audio(speech_like(800))
    d.play(later.packets[:2], start=100.0, addr=new)
    assert d.core.latched == SRC and d.core.stats().invalid_reasons == {"wrong_source": 2}
    d.events += d.core.update(replace(PLAN_PCMU, remote_host="192.0.2.99", remote_port=41000), d.now)
    d.play(later.packets[2:], start=100.0, addr=new)
    assert d.core.latched == new


def test_junk_is_counted_by_reason_and_does_not_touch_the_call() -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(1600))
    junk = [
        b"",
        b"\x80",
        b"GET / HTTP/1.1\r\n\r\n",
        bytes(12),  # version 0
        RtpPacket(96, 1, 0, 1, b"\x00" * 160).serialize(),  # payload type not negotiated
        b"\x80\xc8\x00\x01" + bytes(4),  # RTCP SR too short for its sender info
        b"\x82" + bytes(11),  # CSRC count past the end
    ]
    d = Driver(config=NO_IDLE)
    for i, p in enumerate(sender.packets):
        d.send(p.data, p.at)
        if i < len(junk):
            d.send(junk[i], p.at + 0.001)
    d.close(1.0)
    stats = d.core.stats()
    assert stats.invalid == len(junk)
    assert stats.invalid_reasons == {
        "too_short": 2,
        "bad_version": 2,
        "truncated": 1,
        "unknown_pt": 1,
        "bad_rtcp": 1,
    }
    assert stats.packets_received == len(sender.packets) and stats.lost == 0
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_stun_keepalives_and_rtcp_app_packets_are_not_invalid_rtp() -> None:
    """linphone sends STUN binding requests, baresip RTCP APP packets (rtcp-mux) on the RTP port."""
    stun = struct.pack("!HHI12s", 0x0001, 0, 0x2112A442, b"k" * 12)
    app = struct.pack("!BBHI4s", 0x80, 204, 2, 1, b"PING")
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(1600))
    d = Driver(config=NO_IDLE)
    for i, p in enumerate(sender.packets):
        d.send(p.data, p.at)
        d.send(stun if i % 2 else app, p.at + 0.001)
    d.close(1.0)
    stats = d.core.stats()
    assert stats.invalid == 0 and stats.invalid_reasons == {}
    assert d.core.keepalives == len(sender.packets) // 2 and stats.rtcp_packets == len(sender.packets) // 2
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_stun_keepalives_from_the_latched_host_keep_a_silent_call_alive() -> None:
    stun = struct.pack("!HHI12s", 0x0001, 0, 0x2112A442, b"k" * 12)
    d = Driver(config=MediaConfig(inactivity_timeout_s=5.0, idle_fill_after_s=0.0))
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(160)).packets)
    for t in range(3, 20, 3):
        d.send(stun, float(t))  # DTX: no RTP, only keep-alives every 3 s
    assert d.timeouts == []
    d.run_until(40.0)
    assert len(d.timeouts) == 1  # keep-alives stopped at 18 s: the timeout applies again


def test_valid_rtcp_on_either_port_is_accepted_and_counts_as_liveness() -> None:
    rr = struct.pack("!BBHI", 0x80, 201, 1, 7)
    d = Driver(config=MediaConfig(inactivity_timeout_s=5.0))
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(160)).packets)
    for t in range(4, 20, 4):
        d.run_until(float(t))
        d.events += d.core.rtcp_datagram(rr, (SRC[0], SRC[1] + 1), d.now)
        d.events += d.core.datagram(rr, SRC, d.now)  # rtcp-mux
    assert d.timeouts == [] and d.core.stats().rtcp_packets == 8


def test_a_sequence_jump_within_one_ssrc_resyncs_after_two_sequential_packets() -> None:
    pcm = speech_like(3200)
    sender = RtpSender(seq=100, timestamp=0, ssrc=1).audio(pcm[:1600]).jump_sequence(20000).audio(pcm[1600:])
    d = Driver(config=NO_IDLE)
    d.play(sender.packets)
    d.close(2.0)
    stats = d.core.stats()
    assert (stats.seq_restarts, stats.lost, stats.ssrc_changes, stats.invalid) == (1, 0, 0, 0)
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_a_single_stray_sequence_number_is_dropped_as_a_jump() -> None:
    sender = RtpSender(seq=100, timestamp=0, ssrc=1).audio(speech_like(1600))
    stray = RtpPacket(0, 40000, 800, 1, b"\x00" * 160).serialize()
    d = Driver(config=NO_IDLE)
    d.play(sender.packets[:5])
    d.send(stray, 0.085)
    d.play(sender.packets[5:])
    d.close(1.0)
    assert d.core.stats().invalid_reasons == {"seq_jump": 1}
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_a_new_ssrc_takes_over_after_two_in_sequence_so_reordering_across_the_switch_loses_nothing() -> None:
    a = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(1600))
    a.change_ssrc(2, seq=7000, timestamp=777).audio(speech_like(1600, 1))
    wire = Impairments.of(delay={9: 0.03}).apply(a.packets)  # A's last packet arrives after B's first
    assert [p.ssrc for p in wire[8:12]] == [1, 2, 1, 2]
    d = Driver(config=NO_IDLE)
    d.play(wire)
    d.close(2.0)
    stats = d.core.stats()
    assert (stats.ssrc_changes, stats.late, stats.lost, stats.invalid) == (1, 0, 0, 0)
    assert_audio_matches(d.audio, oracle(a.packets).pcm8k)


def test_a_lone_late_packet_of_the_old_ssrc_is_late_and_a_lone_unknown_one_is_a_stray() -> None:
    a = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(1600))
    a.change_ssrc(2, seq=7000, timestamp=777).audio(speech_like(1600, 1))
    wire = Impairments.of(delay={5: 0.5}).apply(a.packets)  # long after the switch
    stray = RtpPacket(0, 333, 444, 0xBAD, b"\xff" * 160).serialize()
    d = Driver(config=NO_IDLE)
    d.play(wire)
    d.send(stray, d.now + 0.01)
    d.close(d.now + 0.02)
    stats = d.core.stats()
    assert (stats.ssrc_changes, stats.late, stats.invalid_reasons) == (1, 1, {"stray_ssrc": 1})
    assert_audio_matches(d.audio, oracle([p for p in wire if p.index != 5]).pcm8k)


def test_a_source_that_comes_back_later_is_a_new_source_again() -> None:
    s = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800))
    s.change_ssrc(2, seq=500, timestamp=5).dtmf("3", 250)
    s.change_ssrc(1, seq=6, timestamp=800).audio(speech_like(800, 2))  # sipp: audio pcap, DTMF pcap, audio
    d = Driver(config=NO_IDLE)
    d.play(s.packets)
    d.close(2.0)
    assert d.core.stats().ssrc_changes == 2
    assert d.digits == [("3", 100, 250)]
    assert_audio_matches(d.audio, oracle(s.packets).pcm8k)


def test_alaw_with_30_ms_packets_and_a_codec_switch_by_reinvite() -> None:
    pcm = speech_like(4800)
    a = RtpSender("PCMA", ptime_ms=30, seq=1, timestamp=0, ssrc=1).audio(pcm[:2400])
    d = Driver(plan=PLAN_PCMA, config=NO_IDLE)
    d.play(a.packets)
    d.events += d.core.update(PLAN_PCMU, d.now + 0.01)
    u = RtpSender("PCMU", ptime_ms=30, seq=81, timestamp=2400, ssrc=1).audio(pcm[2400:])
    d.play(u.packets, start=a.packets[-1].at + 0.03)
    d.close(3.0)
    expected = np.concatenate([oracle(a.packets, "PCMA").pcm8k, oracle(u.packets, "PCMU").pcm8k])
    assert_audio_matches(d.audio, expected)
    late_pcma = RtpPacket(8, 200, 9999, 1, g711.encode(pcm[:240], "PCMA")).serialize()
    d2 = Driver(plan=PLAN_PCMU)
    d2.send(late_pcma, 0.0)
    assert d2.core.stats().invalid_reasons == {"unknown_pt": 1}


def test_close_flushes_packets_waiting_behind_a_gap_and_is_idempotent() -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(1600))
    wire = Impairments.of(loss={5}).apply(sender.packets)
    d = Driver(config=replace(NO_IDLE, playout_delay_s=10.0))
    d.play(wire)
    assert d.core.timeline_samples == 0  # all still waiting (priming, then the gap)
    d.close()
    assert d.core.close(d.now) == ()
    assert d.core.stats().lost == 1
    assert_audio_matches(d.audio, oracle(wire).pcm8k)


@pytest.mark.parametrize("block_ms", [20, 80, 160])
def test_block_size_is_configurable_and_blocks_stay_contiguous(block_ms: int) -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(4000))
    d = Driver(config=replace(NO_IDLE, block_ms=block_ms))
    d.play(sender.packets)
    d.close(2.0)
    assert [b.start_ms for b in d.blocks] == [block_ms * k for k in range(len(d.blocks))]
    assert all(len(b.pcm) == block_ms * 16 for b in d.blocks[:-1])
    assert_audio_matches(d.audio, oracle(sender.packets).pcm8k)


def test_audio_reaches_the_sink_within_one_block_plus_the_resampler_lookahead() -> None:
    sender = RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(8000))
    d = Driver(config=replace(NO_IDLE, playout_delay_s=0.0))
    emitted_at: list[float] = []
    for p in sender.packets:
        before = len(d.blocks)
        d.send(p.data, p.at)
        emitted_at += [d.now] * (len(d.blocks) - before)
    # Block k covers [80k, 80k+80) ms and needs 12 ms of lookahead; packets arrive at their start time.
    for k, t in enumerate(emitted_at):
        assert t <= (80 * (k + 1) + 12.5 + 20) / 1000


SIPP_PCAPS = Path("/usr/share/sip-tester")


def test_sipps_own_alaw_and_dtmf_pcaps_replayed_as_sipp_plays_them() -> None:
    """Debian's sipp ships PCMA at 30 ms and an RFC 2833 '1' from another SSRC (end packet ×3, same seq)."""
    assert (SIPP_PCAPS / "g711a.pcap").exists(), f"Debian's sip-tester ships its sample pcaps in {SIPP_PCAPS}"
    audio = read_pcap_rtp(str(SIPP_PCAPS / "g711a.pcap"))
    dtmf = read_pcap_rtp(str(SIPP_PCAPS / "dtmf_2833_1.pcap"))
    d = Driver(plan=PLAN_PCMA)
    t0 = audio[0][0]
    for t, data in audio:
        d.send(data, t - t0)
    start = audio[-1][0] - t0 + 0.03
    for t, data in dtmf:
        d.send(data, start + t - dtmf[0][0])
    d.close(d.now + 0.05)

    headers = [parse_rtp(data) for _, data in audio]
    assert {len(p.payload) for p in headers} == {240}  # 30 ms
    span = headers[-1].timestamp - headers[0].timestamp + 240
    stats = d.core.stats()
    assert (stats.ssrc_changes, stats.duplicate, stats.dtmf_events, stats.invalid) == (1, 0, 1, 0)
    assert stats.packets_received == len(audio) + len(dtmf)
    assert d.digits == [("1", span // 8, 280)]  # the new source starts where the audio ended
    assert len(d.audio) == 2 * (span + 280 * 8)  # the key press is covered by the timeline
    expected = np.zeros(span, np.int16)
    for p in headers:
        pos = p.timestamp - headers[0].timestamp
        expected[pos : pos + 240] = g711.decode(p.payload, "PCMA")
    assert np.abs(d.audio[: 2 * span - 400] - upsample(expected)[: 2 * span - 400]).max() < 1e-5


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_mix_of_interior_loss_duplicates_and_reordering_keeps_timeline_and_counters_exact(
    data: st.DataObject,
) -> None:
    seq0 = data.draw(st.integers(0, 0xFFFF), label="seq0")
    ts0 = data.draw(st.integers(0, 2**32 - 1), label="ts0")
    pcm = speech_like(8000, seed=data.draw(st.integers(0, 100)))
    sender = RtpSender(seq=seq0, timestamp=ts0, ssrc=1).audio(pcm[:3200]).silence(200, comfort_noise=True)
    sender.audio(pcm[3200:5600]).dtmf("4", 160).audio(pcm[5600:])
    audio = [p.index for p in sender.packets if p.kind == "audio"]
    interior = audio[1:-1]
    loss = data.draw(st.sets(st.sampled_from(interior), max_size=8), label="loss")
    dup = data.draw(st.sets(st.sampled_from([p.index for p in sender.packets]), max_size=8), label="dup")
    delay = data.draw(
        st.dictionaries(st.sampled_from(interior), st.floats(0.0, 0.05), max_size=8), label="delay"
    )
    wire = Impairments.of(loss=loss, duplicate=dup, delay=delay).apply(sender.packets)
    d = Driver(config=replace(NO_IDLE, playout_delay_s=0.1))
    d.play(wire)
    d.close(wire[-1].at + 0.5)
    expected = oracle(wire)
    assert_audio_matches(d.audio, expected.pcm8k)
    assert d.digits == expected.digits == [("4", expected.digits[0][1], 160)]
    stats = d.core.stats()
    dup_counted = len([i for i in dup - loss if sender.packets[i].kind != "dtmf"])
    assert (stats.lost, stats.late, stats.duplicate) == (len(loss), 0, dup_counted)


def test_a_dtmf_packet_with_a_wild_timestamp_cannot_stretch_the_timeline_past_max_gap() -> None:
    config = replace(NO_IDLE, max_gap_ms=1000)
    d = Driver(config=config)
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).packets)
    wild = RtpPacket(101, 6, 2**31, 1, TelephoneEvent(1, True, 10, 65535).serialize()).serialize()
    d.send(wild, 0.2)
    d.close(0.3)
    assert len(d.digits) == 1 and d.digits[0][1] <= 100 + 1000
    assert len(d.audio) <= 2 * (800 + 8000)


def test_timestamps_racing_ahead_of_the_clock_cannot_flood_the_timeline_with_silence() -> None:
    config = replace(NO_IDLE, max_gap_ms=1000)
    d = Driver(config=config)
    t = 0.0
    for k in range(50):  # one packet every 20 ms, each claiming a 900 ms timestamp jump
        d.send(RtpPacket(0, 1 + k, k * 7200, 1, b"\xff" * 160).serialize(), t)
        t += 0.02
    d.close(t)
    # Real time elapsed: ~1 s; the timeline may lead it by at most max_gap (1 s) plus the audio itself.
    assert d.core.timeline_samples <= 8000 * (1.0 + 1.0) + 50 * 160
    assert d.core.stats().timeline_adjustments > 0


def test_dtmf_events_racing_ahead_keep_the_timeline_within_the_wall_clock_plus_max_gap() -> None:
    """A hostile caller sends a new key press every 100 ms, each stamped 5 s after the last: the media
    timeline the ASR gets may lead the wall clock by at most max_gap, with idle fill on, at any time."""
    config = MediaConfig(max_gap_ms=5000, idle_fill_after_s=0.5)
    d = Driver(config=config)
    d.play(RtpSender(seq=1, timestamp=0, ssrc=1).audio(speech_like(800)).packets)
    first = 0.0
    ts, seq, t = 800, 6, 0.1
    max_lead = 0
    while t < 30.0:
        end = TelephoneEvent(1, True, 10, 800).serialize()
        d.send(RtpPacket(101, seq, ts, 1, end, marker=True).serialize(), t)
        wall = round((d.now - first) * 8000)
        max_lead = max(max_lead, d.core.timeline_samples - wall)
        ts, seq, t = ts + 40_000, seq + 1, t + 0.1
    d.close(t)
    assert len(d.digits) == 299  # every key press is still reported once
    assert max_lead <= 5000 * 8
    assert d.core.stats().audio_ms <= (t - first) * 1000 + 5000 + 80


def _comparable(events: Sequence[MediaEvent]) -> list[tuple[object, ...]]:
    """The events in order, a block by its start and length (its samples compared apart)."""
    out: list[tuple[object, ...]] = []
    for e in events:
        if isinstance(e, AudioBlock):
            out.append(("audio", e.start_ms, len(e.pcm)))
        elif isinstance(e, DtmfDigit):
            out.append(("dtmf", e.digit, e.start_ms, e.duration_ms))
        elif isinstance(e, MediaTimeout):
            out.append(("timeout", e.on_hold))
    return out


def _pcm(events: Sequence[MediaEvent]) -> NDArray[np.float32]:
    return np.concatenate([e.pcm for e in events if isinstance(e, AudioBlock)])


def test_calls_resampled_in_one_batch_get_the_events_each_gets_alone_in_the_same_order() -> None:
    """Two calls whose blocks are resampled together (the receiver runs the batch once a loop turn, here
    every 20 ms of the fake clock) get, in the same order among their DTMF and timeouts, the events each
    gets resampling its own, their samples equal to float rounding (a call's audio that comes before the
    batch has run joins the pass that waits: one pass over what alone are two)."""
    pcm = speech_like(16000, seed=3)
    a = RtpSender("PCMU", ssrc=0xA, seq=65500, timestamp=2**32 - 4000)
    a.audio(pcm[:9600]).silence(400, comfort_noise=True).audio(pcm[9600:12800]).dtmf("5", 200)
    a.audio(pcm[12800:16000]).change_ssrc(0xB, seq=1000, timestamp=123456).audio(pcm[:4800])
    wire_a = Impairments.of(loss={10, 11, 45}, duplicate={20}, delay={30: 0.03}).apply(a.packets)
    b = RtpSender("PCMA", ssrc=0xC).audio(speech_like(9000, seed=5)).dtmf("#", 120).audio(pcm[:3000])
    wire_b = b.packets
    plans, wires = (PLAN_PCMU, PLAN_PCMA), (wire_a, wire_b)
    end = max(wire_a[-1].at, wire_b[-1].at) + 1.0

    alone = [Driver(plan=plan, config=NO_IDLE) for plan in plans]
    for d, wire in zip(alone, wires, strict=True):
        d.play(wire)
        d.close(end)

    batch = UpsampleBatch()
    together = [Driver(plan=plan, config=NO_IDLE, batch=batch) for plan in plans]
    arrivals = sorted((p.at, i, p.data) for i, wire in enumerate(wires) for p in wire)
    widest, turn_end = 0, 0.02
    for at, i, data in arrivals:
        if at >= turn_end:  # the turn's end: the batch runs, the held events come out
            widest = max(widest, len(batch))
            batch.run()
            for d in together:
                d.take()
            turn_end = (at // 0.02 + 1) * 0.02
        together[i].send(data, at)
    for d in together:
        d.close(end)  # a pass still waiting runs alone

    assert widest >= 2  # the calls' blocks did share passes
    for d_alone, d_together in zip(alone, together, strict=True):
        assert _comparable(d_together.events) == _comparable(d_alone.events)
        pcm_alone, pcm_together = _pcm(d_alone.events), _pcm(d_together.events)
        assert len(pcm_together) == len(pcm_alone) and np.abs(pcm_together - pcm_alone).max() < 1e-6
    assert [digit for digit, _, _ in together[0].digits] == ["5"]
