"""AsrEngine threads and hand-offs, against a small deterministic fake model (no MLX, no ORT).

The fake encoder keeps per-slot state that every chunk changes, so a chunk encoded in the wrong slot,
out of order or twice changes the output: "same tokens as solo" is a real check of the plumbing.
The real-model acceptance tests are in test_engine_tiny.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from asr_core.api import AsrEvent, StreamEnded, StreamOptions, TranscriptEvent
from asr_core.config import DecoderConfig, EndpointConfig, EngineConfig, SchedulerConfig
from asr_core.engine import AsrEngine
from asr_core.errors import EngineFullError, EngineStoppedError, StreamClosedError
from asr_core.transcript import Token
from asr_core.vad import VadConfig

HOP = 160
VOCAB = ["▁a", "b", "▁c", "d", "▁e", "<en-US>"]


class FakeFrontEnd:
    """Mel frame t = mean |x| of samples [160t, 160t+160); chunks of 1+8r, then 8(r+1) frames."""

    def __init__(self, lookahead: int) -> None:
        self.r = lookahead
        self.buf = np.zeros(0, np.float32)
        self.frames: list[float] = []
        self.sent = 0

    def _take(self, final: bool) -> list[np.ndarray]:
        out = []
        while True:
            need = 1 + 8 * self.r if self.sent == 0 else 8 * (self.r + 1)
            have = len(self.frames) - self.sent
            if have >= need or (final and have > 0):
                n = min(need, have)
                out.append(
                    np.asarray(self.frames[self.sent : self.sent + n], np.float32)[:, None].repeat(4, 1)
                )
                self.sent += n
            else:
                return out

    def push(self, pcm: np.ndarray) -> list[np.ndarray]:
        self.buf = np.concatenate([self.buf, pcm])
        n = len(self.buf) // HOP
        self.frames += [float(np.abs(self.buf[i * HOP : (i + 1) * HOP]).mean()) for i in range(n)]
        self.buf = self.buf[n * HOP :]
        return self._take(final=False)

    def finish(self) -> tuple[list[np.ndarray], bool]:
        full = self._take(final=False)
        rest = self._take(final=True)
        return full + rest, bool(rest)

    def flush(self) -> tuple[np.ndarray, int]:
        rest = self.frames[self.sent :]
        if not self.frames:
            return np.zeros((0, 4), np.float32), 0
        need = (1 + 8 * self.r if self.sent == 0 else 8 * (self.r + 1)) + 8 * (self.r + 1)
        padded = rest + [self.frames[-1]] * (need - len(rest))
        return np.asarray(padded, np.float32)[:, None].repeat(4, 1), -(-len(rest) // 8)


class FakeEncoder:
    """Per slot: a running sum that every chunk updates; frames = f(state, chunk) per 8 mel frames."""

    def __init__(
        self, fail_on_step: int | None = None, delay_s: float = 0.0, max_streams: int | None = None
    ) -> None:
        self.max_streams = max_streams
        self.slots: dict[int, list[float]] = {}
        self.free: list[int] = []
        self.next_slot = 0
        self.batch_sizes: list[int] = []
        self.fail_on_step = fail_on_step
        self.delay_s = delay_s
        self.thread_names: set[str] = set()
        self.warmups: list[tuple[int, int, int, int]] = []

    def warmup(self, lookahead: int, max_batch: int, streams: int = 0) -> int:
        self.thread_names.add(threading.current_thread().name)
        self.warmups.append((lookahead, max_batch, streams, len(self.batch_sizes)))
        if self.max_streams is not None:  # as the real one splits its pools for the streams expected
            self.max_streams = max(self.max_streams, streams)
        return 1

    def alloc(self, prompt_id: int, lookahead: int) -> int:
        self.thread_names.add(threading.current_thread().name)
        slot = self.free.pop() if self.free else self.next_slot
        self.next_slot = max(self.next_slot, slot + 1)
        self.slots[slot] = [float(prompt_id), float(lookahead), 0.0]
        return slot

    def release(self, slot: int) -> None:
        del self.slots[slot]
        self.free.append(slot)

    def step(self, rows: Sequence[tuple[int, np.ndarray, bool, bool]]) -> list[np.ndarray]:
        self.thread_names.add(threading.current_thread().name)
        self.batch_sizes.append(len(rows))
        if self.fail_on_step is not None and len(self.batch_sizes) >= self.fail_on_step:
            raise RuntimeError("device lost")
        if self.delay_s:
            time.sleep(self.delay_s)
        slots = [r[0] for r in rows]
        assert len(set(slots)) == len(slots), "a slot twice in one step"
        out = []
        for slot, mel, is_last, flush in rows:
            st = list(self.slots[slot]) if flush else self.slots[slot]  # a flush changes no state
            r = int(st[1])
            n_out = -(-len(mel) // 8) if is_last or flush or len(mel) < 8 * (r + 1) else r + 1
            if len(mel) == 1 + 8 * r and st[2] == 0.0:
                n_out = r + 1
            frames = []
            for j in range(n_out):
                seg = mel[j * len(mel) // n_out : (j + 1) * len(mel) // n_out, 0]
                st[2] = 0.7 * st[2] + float(seg.mean()) + 0.01 * st[0]
                frames.append(st[2])
            out.append(np.asarray(frames, np.float32)[:, None].repeat(3, 1))
        return out


class FakeDecoder:
    """Emits a token whenever the frame value exceeds a threshold; the state counts tokens."""

    def __init__(self, fail_stream_marker: float | None = None) -> None:
        self.fail_marker = fail_stream_marker

    def new_state(self) -> list[int]:
        return [0]

    def decode(self, state: list[int], frames: np.ndarray, first_frame: int) -> list[Token]:
        toks = []
        for i, f in enumerate(frames[:, 0]):
            if self.fail_marker is not None and f > self.fail_marker:
                raise RuntimeError("joiner exploded")
            if f > 0.15:
                toks.append(Token(state[0] % (len(VOCAB) - 1), first_frame + i))
                state[0] += 1
        return toks

    def decode_batch(
        self, states: Sequence[Any], frames: Sequence[np.ndarray], first_frames: Sequence[int]
    ) -> list[list[Token]]:
        return [self.decode(s, f, f0) for s, f, f0 in zip(states, frames, first_frames, strict=True)]


class FakeText:
    def decode(self, ids: Sequence[int]) -> tuple[str, str | None]:
        return "".join(VOCAB[i] for i in ids if not VOCAB[i].startswith("<")).replace("▁", " ").strip(), None

    def starts_word(self, token_id: int) -> bool:
        return VOCAB[token_id].startswith("▁")


class FakeModel:
    def __init__(self, encoder: FakeEncoder | None = None, decoder: FakeDecoder | None = None) -> None:
        self._encoder = encoder or FakeEncoder()
        self._decoder = decoder or FakeDecoder()
        self.decoders_made = 0

    lookaheads = (0, 3, 6, 13)
    default_lookahead = 3

    @property
    def text(self) -> FakeText:
        return FakeText()

    @property
    def encoder(self) -> FakeEncoder:
        return self._encoder

    def create_encoder(self) -> FakeEncoder:
        return self._encoder

    def prompt_id(self, language: str) -> int:
        table = {"auto": 101, "en-US": 0, "uk-UA": 19}
        if language not in table:
            raise ValueError(f"unknown language {language!r}")
        return table[language]

    def new_frontend(self, lookahead: int) -> FakeFrontEnd:
        return FakeFrontEnd(lookahead)

    def new_decoder(self) -> FakeDecoder:
        self.decoders_made += 1
        return self._decoder

    def new_batch_decoder(self) -> FakeDecoder:
        self.decoders_made += 1
        return self._decoder


def speechy(seconds: float, seed: int) -> np.ndarray:
    """Bursts of loud noise with quiet gaps: gives tokens, pauses and finals in the fake model."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    env = (np.sin(np.arange(n) / 16000 * 2 * np.pi * (0.3 + 0.1 * (seed % 5))) > -0.2).astype(np.float32)
    return (rng.standard_normal(n).astype(np.float32) * 0.3 * env).clip(-1, 1)


