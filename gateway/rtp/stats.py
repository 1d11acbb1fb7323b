"""Receive statistics of one RTP stream: RFC 3550 interarrival jitter (App. A.8) and counters.

Definitions (what the numbers in `call_end` and the metrics mean):
- packets_received: RTP datagrams that parsed, had a negotiated payload type and came from the latched
  source (duplicates and late packets included, as in RFC 3550's "received").
- lost: sequence numbers never received before their playout deadline nor within 100 packets after it
  (RFC 3550 App. A.1's MAX_MISORDER); their audio was concealed. A packet that arrives after its
  deadline is counted in `late`, not in `lost`.
- late: packets that arrived after their audio was concealed (dropped). A packet of a source the stream
  already switched away from (SSRC change) is late too, and its loss stays counted (settled at the switch).
- duplicate: second and later copies of a sequence number (RFC 4733 end-packet repeats excluded: they are
  duplicates by design).
- invalid: datagrams on the ports that were not usable RTP/RTCP, by reason. `seq_jump` (RFC 3550 A.1:
  a packet far outside the sequence that no second packet followed) and `stray_ssrc` (a lone packet of
  an unknown SSRC) are valid RTP from the latched source, so they are counted in packets_received too.
- rtcp_packets / rtcp_reports_sent: valid RTCP received from the peer / receiver reports we sent it.
- jitter_ms: RFC 3550 A.8 estimate at the end of the stream (for the last source), in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.rtp.seq import ts_delta


class JitterEstimator:
    """RFC 3550 App. A.8: J += (|D(i-1,i)| - J) / 16, in timestamp units, fed in arrival order."""

    __slots__ = ("_prev_arrival", "_prev_ts", "jitter")

    def __init__(self) -> None:
        self._prev_arrival: float | None = None
        self._prev_ts = 0
        self.jitter = 0.0

    def update(self, arrival: float, timestamp: int) -> None:
        """`arrival` in timestamp units (seconds × clock rate); `timestamp` the 32-bit RTP timestamp."""
        if self._prev_arrival is not None:
            # D(i-1,i) = (Rj - Ri) - (Sj - Si), with the timestamp difference taken modulo 2^32.
            d = (arrival - self._prev_arrival) - ts_delta(timestamp, self._prev_ts)
            self.jitter += (abs(d) - self.jitter) / 16.0
        self._prev_arrival = arrival
        self._prev_ts = timestamp

    def reset(self) -> None:
        """A new source (SSRC change) starts a new estimate (the transit times are unrelated)."""
        self._prev_arrival = None
        self.jitter = 0.0


@dataclass(frozen=True, slots=True)
class MediaStats:
    """Final (or current) numbers of one media stream. See the module docstring for definitions."""

    codec: str
    packets_received: int = 0
    bytes_received: int = 0
    lost: int = 0
    late: int = 0
    duplicate: int = 0
    invalid: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    ssrc_changes: int = 0
    seq_restarts: int = 0  # RFC 3550 A.1 resyncs after a sequence jump within one SSRC
    timeline_adjustments: int = 0  # gaps capped at max_gap and overlaps re-anchored
    dtmf_events: int = 0
    rtcp_packets: int = 0
    rtcp_reports_sent: int = 0
    jitter_ms: float = 0.0
    audio_ms: int = 0  # length of the media timeline delivered to the sink
    concealed_ms: int = 0  # silence inserted into it (loss, DTX/CN gaps, DTMF, idle fill)
    source: str = ""  # latched remote address "host:port" ("" if no RTP arrived)
    first_packet_at: float | None = None  # monotonic time of the first valid RTP packet
    timed_out: bool = False

    def to_fields(self, prefix: str = "rtp_") -> dict[str, str]:
        """Flat string fields for the call_end event (schema v1 `extra`)."""
        return {
            f"{prefix}codec": self.codec,
            f"{prefix}packets": str(self.packets_received),
            f"{prefix}bytes": str(self.bytes_received),
            f"{prefix}lost": str(self.lost),
            f"{prefix}late": str(self.late),
            f"{prefix}duplicate": str(self.duplicate),
            f"{prefix}invalid": str(self.invalid),
            f"{prefix}ssrc_changes": str(self.ssrc_changes),
            f"{prefix}dtmf_events": str(self.dtmf_events),
            f"{prefix}jitter_ms": f"{self.jitter_ms:.2f}",
            f"{prefix}audio_ms": str(self.audio_ms),
            f"{prefix}concealed_ms": str(self.concealed_ms),
            f"{prefix}source": self.source,
        }
