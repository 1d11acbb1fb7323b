"""Observation hooks of the engine: how the gateway (Prometheus) or a benchmark sees inside it.

asr_core does not depend on prometheus_client; the gateway passes an object with these methods.
Hooks are called on engine threads and must be cheap and non-blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class EngineHooks(Protocol):
    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        """One batched encoder step ran: its wall time, its rows, how long each row's chunk waited."""

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        """One RNN-T decode step (one stream's chunk, or a batched step over n_streams) ran."""

    def chunk_dropped(self, stream_id: str) -> None:
        """A stream fell behind and its oldest queued chunk was dropped."""

    def transcript(self, kind: str, latency_s: float) -> None:
        """A partial/final was emitted `latency_s` after the audio that completed its last chunk arrived."""

    def time_to_final(self, seconds: float) -> None:
        """A final closed by the VAD was emitted `seconds` after the caller's last speech sample (its
        wall time estimated from the push that carried it and the stream's real-time pace)."""


class NullHooks:
    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        pass

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        pass

    def chunk_dropped(self, stream_id: str) -> None:
        pass

    def transcript(self, kind: str, latency_s: float) -> None:
        pass

    def time_to_final(self, seconds: float) -> None:
        pass