class Collector:
    def __init__(self) -> None:
        self.events: list[AsrEvent] = []
        self.done = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, ev: AsrEvent) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(ev)
        if isinstance(ev, StreamEnded):
            self.done.set()

    @property
    def ended(self) -> StreamEnded:
        assert self.done.wait(10), "no StreamEnded"
        last = self.events[-1]
        assert isinstance(last, StreamEnded)
        return last

    @property
    def finals(self) -> list[TranscriptEvent]:
        return [e for e in self.events if isinstance(e, TranscriptEvent) and e.kind == "final"]

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.finals for t in e.token_ids]


def config(mode: str = "workers", workers: int = 2, vad: str = "webrtc", **sched: Any) -> EngineConfig:
    s = {"max_batch": 8, "max_wait_ms": 2.0, "max_queued_chunks": 1000}
    s.update(sched)
    return EngineConfig(
        scheduler=SchedulerConfig(**s),
        decoder=DecoderConfig(mode=mode, workers=workers),  # type: ignore[arg-type]
        endpoint=EndpointConfig(blank_ms=240, energy_db=-30.0, max_blank_ms=480, partial_interval_ms=0),
        vad=VadConfig(kind=vad),  # type: ignore[arg-type]
    )


def solo(audio: np.ndarray, lookahead: int = 3, language: str = "en-US", block: int = 2560) -> Collector:
    with AsrEngine(FakeModel(), config()) as eng:
        c = Collector()
        s = eng.open_stream("solo", StreamOptions(language=language, lookahead=lookahead), c)
        for i in range(0, len(audio), block):
            s.push(audio[i : i + block])
        s.finish()
        c.ended  # noqa: B018
    return c


