"""Transcripts to Redis Streams: a pure core (queue, seq, drop policy, spool) and its asyncio adapter.

    sink = RedisSink.from_settings(settings, on_degraded=...)
    await sink.start()
    sink.publish(CallEvent(...))     # never blocks
    await sink.close()               # flush (bounded), spool the rest

The consumer's view (streams, fields, guarantees): docs/events.md.
"""

from gateway.sink.core import BatchOutcome, Probe, SendBatch, SinkConfig, SinkCore, SinkHooks
from gateway.sink.publisher import ClientConfig, RedisSink
from gateway.sink.script import StreamLayout
from gateway.sink.spool import Record, Spool, SpoolScan

__all__ = [
    "BatchOutcome",
    "ClientConfig",
    "Probe",
    "Record",
    "RedisSink",
    "SendBatch",
    "SinkConfig",
    "SinkCore",
    "SinkHooks",
    "Spool",
    "SpoolScan",
    "StreamLayout",
]
