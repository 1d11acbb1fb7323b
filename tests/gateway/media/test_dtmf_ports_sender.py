"""RFC 4733 decoding, the port pool, and the impairment sender's own promises."""

from __future__ import annotations

import pytest

from gateway.rtp.dtmf import END_TIMEOUT_S, DtmfDecoder, DtmfEvent, TelephoneEvent
from gateway.rtp.packet import parse_rtp
from gateway.rtp.ports import PortPool, PortsExhausted
from gateway.rtp.sender import Impairments, RtpSender


def test_telephone_event_payload_round_trips_and_short_payloads_fail() -> None:
    ev = TelephoneEvent(event=11, end=True, volume=13, duration=1600)
    data = ev.serialize()
    assert data == bytes([11, 0x80 | 13]) + (1600).to_bytes(2, "big")
    assert TelephoneEvent.parse(data) == ev
    with pytest.raises(ValueError):
        TelephoneEvent.parse(b"\x01\x02\x03")


def test_one_event_is_reported_once_at_its_first_end_packet() -> None:
    dec = DtmfDecoder()
    assert dec.packet(1000, 80, TelephoneEvent(5, False, 10, 160), 0.0) == []
    assert dec.packet(1000, 80, TelephoneEvent(5, False, 10, 320), 0.02) == []
    end = TelephoneEvent(5, True, 10, 480)
    assert dec.packet(1000, 80, end, 0.04) == [DtmfEvent("5", 80, 480, True)]
    assert dec.packet(1000, 80, end, 0.06) == []  # the second and third copies
    assert dec.packet(1000, 80, end, 0.08) == []
    assert dec.next_deadline() is None and dec.finish() == []


def test_a_new_event_closes_one_whose_end_was_lost() -> None:
    dec = DtmfDecoder()
    dec.packet(1000, 0, TelephoneEvent(1, False, 10, 400), 0.0)
    out = dec.packet(3000, 2000, TelephoneEvent(2, True, 10, 800), 0.3)
    assert out == [DtmfEvent("1", 0, 400, False), DtmfEvent("2", 2000, 800, True)]


def test_an_event_without_updates_for_the_timeout_is_closed() -> None:
    dec = DtmfDecoder()
    dec.packet(1000, 0, TelephoneEvent(10, False, 10, 400), 1.0)
    assert dec.next_deadline() == pytest.approx(1.0 + END_TIMEOUT_S)
    assert dec.handle_timer(1.0 + END_TIMEOUT_S - 0.01) == []
    assert dec.handle_timer(1.0 + END_TIMEOUT_S) == [DtmfEvent("*", 0, 400, False)]
    assert dec.packet(1000, 0, TelephoneEvent(10, True, 10, 480), 1.5) == []  # too late: already reported


def test_non_digit_events_such_as_flash_are_not_reported() -> None:
    dec = DtmfDecoder()
    assert dec.packet(1, 0, TelephoneEvent(16, True, 10, 800), 0.0) == []


def test_port_pool_hands_out_even_pairs_least_recently_used_first() -> None:
    pool = PortPool(20001, 20010, quarantine_s=2.0)
    assert pool.capacity == 4  # 20002, 20004, 20006, 20008 (20010 has no odd partner in range)
    ports = [pool.acquire(0.0) for _ in range(4)]
    assert ports == [20002, 20004, 20006, 20008]
    with pytest.raises(PortsExhausted):
        pool.acquire(0.0)
    pool.release(20004, 10.0)
    pool.release(20002, 10.5)
    with pytest.raises(PortsExhausted):
        pool.acquire(11.0)  # still resting
    assert pool.acquire(12.0) == 20004
    assert pool.available(12.0) == 0 and pool.available(12.5) == 1
    with pytest.raises(ValueError):
        pool.release(20004 + 100, 13.0)


def test_port_pool_rejects_a_range_without_a_pair() -> None:
    with pytest.raises(ValueError):
        PortPool(30001, 30002)


def test_sender_numbers_wrap_and_timing_follows_the_media_clock() -> None:
    s = RtpSender(seq=65534, timestamp=2**32 - 160, ssrc=5).audio(bytes(480))
    parsed = [parse_rtp(p.data) for p in s.packets]
    assert [p.sequence_number for p in parsed] == [65534, 65535, 0]
    assert [p.timestamp for p in parsed] == [2**32 - 160, 0, 160]
    assert [p.marker for p in parsed] == [True, False, False]
    assert [p.at for p in s.packets] == pytest.approx([0.0, 0.02, 0.04])


def test_sender_dtmf_updates_then_three_end_packets_and_the_clock_moves_by_the_duration() -> None:
    s = RtpSender(seq=10, timestamp=1000, ssrc=5).dtmf("#", 100).audio(bytes(160))
    events = [TelephoneEvent.parse(p.payload) for p in s.packets if p.kind == "dtmf"]
    assert [e.duration for e in events] == [160, 320, 480, 640, 800, 800, 800]
    assert [e.end for e in events] == [False] * 4 + [True] * 3
    seqs = [p.seq for p in s.packets]
    assert seqs == [10, 11, 12, 13, 14, 14, 14, 15]  # end copies reuse the sequence number
    assert {p.timestamp for p in s.packets if p.kind == "dtmf"} == {1000}
    assert s.packets[-1].timestamp == 1800 and s.packets[-1].at == pytest.approx(0.1)


def test_impairments_drop_duplicate_and_delay_deterministically() -> None:
    s = RtpSender(seq=1, timestamp=0, ssrc=5).audio(bytes(160 * 10))
    wire = Impairments.of(loss={2}, duplicate={4}, delay={6: 0.05}).apply(s.packets)
    assert [p.index for p in wire] == [0, 1, 3, 4, 4, 5, 7, 8, 6, 9]
    noisy = Impairments.of(loss_rate=0.2, duplicate_rate=0.1, jitter_s=0.01, seed=3)
    assert [p.index for p in noisy.apply(s.packets)] == [p.index for p in noisy.apply(s.packets)]