def test_one_stream_gives_finals_then_stream_ended_last() -> None:
    audio = speechy(6.0, seed=1)
    c = solo(audio)
    end = c.ended
    assert end.reason == "finished" and end.audio_ms == 6000 and end.chunks > 0
    assert c.finals and all(isinstance(e, TranscriptEvent) for e in c.events[:-1])
    assert [f.segment_id for f in c.finals] == list(range(len(c.finals)))
    assert c.finals[-1].end_ms <= 6000


@pytest.mark.parametrize("mode", ["workers", "batched"])
def test_concurrent_streams_each_match_their_solo_run(mode: str) -> None:
    """Streams with different lengths, languages and lookaheads, joining and leaving mid-way."""
    specs = [(2.0 + i * 0.7, ["en-US", "uk-UA", "auto"][i % 3], [0, 3, 6, 13][i % 4]) for i in range(10)]
    audios = [speechy(sec, seed=i) for i, (sec, _, _) in enumerate(specs)]
    expected = [solo(a, la, lang).tokens for a, (_, lang, la) in zip(audios, specs, strict=True)]
    assert all(expected)
    model = FakeModel()
    with AsrEngine(model, config(mode=mode, workers=3)) as eng:
        cols = [Collector() for _ in specs]
        streams: list[Any] = [None] * len(specs)
        pos = [0] * len(specs)
        block = 1280
        # round-robin pushes; stream i joins at round 3*i, so streams join while others run and end
        for rnd in range(2000):
            busy = False
            for i, (_, lang, la) in enumerate(specs):
                if rnd < 3 * i:
                    busy = True
                    continue
                if streams[i] is None:
                    streams[i] = eng.open_stream(f"s{i}", StreamOptions(language=lang, lookahead=la), cols[i])
                if pos[i] < len(audios[i]):
                    streams[i].push(audios[i][pos[i] : pos[i] + block])
                    pos[i] += block
                    busy = True
                    if pos[i] >= len(audios[i]):
                        streams[i].finish()
            if not busy:
                break
        for i, c in enumerate(cols):
            assert c.ended.reason == "finished"
            assert c.tokens == expected[i], f"stream {i}"
    assert max(model.encoder.batch_sizes) > 1  # really batched
    assert model.encoder.slots == {}  # every slot released
    assert model.encoder.thread_names == {"asr-encoder"}  # one MLX owner


def test_decoder_error_ends_only_that_stream_with_reason_error() -> None:
    model = FakeModel(decoder=FakeDecoder(fail_stream_marker=5.0))
    with AsrEngine(model, config(workers=1)) as eng:
        good, bad = Collector(), Collector()
        sg = eng.open_stream("good", StreamOptions(), good)
        sb = eng.open_stream("bad", StreamOptions(), bad)
        sb.push(np.full(16000, 0.9, np.float32) * 0 + 0.99)  # large frames -> the fake joiner fails
        sg.push(speechy(2.0, seed=3))
        end = bad.ended
        assert end.reason == "error" and "joiner exploded" in (end.error or "")
        with pytest.raises(StreamClosedError):
            for _ in range(10):  # the close reaches the scheduler asynchronously
                sb.push(np.zeros(16000, np.float32))
                time.sleep(0.05)
        sg.finish()
        assert good.ended.reason == "finished"
    assert model.encoder.slots == {}


