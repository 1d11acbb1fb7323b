"""TranscriptAssembler: endpointing and partial/final rules, with scripted tokens (no model)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asr_core.api import TranscriptEvent
from asr_core.config import EndpointConfig
from asr_core.transcript import Token, TranscriptAssembler

PIECES = ["▁hello", "▁world", "s", "▁how", "▁are", "▁you", "<en-US>", "<uk-UA>", "▁a", "b"]
ID = {p: i for i, p in enumerate(PIECES)}
TAG = re.compile(r"^<[a-z]{2,3}-[A-Za-z]{2}>$")

LOUD, QUIET = -20.0, -70.0


class FakeText:
    """SentencePiece-like: '▁' starts a word; language tags are stripped and reported."""

    def decode(self, ids: Sequence[int]) -> tuple[str, str | None]:
        lang = None
        parts = []
        for i in ids:
            p = PIECES[i]
            if TAG.match(p):
                lang = p[1:-1]
                continue
            parts.append(p)
        text = "".join(parts).replace("▁", " ")
        return re.sub(" +", " ", text).lstrip(), lang

    def starts_word(self, token_id: int) -> bool:
        return PIECES[token_id].startswith("▁")


def make(**kw: object) -> TranscriptAssembler:
    base: dict[str, object] = {
        "blank_ms": 800,
        "energy_db": -45.0,
        "max_blank_ms": 2000,
        "partial_interval_ms": 0,
    }
    base.update(kw)
    return TranscriptAssembler("s1", EndpointConfig(**base), FakeText())  # type: ignore[arg-type]


def feed(
    a: TranscriptAssembler,
    script: dict[int, list[str]],
    energies: list[float],
    chunk: int = 4,
) -> list[TranscriptEvent]:
    """Feed frames 0..len(energies) in chunks of `chunk` frames; script maps frame -> pieces."""
    events: list[TranscriptEvent] = []
    for start in range(0, len(energies), chunk):
        n = min(chunk, len(energies) - start)
        toks = [Token(ID[p], f) for f in range(start, start + n) for p in script.get(f, [])]
        events += a.update(toks, start, n, energies[start : start + n])
    return events


def finals(events: list[TranscriptEvent]) -> list[TranscriptEvent]:
    return [e for e in events if e.kind == "final"]


def test_a_pause_after_speech_closes_the_segment_with_a_final() -> None:
    # speech frames 0-9, silence 10-29; tokens at 3, 6, 9; pause 10 frames (800 ms) after frame 9
    energies = [LOUD] * 10 + [QUIET] * 20
    a = make()
    ev = feed(a, {3: ["▁hello"], 6: ["▁world"], 9: ["s"]}, energies)
    (fin,) = finals(ev)
    assert fin.text == "hello worlds" and fin.segment_id == 0 and not fin.at_end_of_stream
    assert fin.token_ids == (ID["▁hello"], ID["▁world"], ID["s"])
    # closed at the 10th blank frame after the last token, not at end of stream
    assert a.finish(audio_ms=30 * 80) == []


def test_two_utterances_give_two_finals_with_increasing_segment_ids_and_times() -> None:
    energies = [LOUD] * 8 + [QUIET] * 14 + [LOUD] * 8 + [QUIET] * 14
    a = make()
    ev = feed(a, {4: ["▁hello"], 7: ["▁world"], 26: ["▁how"], 29: ["▁are", "▁you"]}, energies)
    f0, f1 = finals(ev)
    assert (f0.segment_id, f0.text) == (0, "hello world")
    assert (f1.segment_id, f1.text) == (1, "how are you")
    # start moves back over the loud frames before the first token (at most 6 frames), end after the last
    assert (f0.start_ms, f0.end_ms) == (0, 8 * 80)
    assert (f1.start_ms, f1.end_ms) == (22 * 80, 30 * 80)


def test_no_final_while_speech_continues_with_token_gaps() -> None:
    # tokens 12 frames apart but the audio stays loud: not a pause (until max_blank)
    energies = [LOUD] * 40
    a = make(max_blank_ms=2000)
    ev = feed(a, {2: ["▁hello"], 14: ["▁world"], 26: ["▁how"]}, energies)
    assert finals(ev) == []
    (fin,) = a.finish(audio_ms=40 * 80)
    assert fin.text == "hello world how" and fin.at_end_of_stream


def test_long_token_silence_closes_the_segment_even_on_a_noisy_line() -> None:
    energies = [LOUD] * 60
    a = make(max_blank_ms=2000)  # 25 frames
    ev = feed(a, {2: ["▁hello"]}, energies)
    (fin,) = finals(ev)
    assert fin.text == "hello"


def test_without_energy_the_blank_run_alone_is_the_pause() -> None:
    a = make(energy_db=None)
    ev = a.update([Token(ID["▁hello"], 1)], 0, 4, None)
    ev += a.update([], 4, 8, None)  # frames 4..11: 10 blank frames after frame 1 reached at frame 11
    (fin,) = finals(ev)
    assert fin.text == "hello"


def test_final_at_end_of_stream_is_clipped_to_the_audio() -> None:
    a = make()
    feed(a, {5: ["▁hello"]}, [LOUD] * 6)
    (fin,) = a.finish(audio_ms=430)
    assert fin.at_end_of_stream and fin.end_ms == 430 and fin.start_ms <= fin.end_ms


def test_empty_stream_and_tag_only_segments_give_no_final() -> None:
    assert make().finish(audio_ms=0) == []
    a = make()
    ev = feed(a, {2: ["<en-US>"]}, [LOUD] * 4 + [QUIET] * 12)
    assert finals(ev) == [] and a.segment_id == 0


def test_a_text_less_segment_carries_its_tokens_into_the_next_final() -> None:
    energies = [QUIET] * 18 + [LOUD] * 4 + [QUIET] * 12
    a = make()
    ev = feed(a, {2: ["<en-US>"], 20: ["▁hello"]}, energies)
    (fin,) = finals(ev)
    assert fin.token_ids == (ID["<en-US>"], ID["▁hello"]) and fin.text == "hello"
    assert fin.detected_language == "en-US"
    assert fin.start_ms == 18 * 80  # its own speech, not the tag's time


def test_language_tags_are_stripped_and_reported() -> None:
    a = make()
    ev = feed(a, {1: ["▁hello"], 2: ["<uk-UA>"], 3: ["▁world"]}, [LOUD] * 4 + [QUIET] * 12)
    (fin,) = finals(ev)
    assert fin.text == "hello world" and fin.detected_language == "uk-UA"


def test_partials_only_when_the_text_grows() -> None:
    a = make()
    ev = feed(a, {1: ["▁hello"], 9: ["▁world"]}, [LOUD] * 16, chunk=4)
    partials = [e.text for e in ev if e.kind == "partial"]
    assert partials == ["hello", "hello world"]  # chunks without new text gave nothing


def test_partials_are_throttled_by_media_time() -> None:
    # the text grows every frame ("a", "ab", "abb", ...): length = frame + 1
    script = {0: ["▁a"]} | {f: ["b"] for f in range(1, 40)}
    a = make(partial_interval_ms=640)  # at most one partial per 8 frames
    ev = feed(a, script, [LOUD] * 40, chunk=4)
    assert [len(e.text) for e in ev if e.kind == "partial"] == [4, 12, 20, 28, 36]


def test_partials_can_be_disabled() -> None:
    a = make(partials=False)
    ev = feed(a, {1: ["▁hello"]}, [LOUD] * 8)
    assert [e.kind for e in ev] == []


def test_long_segment_is_cut_before_a_word_initial_token() -> None:
    script = {f: (["▁a"] if f % 2 == 0 else ["b"]) for f in range(0, 30)}
    a = make(max_segment_ms=800)  # 10 frames
    ev = feed(a, script, [LOUD] * 30)
    texts = [e.text for e in finals(ev)]
    assert texts and all(t.split() == ["ab"] * len(t.split()) for t in texts)
    assert all(len(t.split()) <= 6 for t in texts)


def test_dropped_chunks_leave_a_gap_that_is_not_counted_as_quiet() -> None:
    a = make(max_blank_ms=4000)
    ev = a.update([Token(ID["▁hello"], 1)], 0, 4, [LOUD] * 4)
    ev += a.update([], 16, 4, [QUIET] * 4)  # frames 4..15 dropped
    assert finals(ev) == []  # only 4 quiet frames known
    ev += a.update([], 20, 8, [QUIET] * 8)
    assert [e.text for e in finals(ev)] == ["hello"]


def test_chunks_must_come_in_order_and_tokens_inside_their_chunk() -> None:
    a = make()
    a.update([], 0, 4, [QUIET] * 4)
    with pytest.raises(ValueError, match="before frame 4"):
        a.update([], 2, 4, [QUIET] * 4)
    with pytest.raises(ValueError, match="outside the chunk"):
        a.update([Token(0, 99)], 4, 4, [QUIET] * 4)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(PIECES) - 1), st.booleans(), st.booleans()),
        min_size=1,
        max_size=80,
    ),
    st.sampled_from([1, 4, 7]),
)
def test_every_partial_is_a_prefix_of_the_next_partial_and_of_its_final(
    frames: list[tuple[int, bool, bool]], chunk: int
) -> None:
    script = {i: [PIECES[tok]] for i, (tok, emit, _) in enumerate(frames) if emit}
    energies = [LOUD if loud else QUIET for _, _, loud in frames]
    a = make(blank_ms=240, max_blank_ms=480)
    events = feed(a, script, energies, chunk=chunk) + a.finish(audio_ms=len(frames) * 80)
    by_segment: dict[int, list[TranscriptEvent]] = {}
    for e in events:
        by_segment.setdefault(e.segment_id, []).append(e)
    for seg, evs in by_segment.items():
        kinds = [e.kind for e in evs]
        assert kinds.count("final") <= 1 and (kinds[-1] == "final" or seg == a.segment_id)
        for prev, nxt in itertools.pairwise(evs):
            assert nxt.text.startswith(prev.text)
            assert prev.start_ms <= prev.end_ms
    assert a.prefix_violations == 0
    assert [e.segment_id for e in events if e.kind == "final"] == list(range(a.segment_id))


def test_speech_ended_closes_the_segment_at_once_and_late_pieces_join_its_last_word() -> None:
    a = make()
    ev = feed(a, {1: ["▁hello"], 3: ["▁world"]}, [LOUD] * 4)
    assert not finals(ev)
    (fin,) = a.speech_ended([Token(ID["s"], 5, 0.5)])  # a late piece from the flush's padding
    assert fin.text == "hello worlds" and fin.end_ms == 6 * 80 and not fin.at_end_of_stream
    assert [w.word for w in fin.words] == ["hello", "worlds"] and fin.words[-1].confidence == 0.5
    assert a.speech_ended() == []  # nothing open


def test_a_piece_continuing_the_last_word_of_a_final_is_dropped_not_split_off() -> None:
    a = make()
    feed(a, {1: ["▁hello"], 3: ["▁world"]}, [LOUD] * 4)
    a.speech_ended()
    ev = a.update([Token(ID["s"], 4), Token(ID["▁how"], 5)], 4, 4, [LOUD] * 4)
    ev += a.finish()
    assert [f.text for f in finals(ev)] == ["how"] and a.orphan_pieces == 1


def test_words_lie_inside_their_event_in_order_with_the_lowest_piece_probability() -> None:
    a = make(words="all")
    toks = [Token(ID["▁hello"], 2, 0.9), Token(ID["▁world"], 5, 0.8), Token(ID["s"], 6, 0.3)]
    toks += [Token(ID["▁how"], 6, 0.7), Token(ID["<en-US>"], 7, 0.99), Token(ID["▁are"], 9, 1.0)]
    ev = a.update(toks, 0, 10, [LOUD] * 10) + a.finish(audio_ms=740)
    partial, final = ev[0], finals(ev)[0]
    for e in (partial, final):
        assert " ".join(w.word for w in e.words) == e.text == "hello worlds how are"
        assert [w.confidence for w in e.words] == [0.9, 0.3, 0.7, 1.0]
        for w in e.words:
            assert e.start_ms <= w.start_ms <= w.end_ms <= e.end_ms
        for w1, w2 in itertools.pairwise(e.words):
            assert w1.end_ms <= w2.start_ms
    assert [(w.start_ms, w.end_ms) for w in final.words] == [(160, 240), (400, 480), (480, 560), (720, 740)]


def test_words_only_where_configured() -> None:
    for mode, partial_words, final_words in [
        ("off", False, False),
        ("final", False, True),
        ("all", True, True),
    ]:
        a = make(words=mode)
        ev = feed(a, {1: ["▁hello"]}, [LOUD] * 4) + a.finish()
        assert [bool(e.words) for e in ev] == [partial_words, final_words]
