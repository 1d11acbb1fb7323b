"""LocalLegs: leg effects carried out in this process (the recording engine, a signalling-only media
manager), with audio going from a leg's media straight into its ASR stream and only leg inputs coming
back, on the loop, after `execute` returned."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asr_core.api import StreamOptions
from gateway.call.contract import (
    AsrEnded,
    AsrOpened,
    AsrRefused,
    AudioRefused,
    CloseMedia,
    Dtmf,
    FinishAsr,
    LegInput,
    MediaClosed,
    MediaFailed,
    MediaInactive,
    MediaOpened,
    OpenAsr,
    OpenMedia,
    Transcript,
)
from gateway.call.legs import LocalLegs
from tests.fixtures.telephony import FakeMediaManager, RecordingEngine


class Inbox:
    def __init__(self) -> None:
        self.events: list[tuple[str, LegInput]] = []

    def leg_event(self, call_id: str, event: LegInput) -> None:
        self.events.append((call_id, event))

    async def settle(self) -> list[LegInput]:
        for _ in range(50):
            await asyncio.sleep(0.01)
        out = [e for _, e in self.events]
        self.events.clear()
        return out


OPEN_ASR = OpenAsr("caller", "c1", StreamOptions("en-US"))


async def started(
    engine: RecordingEngine | None = None, media: FakeMediaManager | None = None
) -> tuple[LocalLegs, Inbox]:
    legs = LocalLegs(engine or RecordingEngine(threaded=False), media or FakeMediaManager())
    inbox = Inbox()
    legs.start(inbox)
    return legs, inbox


async def test_audio_goes_into_the_stream_and_close_reports_stats_then_finish_brings_the_final() -> None:
    engine = RecordingEngine(threaded=False)
    media = FakeMediaManager()
    legs, inbox = await started(engine, media)
    legs.execute("c1", OPEN_ASR)
    assert inbox.events == []  # never from inside execute
    assert await inbox.settle() == [AsrOpened("caller")]
    legs.execute("c1", OpenMedia("caller", None))
    assert await inbox.settle() == [MediaOpened("caller", 41000)]
    sink = media.opened["c1"].sink
    sink.on_audio(np.full(1600, 0.1, np.float32), 0)
    sink.on_dtmf("5", 100, 80)
    sink.on_inactive()
    assert await inbox.settle() == [Dtmf("caller", "5", 100, 80), MediaInactive("caller")]
    legs.execute("c1", CloseMedia("caller"))
    (closed,) = await inbox.settle()
    assert isinstance(closed, MediaClosed) and closed.audio_ms == 100 and closed.stats["rtp_codec"] == "PCMU"
    assert media.opened["c1"].closed and len(engine.streams["c1"].pcm) == 1600
    sink.on_audio(np.zeros(160, np.float32), 100)  # after the close nothing more is pushed
    legs.execute("c1", FinishAsr("caller"))
    final, ended = await inbox.settle()
    assert isinstance(final, Transcript) and final.event.text == "1600 samples"
    assert isinstance(ended, AsrEnded) and ended.event.reason == "finished"


async def test_a_refused_push_is_reported_once_and_stops_the_audio() -> None:
    engine = RecordingEngine(threaded=False)
    media = FakeMediaManager()
    legs, inbox = await started(engine, media)
    legs.execute("c1", OPEN_ASR)
    legs.execute("c1", OpenMedia("caller", None))
    await inbox.settle()
    engine.streams["c1"].closed = True
    for _ in range(3):
        media.opened["c1"].sink.on_audio(np.zeros(160, np.float32), 0)
    (refused,) = await inbox.settle()
    assert isinstance(refused, AudioRefused)


async def test_finishing_a_dead_stream_ends_it_with_an_error() -> None:
    engine = RecordingEngine(threaded=False)
    legs, inbox = await started(engine)
    legs.execute("c1", OPEN_ASR)
    await inbox.settle()
    engine.streams["c1"].finished = True  # finish() now raises StreamClosedError
    legs.execute("c1", FinishAsr("caller"))
    (ended,) = await inbox.settle()
    assert isinstance(ended, AsrEnded) and ended.event.reason == "error" and ended.event.stream_id == "c1"


@pytest.mark.parametrize(
    ("engine", "unknown_language"),
    [(RecordingEngine(threaded=False, languages=("de-DE",)), True), (RecordingEngine(threaded=False), False)],
)
async def test_a_refused_stream_says_whether_its_language_was_the_reason(
    engine: RecordingEngine, unknown_language: bool
) -> None:
    if not unknown_language:
        engine.stopped = True
    legs, inbox = await started(engine)
    legs.execute("c1", OPEN_ASR)
    (refused,) = await inbox.settle()
    assert isinstance(refused, AsrRefused) and refused.unknown_language is unknown_language


async def test_no_port_is_reported_as_exhausted() -> None:
    legs, inbox = await started(media=FakeMediaManager(fail=True))
    legs.execute("c1", OpenMedia("caller", None))
    (failed,) = await inbox.settle()
    assert isinstance(failed, MediaFailed) and failed.exhausted


async def test_a_discarded_call_closes_what_is_open_and_a_port_that_arrives_later() -> None:
    engine = RecordingEngine(threaded=False)
    media = FakeMediaManager(held=True)
    legs, inbox = await started(engine, media)
    legs.execute("c1", OPEN_ASR)
    legs.execute("c1", OpenMedia("caller", None))
    await inbox.settle()  # AsrOpened; the port is still opening
    legs.discard("c1")
    assert engine.streams["c1"].closed
    media.release.set()
    assert await inbox.settle() == []  # nothing reported for a discarded call
    assert media.opened["c1"].closed
    await legs.close()
