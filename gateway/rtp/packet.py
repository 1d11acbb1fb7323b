"""RTP (RFC 3550 §5.1) and RTCP (§6) wire formats, and the RTP/RTCP demux of RFC 5761 §4.

`RtpPacket` is a NamedTuple rather than a frozen dataclass: it is built once per datagram on the hot
path, and a NamedTuple is ~3× cheaper to construct (250 ns vs 750 ns measured here) while just as
immutable and typed.

Parse errors carry a short `reason` that is also the metric label (`ttg_rtp_packets_invalid_total`).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

RTP_VERSION = 2
HEADER_SIZE = 12

_HEADER = struct.Struct("!BBHII")
_EXT_HEADER = struct.Struct("!HH")
_RTCP_HEADER = struct.Struct("!BBH")

# RTCP packet types (RFC 3550 §12.1; RFC 4585 205/206; RFC 3611 207).
RTCP_SR = 200
RTCP_RR = 201
RTCP_SDES = 202
RTCP_BYE = 203
RTCP_APP = 204


class RtpParseError(ValueError):
    """A datagram that is not usable RTP/RTCP; `reason` is a bounded label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RtpPacket(NamedTuple):
    payload_type: int
    sequence_number: int
    timestamp: int
    ssrc: int
    payload: bytes
    marker: bool = False
    csrc: tuple[int, ...] = ()
    extension_profile: int | None = None
    extension: bytes = b""
    padding: int = 0  # padding octets that followed the payload (count includes the last octet)

    def serialize(self) -> bytes:
        b0 = (RTP_VERSION << 6) | len(self.csrc)
        if self.padding:
            b0 |= 0x20
        if self.extension_profile is not None:
            b0 |= 0x10
        b1 = (0x80 if self.marker else 0) | (self.payload_type & 0x7F)
        out = [_HEADER.pack(b0, b1, self.sequence_number & 0xFFFF, self.timestamp & 0xFFFFFFFF, self.ssrc)]
        out += [struct.pack("!I", c) for c in self.csrc]
        if self.extension_profile is not None:
            if len(self.extension) % 4:
                raise ValueError("RTP header extension length must be a multiple of 4")
            out.append(_EXT_HEADER.pack(self.extension_profile, len(self.extension) // 4))
            out.append(self.extension)
        out.append(self.payload)
        if self.padding:
            if not 1 <= self.padding <= 255:
                raise ValueError("RTP padding must be 1..255 octets")
            out.append(bytes(self.padding - 1) + bytes([self.padding]))
        return b"".join(out)

    def __bytes__(self) -> bytes:
        return self.serialize()


def is_rtcp(data: bytes) -> bool:
    """RFC 5761 §4: with RTP and RTCP on one port, a second octet in 192..223 (RTCP packet types
    192..223; RTP payload types 64..95 with the marker set) is RTCP."""
    return len(data) >= 2 and 192 <= data[1] <= 223


STUN_MAGIC_COOKIE = 0x2112A442
_STUN_HEADER = struct.Struct("!HHI")


def is_stun(data: bytes) -> bool:
    """A STUN message (RFC 5389 §6), as peers send for NAT keep-alive (RFC 6263 §4.2) or ICE checks.

    RFC 7983 §7 demultiplexes by the first octet (0-3: STUN, 128-191: RTP/RTCP); the magic cookie and
    the length field (the datagram less the 20-octet header, a multiple of 4) make it unambiguous."""
    if len(data) < 20 or data[0] > 3:
        return False
    _, length, cookie = _STUN_HEADER.unpack_from(data)
    return cookie == STUN_MAGIC_COOKIE and length % 4 == 0 and length + 20 == len(data)


def parse_rtp(data: bytes) -> RtpPacket:
    """RFC 3550 §5.1 fixed header, CSRC list, §5.3.1 header extension and padding."""
    n = len(data)
    if n < HEADER_SIZE:
        raise RtpParseError("too_short", f"RTP packet is {n} bytes (minimum {HEADER_SIZE})")
    b0, b1, seq, ts, ssrc = _HEADER.unpack_from(data)
    if b0 >> 6 != RTP_VERSION:
        raise RtpParseError("bad_version", f"RTP version is {b0 >> 6}, expected 2")
    offset = HEADER_SIZE
    cc = b0 & 0x0F
    csrc: tuple[int, ...] = ()
    if cc:
        end = offset + 4 * cc
        if end > n:
            raise RtpParseError("truncated", "RTP packet has a truncated CSRC list")
        csrc = struct.unpack_from(f"!{cc}I", data, offset)
        offset = end
    ext_profile = None
    ext = b""
    if b0 & 0x10:
        if offset + 4 > n:
            raise RtpParseError("truncated", "RTP packet has a truncated extension header")
        ext_profile, words = _EXT_HEADER.unpack_from(data, offset)
        offset += 4
        end = offset + 4 * words
        if end > n:
            raise RtpParseError("truncated", "RTP packet has a truncated header extension")
        ext = data[offset:end]
        offset = end
    end = n
    padding = 0
    if b0 & 0x20:
        # "The last octet of the padding contains a count of how many padding octets should be
        # ignored, including itself" (RFC 3550 §5.1).
        padding = data[-1]
        if padding == 0 or offset + padding > n:
            raise RtpParseError("bad_padding", f"RTP padding length {padding} is invalid")
        end = n - padding
    return RtpPacket(
        b1 & 0x7F, seq, ts, ssrc, data[offset:end], bool(b1 & 0x80), csrc, ext_profile, ext, padding
    )


class RtcpInfo(NamedTuple):
    """What we keep from a valid compound RTCP packet: its types, and the first SR's sender info."""

    packet_types: tuple[int, ...]
    sender_ssrc: int
    sr_ntp: int | None = None  # 64-bit NTP timestamp of the sender report
    sr_rtp_timestamp: int | None = None


def parse_rtcp(data: bytes) -> RtcpInfo:
    """Validity checks of RFC 3550 App. A.2 on a compound RTCP packet.

    Version 2 everywhere; the packet lengths add up to the datagram; only the last packet may pad.
    A compound packet starts with SR or RR (RFC 3550 §6.1); a datagram of other RTCP types only is a
    reduced-size RTCP packet (RFC 5506 §3), which peers send for keep-alive (baresip's APP packets):
    valid, with no sender info. Types outside 192-223 (the RFC 5761 §4 range) are not RTCP.
    """
    n = len(data)
    if n < 8:
        raise RtpParseError("bad_rtcp", f"RTCP packet is {n} bytes (minimum 8)")
    offset = 0
    types: list[int] = []
    sender = 0
    sr_ntp = sr_ts = None
    while offset < n:
        if offset + 4 > n:
            raise RtpParseError("bad_rtcp", "RTCP packet has a truncated header")
        b0, pt, words = _RTCP_HEADER.unpack_from(data, offset)
        if b0 >> 6 != RTP_VERSION:
            raise RtpParseError("bad_rtcp", f"RTCP version is {b0 >> 6}, expected 2")
        length = 4 * (words + 1)
        if offset + length > n:
            raise RtpParseError("bad_rtcp", "RTCP length field exceeds the datagram")
        if b0 & 0x20 and offset + length != n:
            raise RtpParseError("bad_rtcp", "RTCP padding on a packet that is not the last")
        if not 192 <= pt <= 223:
            raise RtpParseError("bad_rtcp", f"RTCP packet type {pt} is outside 192-223")
        if not types:
            if length < 8:
                raise RtpParseError("bad_rtcp", "RTCP packet too short for its SSRC")
            (sender,) = struct.unpack_from("!I", data, offset + 4)  # SR/RR/APP/RTPFB: the sender's
            if pt == RTCP_SR:
                if length < 28:
                    raise RtpParseError("bad_rtcp", "RTCP SR too short for sender info")
                ntp_hi, ntp_lo, sr_ts = struct.unpack_from("!III", data, offset + 8)
                sr_ntp = (ntp_hi << 32) | ntp_lo
        types.append(pt)
        offset += length
    return RtcpInfo(tuple(types), sender, sr_ntp, sr_ts)
