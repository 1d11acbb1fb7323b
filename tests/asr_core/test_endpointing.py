"""Endpointing by the audio with the shipped demo model: the VAD closes utterances through flushes,
and the transcript is what it would be without them.

Held-out clips shipped with the model (asr_core/demo_model/clips: espeak-ng speech through G.711,
0.3-0.6 s of line silence around it) are streamed alone and back to back in one stream. The VAD
ends utterances at the pauses between words too, so every clip gives several finals.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from asr_core.api import AsrEvent, StreamEnded, StreamOptions, TranscriptEvent
from asr_core.config import DecoderConfig, EngineConfig, SchedulerConfig
from asr_core.engine import AsrEngine
from asr_core.model import AsrModel, embedded_model_dir
from asr_core.vad import VadConfig
from tools.transcribe import read_audio

CLIPS = Path(__file__).resolve().parents[2] / "asr_core" / "demo_model" / "clips"
BLOCK = 1280  # 80 ms pushes, as the gateway's media blocks


@pytest.fixture(scope="module")
def model() -> AsrModel:
    d = embedded_model_dir()
    assert d is not None, "the demo model ships with the package"
    return AsrModel.load(d, "f32")


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    rows = [json.loads(x) for x in (CLIPS / "manifest.jsonl").read_text().splitlines() if x.strip()]
    return [read_audio(CLIPS / r["audio"]) for r in rows if r["lang"] == "en-US"]


def stream(model: AsrModel, audio: np.ndarray, vad: VadConfig, mode: str = "batched") -> list[AsrEvent]:
    cfg = EngineConfig(
        scheduler=SchedulerConfig(max_queued_chunks=1000),
        decoder=DecoderConfig(mode=mode),  # type: ignore[arg-type]
        vad=vad,
    )
    events: list[AsrEvent] = []
    done = threading.Event()

    def on_event(ev: AsrEvent) -> None:
        events.append(ev)
        if isinstance(ev, StreamEnded):
            done.set()

    with AsrEngine(model, cfg) as eng:
        s = eng.open_stream("s", StreamOptions(language="en-US"), on_event)
        for i in range(0, len(audio), BLOCK):
            s.push(audio[i : i + BLOCK])
        s.finish()
        assert done.wait(60)
    return events


def finals(events: list[AsrEvent]) -> list[TranscriptEvent]:
    return [e for e in events if isinstance(e, TranscriptEvent) and e.kind == "final"]


def text(events: list[AsrEvent]) -> str:
    return " ".join(f.text for f in finals(events))


def test_vad_finals_say_what_the_stream_says_without_them(model: AsrModel, clips: list[np.ndarray]) -> None:
    """Up to decoding ties: a flush decodes its real frames with silence as their right context,
    not the audio that follows, so a word whose pieces were a close call (a name, "charge|d") may
    come out otherwise; at most one word per clip."""
    import jiwer

    split = 0
    changed = 0
    for audio in clips:
        with_vad = stream(model, audio, VadConfig())
        without = stream(model, audio, VadConfig(kind="off"))
        diff = jiwer.process_words(text(without), text(with_vad))
        assert diff.substitutions + diff.deletions + diff.insertions <= 1, (text(without), text(with_vad))
        changed += text(with_vad) != text(without)
        assert len(finals(without)) == 1
        split += len(finals(with_vad)) - 1
        end = with_vad[-1]
        assert isinstance(end, StreamEnded) and end.stats["flushes"] >= 1
    assert split > 0  # the VAD really closed utterances at pauses inside the clips
    assert changed <= len(clips) // 3


def test_a_word_never_splits_across_finals(model: AsrModel, clips: list[np.ndarray]) -> None:
    from asr_core.tokenizer import Tokenizer

    tok = Tokenizer.from_bundle(model.bundle)
    later = 0
    for audio in [*clips, np.concatenate(clips[:3])]:
        for mode in ("batched", "workers"):
            fins = finals(stream(model, audio, VadConfig(), mode))
            for f in fins[1:]:
                first = next(t for t in f.token_ids if not tok.pieces[t].startswith("<"))  # tags
                assert tok.starts_word(first), f.text  # each later final opens with a new word
            later += len(fins) - 1
    assert later > len(clips)  # finals that could have split a word


def test_two_utterances_in_one_stream_read_as_each_streamed_alone(
    model: AsrModel, clips: list[np.ndarray]
) -> None:
    """The flush after the first utterance leaves the stream's caches as they were, so the second
    reads as it does streamed alone. (Clips 2 and 3 are left out of the "alone" comparison: after
    clip 2, the model's own left context changes the name in clip 3, with or without the VAD.)"""
    gap = np.zeros(16000 * 6 // 10, np.float32)
    for i, (a, b) in enumerate(itertools.pairwise(clips[:4])):
        together = text(stream(model, np.concatenate([a, gap, b]), VadConfig()))
        assert together == text(stream(model, np.concatenate([a, gap, b]), VadConfig(kind="off")))
        if i < 2:
            assert together == f"{text(stream(model, a, VadConfig()))} {text(stream(model, b, VadConfig()))}"


def test_chunks_after_a_flush_say_whether_the_caller_stayed_silent(model: AsrModel) -> None:
    from asr_core.frontend import FrontEndFactory

    spec = model.frontend_spec(VadConfig(kind="energy"))
    front = FrontEndFactory(spec).stream(spec.default_lookahead)
    t = np.arange(16000) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    quiet = np.zeros(16000, np.float32)
    audio = np.concatenate([quiet[:8000], tone, quiet, tone, quiet])
    seen = []
    for i in range(0, len(audio), BLOCK):
        seen += ["flush" if p.flush else p.silent_since_flush for p in front.push(audio[i : i + BLOCK])]
    # Not before the first flush; after each, until the next speech starts.
    assert [k for k, _ in itertools.groupby(seen)] == [False, "flush", True, False, "flush", True]


def test_a_final_waits_for_the_last_word_the_model_says_late(model: AsrModel) -> None:
    """Clip 0's "me" comes from the model after the VAD's decision and past the flush's real frames
    (its padding gives it as a whole word): the final waits for those frames while the caller stays
    silent, so the utterance is one final and not "... for" then "me" at the next pause."""
    first = read_audio(CLIPS / "test-000000.wav")
    audio = np.concatenate([first, np.zeros(16000, np.float32)])
    for mode in ("batched", "workers", "device"):
        (last, *_) = reversed(finals(stream(model, audio, VadConfig(), mode)))
        assert last.text.endswith("eight for me") and not last.at_end_of_stream, last


def test_a_caller_who_goes_on_at_once_gets_the_final_as_it_was(model: AsrModel) -> None:
    """Clip 1's speech starts right at the VAD's decision after clip 0's "me": the held final goes
    out as it was, and the late word opens the next utterance. (The frames behind the padding can
    hold the new speech's first pieces too: joining them to the final would cut a word in two.)"""
    first, second = (read_audio(CLIPS / f"test-00000{i}.wav") for i in (0, 1))
    audio = np.concatenate([first[: int(4.98 * 16000)], second[int(np.argmax(np.abs(second) > 0.01)) :]])
    for mode in ("batched", "workers", "device"):
        texts = [f.text for f in finals(stream(model, audio, VadConfig(), mode))]
        assert texts[-2].endswith("eight for") and texts[-1].startswith("me yes"), texts


def test_words_have_times_inside_their_final_in_order_and_a_confidence(
    model: AsrModel, clips: list[np.ndarray]
) -> None:
    for audio in clips:
        for f in finals(stream(model, audio, VadConfig())):
            assert " ".join(w.word for w in f.words) == f.text
            for w in f.words:
                assert f.start_ms <= w.start_ms <= w.end_ms <= f.end_ms
                assert 0.0 <= w.confidence <= 1.0
            for w1, w2 in itertools.pairwise(f.words):
                assert w1.end_ms <= w2.start_ms
