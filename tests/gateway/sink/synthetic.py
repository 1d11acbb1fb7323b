"""Synthetic calls for sink tests and harnesses: each call publishes call_start, partials that grow
into a final per segment, DTMF now and then, and call_end; it remembers every final it published."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.events import CallEvent, EventPublisher

WORDS = ["Привіт", "світе", "你好", "世界", "こんにちは", "🎧", "hello", "world", "ĉu", "naïve"]


@dataclass
class CallLog:
    call_id: str
    finals: list[str] = field(default_factory=list)
    n_partials: int = 0
    n_dtmf: int = 0
    ended: bool = False


async def synthetic_call(
    publish: Callable[[], EventPublisher] | EventPublisher,
    call_id: str,
    *,
    segments: int = 1_000_000,
    stop: asyncio.Event | None = None,
    partials_per_segment: int = 4,
    pace_s: float = 0.03,
    end_reason: str = "bye",
) -> CallLog:
    """Publish one call's events until `segments` are done or `stop` is set, then call_end.

    `publish` may be a callable returning the current publisher (a harness that restarts the sink).
    Cancelling the task ends the call without call_end (the process died with it)."""
    log = CallLog(call_id)

    def send(ev: CallEvent) -> None:
        target = publish() if callable(publish) else publish
        target.publish(ev)

    def event(kind: str, **kw: object) -> CallEvent:
        return CallEvent(kind, call_id, f"{call_id}@sip.test", ts=time.time(), lang="uk-UA", **kw)  # type: ignore[arg-type]

    send(event("call_start", extra={"from": "sip:+380441234567@pbx.test", "to": "sip:ttg@gw.test"}))
    media_ms = 0
    for seg in range(segments):
        if stop is not None and stop.is_set():
            break
        words = [WORDS[(seg + i) % len(WORDS)] for i in range(partials_per_segment)]
        for i in range(1, partials_per_segment):
            send(event("partial", segment_id=seg, text=" ".join(words[:i]), start_ms=media_ms))
            log.n_partials += 1
            await asyncio.sleep(pace_s)
        text = f"{call_id} #{seg}: " + " ".join(words)
        send(event("final", segment_id=seg, text=text, start_ms=media_ms, end_ms=media_ms + 1500))
        log.finals.append(text)
        media_ms += 1600
        if seg % 3 == 2:
            send(event("dtmf", text=str(seg % 10), start_ms=media_ms, end_ms=media_ms + 100))
            log.n_dtmf += 1
        await asyncio.sleep(pace_s)
    send(event("call_end", extra={"reason": end_reason, "rtp_packets_received": str(media_ms // 20)}))
    log.ended = True
    return log


async def wait_until(
    cond: Callable[[], bool | Awaitable[bool]], timeout_s: float = 15.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or cond}")
        await asyncio.sleep(0.02)


async def cancel(task: asyncio.Task[object]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
