"""RTP/RTCP wire format: round trips, every rejection reason, RFC 5761 demux, sequence arithmetic."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.rtp.packet import (
    STUN_MAGIC_COOKIE,
    RtpPacket,
    RtpParseError,
    is_rtcp,
    is_stun,
    parse_rtcp,
    parse_rtp,
)
from gateway.rtp.seq import Unwrapper, seq_delta, ts_delta, uint16_add, uint32_add


def test_a_plain_pcmu_packet_parses_to_its_fields() -> None:
    data = bytes.fromhex("80 00 ff f0 12345678 deadbeef".replace(" ", "")) + b"\xff" * 160
    pkt = parse_rtp(data)
    assert (pkt.payload_type, pkt.sequence_number, pkt.timestamp, pkt.ssrc) == (
        0,
        0xFFF0,
        0x12345678,
        0xDEADBEEF,
    )
    assert pkt.payload == b"\xff" * 160 and not pkt.marker and pkt.csrc == () and pkt.padding == 0


@given(
    pt=st.integers(0, 127),
    seq=st.integers(0, 0xFFFF),
    ts=st.integers(0, 0xFFFFFFFF),
    ssrc=st.integers(0, 0xFFFFFFFF),
    payload=st.binary(max_size=300),
    marker=st.booleans(),
    csrc=st.lists(st.integers(0, 0xFFFFFFFF), max_size=15),
    ext=st.one_of(
        st.none(),
        st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=12).map(lambda b: b + bytes(-len(b) % 4))),
    ),
    padding=st.integers(0, 8),
)
def test_serialize_then_parse_round_trips(
    pt: int, seq: int, ts: int, ssrc: int, payload: bytes, marker: bool, csrc: list[int],
    ext: tuple[int, bytes] | None, padding: int,
) -> None:  # fmt: skip
    pkt = RtpPacket(
        pt,
        seq,
        ts,
        ssrc,
        payload,
        marker,
        tuple(csrc),
        ext[0] if ext else None,
        ext[1] if ext else b"",
        padding,
    )
    data = pkt.serialize()
    assert parse_rtp(data) == pkt
    assert bytes(parse_rtp(data)) == data


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "too_short"),
        (b"\x80\x00" + bytes(9), "too_short"),
        (b"\x40\x00" + bytes(10) + b"\xff" * 160, "bad_version"),  # version 1
        (b"\x00\x00" + bytes(10), "bad_version"),
        (b"\x82\x00" + bytes(10) + bytes(4), "truncated"),  # CC=2 but one CSRC
        (b"\x90\x00" + bytes(10) + b"\x00\x01", "truncated"),  # X set, no room for its header
        (b"\x90\x00" + bytes(10) + b"\xbe\xde\x00\x02" + bytes(4), "truncated"),  # 2 words announced, 1 there
        (b"\xa0\x00" + bytes(10) + b"\x00", "bad_padding"),  # padding count 0
        (b"\xa0\x00" + bytes(10) + b"\xff\x09", "bad_padding"),  # more padding than packet
    ],
)
def test_malformed_datagrams_are_rejected_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(RtpParseError) as err:
        parse_rtp(data)
    assert err.value.reason == reason


def test_rtcp_is_told_apart_by_the_second_octet_as_rfc5761_says() -> None:
    assert is_rtcp(b"\x80\xc8") and is_rtcp(b"\x81\xc9") and is_rtcp(b"\x80\xdf")  # SR, RR, 223
    assert not is_rtcp(b"\x80\x00") and not is_rtcp(b"\x80\xe5")  # PT 0; PT 101 with marker (0xe5)
    assert not is_rtcp(b"\x80")


def sender_report(ssrc: int = 0x01020304, ntp: int = (3_900_000_000 << 32) | 5, rtp_ts: int = 1234) -> bytes:
    body = struct.pack("!IIIIII", ssrc, ntp >> 32, ntp & 0xFFFFFFFF, rtp_ts, 10, 1600)
    return struct.pack("!BBH", 0x80, 200, len(body) // 4) + body


def sdes(ssrc: int = 0x01020304) -> bytes:
    item = b"\x01\x05alice\x00\x00"  # CNAME "alice", end, pad to a word
    body = struct.pack("!I", ssrc) + item + bytes(-len(item) % 4)
    return struct.pack("!BBH", 0x81, 202, len(body) // 4) + body


def test_a_compound_sr_plus_sdes_parses_with_the_sender_info() -> None:
    info = parse_rtcp(sender_report() + sdes())
    assert info.packet_types == (200, 202)
    assert info.sender_ssrc == 0x01020304 and info.sr_rtp_timestamp == 1234
    assert info.sr_ntp == (3_900_000_000 << 32) | 5


def test_a_receiver_report_without_blocks_is_valid() -> None:
    info = parse_rtcp(struct.pack("!BBHI", 0x80, 201, 1, 42))
    assert info.packet_types == (201,) and info.sender_ssrc == 42 and info.sr_ntp is None


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\xc8\x00",  # shorter than a header
        b"\x80\xe0\x00\x01" + bytes(4),  # type 224 is outside the RTCP range (RFC 5761 §4)
        b"\x80\xcc\x00\x00",  # an APP packet too short for its SSRC
        sender_report()[:-4],  # length field says more than the datagram holds
        b"\x40" + sender_report()[1:],  # version 1
        b"\xa0" + sender_report()[1:] + sdes(),  # padding bit on a packet that is not the last
    ],
)
def test_invalid_rtcp_is_rejected_as_bad_rtcp(data: bytes) -> None:
    with pytest.raises(RtpParseError) as err:
        parse_rtcp(data)
    assert err.value.reason == "bad_rtcp"


def test_reduced_size_rtcp_without_sr_or_rr_is_valid_rtcp() -> None:
    """RFC 5506 §3: an APP keep-alive (baresip) or an SDES alone is RTCP, not junk."""
    app = struct.pack("!BBHI4s", 0x80, 204, 2, 77, b"PING")
    assert parse_rtcp(app).packet_types == (204,) and parse_rtcp(app).sender_ssrc == 77
    assert parse_rtcp(sdes()).packet_types == (202,)
    assert parse_rtcp(app).sr_ntp is None


def stun_binding(length: int = 0, cookie: int = STUN_MAGIC_COOKIE) -> bytes:
    return struct.pack("!HHI12s", 0x0001, length, cookie, b"t" * 12) + bytes(length)


def test_stun_is_recognized_by_first_octet_cookie_and_length() -> None:
    assert is_stun(stun_binding()) and is_stun(stun_binding(8))
    assert not is_stun(stun_binding(cookie=0))  # RFC 3489 STUN has no cookie: not recognized
    assert not is_stun(stun_binding(8)[:-4])  # length field disagrees with the datagram
    assert not is_stun(RtpPacket(0, 1, 0, 1, b"\xff" * 160).serialize())
    assert not is_stun(b"\x00\x01")


def test_wraparound_arithmetic() -> None:
    assert uint16_add(65535, 1) == 0 and uint32_add(0xFFFFFFFF, 2) == 1
    assert seq_delta(2, 65534) == 4 and seq_delta(65534, 2) == -4
    assert ts_delta(10, 0xFFFFFFF0) == 26 and ts_delta(0xFFFFFFF0, 10) == -26


@given(start=st.integers(0, 0xFFFF), steps=st.lists(st.integers(-1000, 1000), max_size=200))
def test_unwrapping_sequence_numbers_recovers_the_true_counter(start: int, steps: list[int]) -> None:
    unwrap = Unwrapper(16)
    true = start + 10_000_000
    first = unwrap.unwrap(true & 0xFFFF)
    assert first == true & 0xFFFF  # the first value is taken as is
    offset = true - first
    for step in steps:
        true += step
        assert unwrap.unwrap(true & 0xFFFF) + offset == true


def test_unwrapping_timestamps_crosses_the_32_bit_wrap() -> None:
    unwrap = Unwrapper(32)
    assert unwrap.unwrap(0xFFFFFF00) == 0xFFFFFF00
    assert unwrap.unwrap(0x00000060) == 0x100000060
    assert unwrap.peek(0xFFFFFFA0) == 0xFFFFFFA0  # backwards across the wrap again
    assert unwrap.last == 0x100000060