def test_encoder_failure_stops_the_engine_loudly() -> None:
    fatal: list[BaseException] = []
    model = FakeModel(encoder=FakeEncoder(fail_on_step=2))
    eng = AsrEngine(model, config(), on_fatal=fatal.append).start()
    cols = [Collector() for _ in range(3)]
    streams = [eng.open_stream(f"s{i}", StreamOptions(), c) for i, c in enumerate(cols)]
    with pytest.raises(EngineStoppedError):  # pushes fail once the MLX thread died
        for _ in range(100):
            for s in streams:
                s.push(speechy(0.5, seed=0))
            time.sleep(0.01)
    for c in cols:
        assert c.ended.reason == "error"
    assert fatal and "device lost" in str(fatal[0])
    assert eng.failure is fatal[0]
    with pytest.raises(EngineStoppedError):
        eng.open_stream("late", StreamOptions(), Collector())
    with pytest.raises(EngineStoppedError):
        streams[0].finish()
    eng.shutdown(timeout=2.0)


def test_close_ends_with_reason_closed_and_frees_the_slot() -> None:
    model = FakeModel()
    with AsrEngine(model, config()) as eng:
        c = Collector()
        s = eng.open_stream("x", StreamOptions(), c)
        s.push(speechy(3.0, seed=2))
        s.close()
        s.close()
        assert c.ended.reason == "closed"
        with pytest.raises(StreamClosedError):
            s.push(np.zeros(100, np.float32))
    assert model.encoder.slots == {}


def test_shutdown_drains_open_streams_with_finals() -> None:
    eng = AsrEngine(FakeModel(), config(vad="off")).start()  # the last final: the end of stream
    cols = [Collector() for _ in range(4)]
    for i, c in enumerate(cols):
        eng.open_stream(f"s{i}", StreamOptions(), c).push(speechy(3.0, seed=i))
    eng.shutdown()
    for c in cols:
        assert c.ended.reason == "finished"
        assert (c.finals and c.finals[-1].at_end_of_stream) or not c.tokens
    with pytest.raises(EngineStoppedError):
        eng.open_stream("late", StreamOptions(), Collector())


def test_overload_drops_are_counted_in_hooks_and_stream_ended() -> None:
    class Hooks:
        def __init__(self) -> None:
            self.dropped: list[str] = []
            self.steps: list[int] = []

        def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
            self.steps.append(batch_size)

        def decoder_step(self, seconds: float, n_streams: int) -> None:
            pass

        def chunk_dropped(self, stream_id: str) -> None:
            self.dropped.append(stream_id)

        def transcript(self, kind: str, latency_s: float) -> None:
            pass

        def time_to_final(self, seconds: float) -> None:
            pass

    hooks = Hooks()
    model = FakeModel(encoder=FakeEncoder(delay_s=0.05))
    with AsrEngine(model, config(max_queued_chunks=3), hooks) as eng:
        c = Collector()
        s = eng.open_stream("slow", StreamOptions(lookahead=0), c)
        audio = speechy(4.0, seed=4)
        for i in range(0, len(audio), 1280):
            s.push(audio[i : i + 1280])  # 50 chunks at once, 50 ms per step: the queue overflows
        s.finish()
        end = c.ended
    assert end.reason == "finished"
    assert end.dropped_chunks == len(hooks.dropped) > 0
    assert set(hooks.dropped) == {"slow"}


def test_events_arrive_on_decoder_threads_and_decoders_are_per_worker() -> None:
    model = FakeModel()
    with AsrEngine(model, config(workers=3)) as eng:
        c = Collector()
        s = eng.open_stream("x", StreamOptions(), c)
        s.push(speechy(1.0, seed=0))
        s.finish()
        c.ended  # noqa: B018
    assert model.decoders_made == 3
    assert len(c.threads) == 1 and next(iter(c.threads)).startswith("asr-decoder-")


