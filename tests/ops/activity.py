"""Real activity of our own components, so that every metric family has moving series: the sink
publishing through Redis, the engine hooks fed with samples, SIP/RTP counters as their adapters
would count them. Used by tests/ops until the full daemon serves /metrics with calls in progress."""

from __future__ import annotations

import asyncio
import random

from gateway import metrics as m
from gateway.events import CallEvent, EventPublisher

_hooks = m.PrometheusEngineHooks()
_rnd = random.Random(7)


def drive_once(n_calls: int = 3) -> None:
    """One tick of a few calls' worth of metric updates (no events)."""
    m.ACTIVE_CALLS.set(n_calls)
    m.CALLS.labels("admitted").inc()
    m.CALLS.labels("rejected_capacity").inc(_rnd.random() < 0.3)
    m.SIP_REQUESTS.labels("INVITE").inc()
    m.SIP_REQUESTS.labels("BYE").inc()
    m.SIP_RESPONSES.labels("200").inc()
    m.SIP_RESPONSES.labels("503").inc(_rnd.random() < 0.3)
    m.SIP_ERRORS.labels("malformed").inc(_rnd.random() < 0.1)
    m.RTP_RECEIVED.labels("PCMU").inc(50 * n_calls)
    m.RTP_RECEIVED.labels("PCMA").inc(50)
    m.RTP_LOST.inc(_rnd.randrange(3))
    m.RTP_LATE.inc(_rnd.randrange(2))
    m.RTP_DUPLICATE.inc(_rnd.randrange(2))
    m.RTP_INVALID.labels("malformed").inc(_rnd.random() < 0.2)
    m.RTP_JITTER.observe(_rnd.uniform(0.001, 0.03))
    m.DTMF_EVENTS.inc(_rnd.random() < 0.2)
    _hooks.encoder_step(_rnd.uniform(0.005, 0.05), n_calls, [_rnd.uniform(0.0, 0.02) for _ in range(n_calls)])
    _hooks.decoder_step(_rnd.uniform(0.0005, 0.004), n_calls)
    _hooks.transcript("partial", _rnd.uniform(0.1, 0.5))
    _hooks.transcript("final", _rnd.uniform(0.2, 0.9))
    _hooks.time_to_final(_rnd.uniform(0.15, 0.4))
    for worker in ("0", "1"):
        m.set_media_worker_timing(worker, _rnd.uniform(0.0, 0.02), _rnd.uniform(0.0, 0.01))
    if _rnd.random() < 0.1:
        _hooks.chunk_dropped("call-x")


async def drive(sink: EventPublisher, stop: asyncio.Event, tick_s: float = 0.1) -> int:
    """Metric updates plus real call events through `sink` until `stop`; returns events published."""
    n = 0
    seg = 0
    call = "activity-0"
    sink.publish(CallEvent("call_start", call, "activity@sip"))
    while not stop.is_set():
        drive_once()
        sink.publish(CallEvent("partial", call, "activity@sip", segment_id=seg, text="hello"))
        sink.publish(CallEvent("final", call, "activity@sip", segment_id=seg, text="hello world"))
        n += 2
        seg += 1
        if seg % 20 == 0:
            sink.publish(CallEvent("call_end", call, "activity@sip", extra={"reason": "bye"}))
            call = f"activity-{seg}"
            sink.publish(CallEvent("call_start", call, "activity@sip"))
            n += 2
        await asyncio.sleep(tick_s)
    sink.publish(CallEvent("call_end", call, "activity@sip", extra={"reason": "bye"}))
    return n + 1
