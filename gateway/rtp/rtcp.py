"""RTCP receiver reports (RFC 3550 §6.4.2): what this gateway, a receive-only participant, sends.

RFC 3550 §6: "RTCP ... is based on the periodic transmission of control packets to all participants in
the session"; receivers send receiver reports. Peers act on them: linphone ends a call in which neither
RTP nor RTCP arrived for its `nortp_timeout` (30 s), and this gateway sends no RTP (its answer is
recvonly), so without reports a call from linphone ends after 30 s. SBCs and PBXs also read the
report blocks (loss, jitter) as the far end's view of each leg.

Pure: the packets' wire format, the report block's arithmetic (App. A.3) and the interval (§6.3.1).
`gateway.rtp.media.MediaCore` keeps the counters, decides when and where to send, and never sends to an
address it has not heard from.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass

from gateway.rtp.packet import RTCP_BYE, RTCP_RR, RTCP_SDES

# §6.2: "the recommended value for a fixed minimum interval is 5 seconds", halved for the first report
# (§6.3.1 "Tmin is set to 2.5 seconds" initially). With one peer and G.711's session bandwidth the
# computed deterministic interval (n x average size / the receivers' 3.75 % share: ~0.3 s) is always
# below it, so the minimum is the interval.
MIN_INTERVAL_S = 5.0
# §6.3.1: the randomized interval is divided by e - 3/2 to compensate for the timer reconsideration
# algorithm converging to a value below the average.
_COMPENSATION = math.e - 1.5

SDES_CNAME = 1
_HEADER = struct.Struct("!BBHI")  # V=2 P RC/SC, packet type, length in words - 1, SSRC
_BLOCK = struct.Struct("!IIIIII")  # SSRC, fraction|cumulative lost, highest seq, jitter, LSR, DLSR
_MAX_LOST = 0x7FFFFF  # cumulative lost is a signed 24-bit field (App. A.3 clamps it)


def report_interval(rng: random.Random, *, initial: bool) -> float:
    """Seconds to the next report: Td x U(0.5, 1.5) / (e - 3/2), Td the minimum (halved at first)."""
    td = MIN_INTERVAL_S / 2 if initial else MIN_INTERVAL_S
    return td * rng.uniform(0.5, 1.5) / _COMPENSATION


@dataclass(slots=True)
class Reception:
    """One source's reception for its report blocks (RFC 3550 App. A.3), updated by the receiver.

    `base` is the extended sequence number (cycles x 2^16 + seq) of its first packet; `received` counts
    every packet of the source, duplicates and late ones included."""

    ssrc: int
    base: int
    received: int = 0
    expected_prior: int = 0
    received_prior: int = 0

    def block(self, highest: int, jitter: float, lsr: int, dlsr: int) -> bytes:
        """The next report block, `highest` the extended sequence number of the highest packet so far;
        starts the next reporting interval (its fraction lost)."""
        expected = highest - self.base + 1
        lost = max(-_MAX_LOST - 1, min(_MAX_LOST, expected - self.received))
        expected_interval = expected - self.expected_prior
        lost_interval = expected_interval - (self.received - self.received_prior)
        self.expected_prior, self.received_prior = expected, self.received
        fraction = 0
        if expected_interval > 0 and lost_interval > 0:
            fraction = (lost_interval << 8) // expected_interval
        return _BLOCK.pack(
            self.ssrc,
            (min(fraction, 255) << 24) | (lost & 0xFFFFFF),
            highest & 0xFFFFFFFF,
            min(int(jitter), 0xFFFFFFFF),
            lsr,
            dlsr,
        )


def sr_middle(ntp: int) -> int:
    """LSR (§6.4.1): the middle 32 bits of a sender report's 64-bit NTP timestamp."""
    return (ntp >> 16) & 0xFFFFFFFF


def delay_since(seconds: float) -> int:
    """DLSR (§6.4.1): the delay since that sender report, in units of 1/65536 s."""
    return min(int(seconds * 65536), 0xFFFFFFFF)


def compound(ssrc: int, cname: bytes, blocks: tuple[bytes, ...] = (), bye: bytes | None = None) -> bytes:
    """An RR with `blocks`, an SDES with our CNAME (§6.1: every compound packet carries one) and, at the
    end of our participation, a BYE with the reason `bye` (§6.6)."""
    rr = _HEADER.pack(0x80 | len(blocks), RTCP_RR, 1 + 6 * len(blocks), ssrc) + b"".join(blocks)
    # One chunk: our SSRC, the CNAME item, then a null item ending the list, padded to 32 bits (§6.5).
    items = bytes((SDES_CNAME, len(cname))) + cname + b"\x00"
    items += bytes(-len(items) % 4)
    sdes = _HEADER.pack(0x81, RTCP_SDES, 1 + len(items) // 4, ssrc) + items
    if bye is None:
        return rr + sdes
    reason = bytes((len(bye),)) + bye
    reason += bytes(-len(reason) % 4)
    return rr + sdes + _HEADER.pack(0x81, RTCP_BYE, 1 + len(reason) // 4, ssrc) + reason