def test_bad_input_is_a_clear_error_and_the_stream_survives() -> None:
    with AsrEngine(FakeModel(), config()) as eng:
        c = Collector()
        s = eng.open_stream("x", StreamOptions(), c)
        with pytest.raises(ValueError, match="float"):
            s.push(np.zeros(160, np.int16))
        with pytest.raises(ValueError, match="1-D"):
            s.push(np.zeros((2, 160), np.float32))
        with pytest.raises(ValueError, match="NaN"):
            s.push(np.array([np.nan], np.float32))
        s.push(np.zeros(160, np.float64))  # float64 is converted
        s.finish()
        assert c.ended.reason == "finished"
        with pytest.raises(ValueError, match="unknown language"):
            eng.open_stream("y", StreamOptions(language="xx-XX"), c)
        with pytest.raises(ValueError, match="lookahead 5 not supported"):
            eng.open_stream("y", StreamOptions(lookahead=5), c)


def test_empty_stream_finishes_cleanly() -> None:
    model = FakeModel()
    with AsrEngine(model, config()) as eng:
        c = Collector()
        eng.open_stream("x", StreamOptions(), c).finish()
        end = c.ended
    assert (end.reason, end.audio_ms, end.chunks) == ("finished", 0, 0)
    assert c.events == [end] and model.encoder.slots == {}


def test_a_failing_callback_or_hook_does_not_stop_the_stream() -> None:
    class BadHooks:
        def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
            raise RuntimeError("metrics bug")

        def decoder_step(self, seconds: float, n_streams: int) -> None:
            raise RuntimeError("metrics bug")

        def chunk_dropped(self, stream_id: str) -> None:
            raise RuntimeError("metrics bug")

        def transcript(self, kind: str, latency_s: float) -> None:
            raise RuntimeError("metrics bug")

        def time_to_final(self, seconds: float) -> None:
            raise RuntimeError("metrics bug")

    seen: list[AsrEvent] = []
    done = threading.Event()

    def flaky(ev: AsrEvent) -> None:
        seen.append(ev)
        if isinstance(ev, StreamEnded):
            done.set()
        else:
            raise ValueError("receiver bug")

    with AsrEngine(FakeModel(), config(), BadHooks()) as eng:
        s = eng.open_stream("x", StreamOptions(), flaky)
        s.push(speechy(3.0, seed=5))
        s.finish()
        assert done.wait(10)
    assert isinstance(seen[-1], StreamEnded) and seen[-1].reason == "finished"
    assert any(isinstance(e, TranscriptEvent) and e.kind == "final" for e in seen)


def test_engine_warms_the_encoder_up_on_its_mlx_thread_before_accepting_streams() -> None:
    # The GPU encoder traces its compiled step per batch bucket; the engine does it once at start
    # (default lookahead, max_batch, the streams it is sized for) so that no live step pays for a trace.
    model = FakeModel()
    with AsrEngine(model, dataclasses.replace(config(max_batch=24), streams=300)):
        assert model.encoder.warmups == [(3, 24, 300, 0)]
    assert model.encoder.thread_names == {"asr-encoder"}


def test_an_engine_whose_pools_are_full_refuses_new_streams_until_one_ends() -> None:
    with AsrEngine(FakeModel(FakeEncoder(max_streams=2)), config()) as eng:
        assert eng.max_streams == 2
        first, second = Collector(), Collector()
        a = eng.open_stream("a", StreamOptions(), first)
        eng.open_stream("b", StreamOptions(), second)
        with pytest.raises(EngineFullError, match="most streams"):
            eng.open_stream("c", StreamOptions(), Collector())
        a.close()
        assert first.ended.reason == "closed"
        third = Collector()
        eng.open_stream("c", StreamOptions(), third).finish()
        assert third.ended.reason == "finished"


def test_an_engines_stream_limit_is_the_encoders_after_its_warm_up() -> None:
    """Warm-up may lay the pools out for the streams expected (more than they held before)."""
    encoder = FakeEncoder(max_streams=2)
    with AsrEngine(FakeModel(encoder), dataclasses.replace(config(), streams=3)) as eng:
        assert eng.max_streams == 3
        for key in "abc":
            eng.open_stream(key, StreamOptions(), Collector())
        with pytest.raises(EngineFullError, match="most streams"):
            eng.open_stream("d", StreamOptions(), Collector())
