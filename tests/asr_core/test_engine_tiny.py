"""Acceptance tests of the engine with the real parts (tiny bundle: MLX encoder, ORT decoder,
tokenizer, features, chunker): batched == solo, 64 concurrent real-time streams, endpointing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asr_core.api import AsrEvent, StreamEnded, StreamOptions, TranscriptEvent
from asr_core.config import DecoderConfig, DecoderMode, EndpointConfig, EngineConfig, SchedulerConfig
from asr_core.engine import AsrEngine
from asr_core.errors import EngineStoppedError
from asr_core.frontend import StreamFrontEnd
from asr_core.model import AsrModel, EncoderBackend
from asr_core.vad import VadConfig
from tests.fixtures import peers
from tools.bench.engine import synthetic_call

SR = 16_000


@pytest.fixture(scope="module")
def tiny_model(tiny_bundle: Path) -> AsrModel:
    return AsrModel.load(tiny_bundle, "f32")


class Stream:
    """Collects one stream's events (called on a decoder thread)."""

    def __init__(self) -> None:
        self.events: list[AsrEvent] = []
        self.done = threading.Event()

    def __call__(self, ev: AsrEvent) -> None:
        self.events.append(ev)
        if isinstance(ev, StreamEnded):
            self.done.set()

    def wait(self, timeout: float = 60.0) -> StreamEnded:
        assert self.done.wait(timeout), "no StreamEnded"
        end = self.events[-1]
        assert isinstance(end, StreamEnded)
        return end

    @property
    def transcripts(self) -> list[TranscriptEvent]:
        return [e for e in self.events if isinstance(e, TranscriptEvent)]

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.transcripts if e.kind == "final" for t in e.token_ids]


class RecordingModel:
    """The tiny model with an encoder that records every slot's output frames (one 'life' per alloc)."""

    def __init__(self, model: AsrModel) -> None:
        self._model = model
        self.lives: list[list[np.ndarray]] = []
        self.batch_sizes: list[int] = []
        self.lookaheads = model.lookaheads
        self.default_lookahead = model.default_lookahead
        self.text = model.text
        self.prompt_id = model.prompt_id
        self.new_frontend = model.new_frontend
        self.new_decoder = model.new_decoder
        self.new_batch_decoder = model.new_batch_decoder
        self.new_device_decoder = model.new_device_decoder

    def create_encoder(self) -> EncoderBackend:
        inner = self._model.create_encoder()
        lives, current, batch_sizes = self.lives, {}, self.batch_sizes

        class Recorder:
            def alloc(self, prompt_id: int, lookahead: int) -> int:
                slot = inner.alloc(prompt_id, lookahead)
                current[slot] = []
                lives.append(current[slot])
                return slot

            def release(self, slot: int) -> None:
                inner.release(slot)

            def step(self, rows: Sequence[tuple[int, np.ndarray, bool, bool]]) -> list[np.ndarray]:
                out = inner.step(rows)
                batch_sizes.append(len(rows))
                for (slot, _, _, flush), frames in zip(rows, out, strict=True):
                    if not flush:
                        current[slot].append(np.array(frames, copy=True))
                return out

        return Recorder()


def config(mode: DecoderMode = "batched", *, device_thread: bool = True, **sched: Any) -> EngineConfig:
    s: dict[str, Any] = {"max_batch": 64, "max_wait_ms": 5.0, "max_queued_chunks": 16}
    s.update(sched)
    decoder = DecoderConfig(mode=mode, workers=2, device_thread=device_thread)
    return EngineConfig(scheduler=SchedulerConfig(**s), decoder=decoder)


def run_solo(engine: AsrEngine, audio: np.ndarray, options: StreamOptions, block: int = 1600) -> Stream:
    """The stream alone in the engine, fed as fast as the engine takes it (no drop)."""
    col = Stream()
    s = engine.open_stream("solo", options, col)
    for i in range(0, len(audio), block):
        while s.backlog >= 8:
            time.sleep(0.001)
        s.push(audio[i : i + block])
    s.finish()
    col.wait()
    return col


@pytest.mark.parametrize("mode", ["batched", "device"])
def test_batched_streams_equal_their_solo_runs_in_tokens_and_frames(
    tiny_model: AsrModel, mode: DecoderMode
) -> None:
    """Streams joining and leaving mid-way, of different lengths, languages and lookaheads, pushed in
    different block sizes: each one's tokens and events equal its solo run, frames within 1e-5."""
    langs = ["en-US", "uk-UA", "auto", "de-DE"]
    lookaheads = [3, 0, 13, 6]
    durations = [1.3, 2.1, 2.9, 3.6, 1.7, 4.4, 2.5, 3.2]
    blocks = [320, 1600, 5920]
    opts = [StreamOptions(language=langs[i % 4], lookahead=lookaheads[i % 4]) for i in range(len(durations))]
    audios = [synthetic_call(d, seed=10 + i) for i, d in enumerate(durations)]

    solo_model = RecordingModel(tiny_model)
    with AsrEngine(solo_model, config(mode="workers")) as eng:
        solos = [run_solo(eng, a, o) for a, o in zip(audios, opts, strict=True)]
    assert len(solo_model.lives) == len(audios)
    assert all(s.tokens for s in solos)

    model = RecordingModel(tiny_model)
    cols = [Stream() for _ in audios]
    with AsrEngine(model, config(mode=mode, max_queued_chunks=1000)) as eng:
        streams: list[Any] = [None] * len(audios)
        pos = [0] * len(audios)
        for rnd in range(10_000):
            busy = False
            for i, audio in enumerate(audios):
                if rnd < 2 * i:  # stream i joins at round 2i, while earlier ones run (and some end)
                    busy = True
                    continue
                if streams[i] is None:
                    streams[i] = eng.open_stream(f"s{i}", opts[i], cols[i])
                if pos[i] < len(audio):
                    b = blocks[i % len(blocks)]
                    streams[i].push(audio[pos[i] : pos[i] + b])
                    pos[i] += b
                    busy = True
                    if pos[i] >= len(audio):
                        streams[i].finish()
            if not busy:
                break
        ends = [c.wait() for c in cols]
    assert [e.reason for e in ends] == ["finished"] * len(audios)
    assert all(e.dropped_chunks == 0 for e in ends)

    for i, (solo, col) in enumerate(zip(solos, cols, strict=True)):
        assert col.tokens == solo.tokens, f"stream {i}: tokens differ from its solo run"
        assert [
            (e.kind, e.segment_id, e.text, e.start_ms, e.end_ms, e.token_ids) for e in col.transcripts
        ] == [(e.kind, e.segment_id, e.text, e.start_ms, e.end_ms, e.token_ids) for e in solo.transcripts], (
            f"stream {i}: events differ from its solo run"
        )

    # Frames: every solo life has exactly one batched life with the same frames (1e-5 in fp32).
    batched = [np.concatenate(life) for life in model.lives]
    assert len(batched) == len(audios)
    unmatched = set(range(len(batched)))
    for i, life in enumerate(solo_model.lives):
        ref = np.concatenate(life)
        same_shape = [j for j in unmatched if batched[j].shape == ref.shape]
        best = min(same_shape, key=lambda j: float(np.abs(batched[j] - ref).max()))
        err = float(np.abs(batched[best] - ref).max())
        assert err <= 1e-5, f"stream {i}: encoder frames differ by {err}"
        unmatched.discard(best)
    assert max(model.batch_sizes) >= 4  # real batches (of mixed lookaheads and languages)


class CountingHooks:
    def __init__(self) -> None:
        self.dropped = 0
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        with self.lock:
            self.batches.append(batch_size)

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        pass

    def chunk_dropped(self, stream_id: str) -> None:
        with self.lock:
            self.dropped += 1

    def transcript(self, kind: str, latency_s: float) -> None:
        pass

    def time_to_final(self, seconds: float) -> None:
        pass


def test_64_concurrent_real_time_streams_match_solo_runs_without_drops(tiny_model: AsrModel) -> None:
    """64 calls paced at real time (100 ms blocks, starts staggered over one chunk), default queue
    bound: no chunk dropped on this machine, and every transcript equals the stream's solo run."""
    n, seconds, block_s = 64, 3.0, 0.1
    audios = [synthetic_call(seconds, seed=100 + i) for i in range(n)]
    with AsrEngine(tiny_model, config()) as eng:
        solos = [run_solo(eng, a, StreamOptions(language="en-US")) for a in audios]
    assert sum(len(s.tokens) > 0 for s in solos) > n // 2

    hooks = CountingHooks()
    cols = [Stream() for _ in range(n)]
    block = int(block_s * SR)
    with AsrEngine(tiny_model, EngineConfig(), hooks) as eng:  # the defaults a deployment gets
        streams = [
            eng.open_stream(f"call-{i}", StreamOptions(language="en-US"), c) for i, c in enumerate(cols)
        ]
        t0 = time.monotonic()
        due = sorted(
            (0.32 * i / n + (k + 1) * block_s, i, k) for i in range(n) for k in range(int(seconds / block_s))
        )
        for at, i, k in due:
            wait = t0 + at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            streams[i].push(audios[i][k * block : (k + 1) * block])
            if (k + 1) * block >= len(audios[i]):
                streams[i].finish()
        ends = [c.wait() for c in cols]
    assert hooks.dropped == 0 and all(e.dropped_chunks == 0 for e in ends)
    assert all(e.reason == "finished" for e in ends)
    assert max(hooks.batches) > 1
    for i in range(n):
        got = [(e.kind, e.segment_id, e.text, e.start_ms, e.end_ms, e.token_ids) for e in cols[i].transcripts]
        want = [
            (e.kind, e.segment_id, e.text, e.start_ms, e.end_ms, e.token_ids) for e in solos[i].transcripts
        ]
        assert got == want, f"call {i}"


def _espeak(text: str, path: Path) -> np.ndarray:
    from tools.transcribe import read_audio

    subprocess.run([peers.tool("espeak-ng"), "-v", "en-us", "-s", "160", "-w", str(path), text], check=True)
    return read_audio(path)


def test_finals_come_at_the_pauses_of_spoken_audio(tiny_model: AsrModel, tmp_path: Path) -> None:
    """espeak-ng speech in three phrases separated by 1.5 s of silence: the token-silence rule alone
    (the fallback where no VAD closes) gives a final at each pause (not at the end of the stream),
    inside its phrase's time span; partials are prefixes of what follows."""
    gap = np.zeros(int(1.5 * SR), np.float32)
    phrases = [
        _espeak(t, tmp_path / f"p{i}.wav")
        for i, t in enumerate(["Hello there, how are you?", "I am fine.", "See you tomorrow morning."])
    ]
    audio = np.concatenate([phrases[0], gap, phrases[1], gap, phrases[2], gap[: SR // 2]])
    spans, pos = [], 0
    for p in phrases:
        voiced = np.flatnonzero(np.abs(p) > 1e-3)
        spans.append(((pos + voiced[0]) * 1000 // SR, (pos + voiced[-1]) * 1000 // SR))
        pos += len(p) + len(gap)

    cfg = EngineConfig(
        endpoint=EndpointConfig(blank_ms=800, energy_db=-45.0, partial_interval_ms=300),
        vad=VadConfig(kind="off"),
    )
    with AsrEngine(tiny_model, cfg) as eng:
        col = run_solo(eng, audio, StreamOptions(language="en-US"))
    finals = [e for e in col.transcripts if e.kind == "final"]
    assert len(finals) == 3, [(f.start_ms, f.end_ms, f.text) for f in finals]
    assert [f.segment_id for f in finals] == [0, 1, 2]
    assert [f.at_end_of_stream for f in finals[:2]] == [False, False]
    for f, (lo, hi) in zip(finals, spans, strict=True):
        # tokens lag the audio by up to the lookahead and the chunk; the onset walk-back may reach
        # a little before the first voiced sample
        assert lo - 500 <= f.start_ms < f.end_ms <= hi + 800, (f.start_ms, f.end_ms, lo, hi)
    by_segment: dict[int, list[TranscriptEvent]] = {}
    for e in col.transcripts:
        by_segment.setdefault(e.segment_id, []).append(e)
    for evs in by_segment.values():
        assert evs[-1].kind == "final"
        for a, b in itertools.pairwise(evs):
            assert b.text.startswith(a.text)


def test_the_mlx_thread_reports_where_its_steps_went(
    tiny_model: AsrModel, caplog: pytest.LogCaptureFixture
) -> None:
    """At the latest when it stops, the MLX thread logs its steps, rows per step, compiled calls per
    step and the step's phases: what an operator reads to tell a launch-bound step from a busy one; and
    MLX's memory, to tell one that waits for the allocator near its limit."""
    hooks = CountingHooks()
    with caplog.at_level("INFO", logger="asr_core.engine"), AsrEngine(tiny_model, config(), hooks) as eng:
        run_solo(eng, synthetic_call(2.0, seed=7), StreamOptions(language="en-US"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("encoder: ")]
    steps, rows = zip(*(map(float, (m.split()[1], m.split(", ")[1].split()[0])) for m in lines), strict=True)
    assert sum(steps) == len(hooks.batches)
    assert sum(s * r for s, r in zip(steps, rows, strict=True)) == pytest.approx(sum(hooks.batches), rel=0.05)
    assert all("stack" in m and "graph" in m and "eval" in m for m in lines)
    # And MLX's memory: in use, cached, the period's peak and the limit past which MLX frees its cache.
    peak, limit = (float(x) for x in lines[-1].split("peak ")[1].split(" of limit "))
    assert 0 < peak <= limit


class _WatchedDeviceDecoder:
    """The real device decoder, seen from outside: which threads decode, how many encoder steps ran
    while a decode was under way, and (optionally) a failure on the n-th decode."""

    def __init__(self, inner: Any, model: StepCountingModel, fail_on: int | None) -> None:
        self._inner = inner
        self._model = model
        self._fail_on = fail_on
        self.decodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, slots: Any, frames: Any, first_frames: Any, **kw: Any) -> Any:
        self.decodes += 1
        self._model.decode_threads.add(threading.current_thread().name)
        if self.decodes == self._fail_on:
            raise RuntimeError("device decoder lost")
        on_encoder_thread = threading.current_thread().name in self._model.step_threads
        if self.decodes == 1 and not on_encoder_thread:  # does the encoder step while this one decodes?
            with self._model.stepped:
                seen = self._model.steps
                self._model.stepped.wait_for(lambda: self._model.steps > seen, timeout=10.0)
                self._model.steps_during_first_decode = self._model.steps - seen
        return self._inner.decode(slots, frames, first_frames, **kw)


class StepCountingModel(RecordingModel):
    def __init__(self, model: AsrModel, fail_decode_on: int | None = None) -> None:
        super().__init__(model)
        self._fail_on = fail_decode_on
        self.steps = 0
        self.stepped = threading.Condition()
        self.steps_during_first_decode = 0
        self.step_threads: set[str] = set()
        self.decode_threads: set[str] = set()
        self.new_device_decoder = self._watched_device_decoder

    def create_encoder(self) -> EncoderBackend:
        inner = super().create_encoder()
        model = self

        class Counted:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def step(self, rows: Sequence[tuple[int, np.ndarray, bool, bool]]) -> list[np.ndarray]:
                out = inner.step(rows)
                model.step_threads.add(threading.current_thread().name)
                with model.stepped:
                    model.steps += 1
                    model.stepped.notify_all()
                return out

        return Counted()

    def _watched_device_decoder(self) -> Any:
        return _WatchedDeviceDecoder(self._model.new_device_decoder(), self, self._fail_on)


def _push_all(eng: AsrEngine, audios: list[np.ndarray], cols: list[Stream]) -> None:
    streams = [eng.open_stream(f"s{i}", StreamOptions(language="en-US"), c) for i, c in enumerate(cols)]
    for s, a in zip(streams, audios, strict=True):
        for i in range(0, len(a), 3200):
            s.push(a[i : i + 3200])
        s.finish()


def test_device_decoding_runs_beside_the_next_encoder_step(tiny_model: AsrModel) -> None:
    """Decoder mode "device": a step's chunks are decoded on the device decoder's own thread while the
    MLX thread runs the next step (so a step's wall time is not encoding plus decoding), and the
    streams' transcripts are still those of the workers decoding alone."""
    audios = [synthetic_call(2.5, seed=40 + i) for i in range(3)]
    with AsrEngine(tiny_model, config(mode="workers", max_queued_chunks=1000)) as eng:
        solos = [run_solo(eng, a, StreamOptions(language="en-US")) for a in audios]
    model = StepCountingModel(tiny_model)
    cols = [Stream() for _ in audios]
    with AsrEngine(model, config(mode="device", max_queued_chunks=1000)) as eng:
        _push_all(eng, audios, cols)
        ends = [c.wait() for c in cols]
    assert [e.reason for e in ends] == ["finished"] * 3
    assert model.step_threads == {"asr-encoder"} and model.decode_threads == {"asr-device-decoder"}
    assert model.steps_during_first_decode >= 1
    assert [c.tokens for c in cols] == [s.tokens for s in solos]


def test_device_decoding_can_run_on_the_encoders_thread_after_each_step(tiny_model: AsrModel) -> None:
    """`device_thread=False`: one MLX thread encodes a step, then decodes its chunks before the next
    step, with the transcripts of the workers decoding alone."""
    audios = [synthetic_call(2.5, seed=40 + i) for i in range(3)]
    with AsrEngine(tiny_model, config(mode="workers", max_queued_chunks=1000)) as eng:
        solos = [run_solo(eng, a, StreamOptions(language="en-US")) for a in audios]
    model = StepCountingModel(tiny_model)
    cols = [Stream() for _ in audios]
    with AsrEngine(model, config(mode="device", device_thread=False, max_queued_chunks=1000)) as eng:
        _push_all(eng, audios, cols)
        ends = [c.wait() for c in cols]
    assert [e.reason for e in ends] == ["finished"] * 3
    assert model.step_threads == model.decode_threads == {"asr-encoder"}
    assert [c.tokens for c in cols] == [s.tokens for s in solos]


class _SlowDeviceDecoder:
    """The real device decoder, `seconds` slower a decode."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self._inner = inner
        self._seconds = seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, *args: Any, **kw: Any) -> Any:
        time.sleep(self._seconds)
        return self._inner.decode(*args, **kw)


def test_a_step_costs_its_decoding_too_when_the_encoders_thread_decodes(tiny_model: AsrModel) -> None:
    """`device_thread=False`: the MLX thread decodes a step's chunks before it can step again, so the
    step cost the scheduler fits — its batching wait (3x the fixed cost) and the load admission reads —
    counts that time: a decode 40 ms slower makes the wait at least 120 ms, where the tiny model's
    steps alone make it a few."""
    model = RecordingModel(tiny_model)
    model.new_device_decoder = lambda: _SlowDeviceDecoder(tiny_model.new_device_decoder(), 0.04)
    cols = [Stream() for _ in range(2)]
    cfg = config(mode="device", device_thread=False, max_queued_chunks=1000, max_wait_ms=1000.0)
    with AsrEngine(model, cfg) as eng:
        _push_all(eng, [synthetic_call(2.0, seed=60 + i) for i in range(2)], cols)
        assert [c.wait().reason for c in cols] == ["finished"] * 2
        status = eng.status()
        assert status["max_wait_ms"] >= 3 * 40
        # The thread's busy share counts those decodes too: some, and never more than all of its time.
        assert 0.0 < status["busy"] <= 1.0


def test_the_status_says_where_a_chunks_delay_sat_before_its_step(tiny_model: AsrModel) -> None:
    """A front end elsewhere (a media worker) whose chunks reach the engine half a second after their
    audio: the engine's lag counts that half second, and its first part, from the audio to the queue,
    says it was spent before the queue, not waiting in it."""
    lookahead = tiny_model.default_lookahead
    late = StreamFrontEnd(tiny_model.new_frontend(lookahead), lookahead, None, lambda: time.monotonic() - 0.5)
    col = Stream()
    with AsrEngine(tiny_model, config()) as eng:
        stream = eng.open_chunk_stream("s", StreamOptions(language="en-US"), col)
        audio = synthetic_call(2.0, seed=80)
        for i in range(0, len(audio), 3200):
            stream.push_chunks(late.push(audio[i : i + 3200]), late.samples)
        payloads, last_is_final = late.finish()
        stream.finish(payloads, last_is_final, late.samples)
        assert col.wait().reason == "finished"
        status = eng.status()
    assert status["lag_s"] >= 0.5 and status["receive_lag_s"] >= 0.5
    assert 0.0 <= status["queue_wait_s"] < status["receive_lag_s"]


def test_the_step_report_says_what_the_load_admission_reads_is_made_of(
    tiny_model: AsrModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MLX thread's periodic report gives the load (`EncoderScheduler.load`, what the call limit
    reads) with its factors — rows coming in a second, the fitted seconds a row adds to a step, and the
    fitted fixed cost — so a run shows which of them stays flat when the load does."""
    monkeypatch.setattr("asr_core.engine._STEP_REPORT_S", 0.0)  # a report after every step
    cols = [Stream() for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="asr_core.engine"), AsrEngine(tiny_model, config()) as eng:
        _push_all(eng, [synthetic_call(2.0, seed=70 + i) for i in range(3)], cols)
        assert [c.wait().reason for c in cols] == ["finished"] * 3
    pattern = r"; load ([\d.]+) = (\d+) rows/s x ([\d.]+) ms/row \(fitted: ([\d.]+) ms/step \+ that x rows\)$"
    loads = [m.groups() for r in caplog.records if (m := re.search(pattern, r.getMessage()))]
    assert loads, [r.getMessage() for r in caplog.records]
    for load, rows_per_s, per_row_ms, _fixed_ms in loads:
        assert float(load) == pytest.approx(
            int(rows_per_s) * float(per_row_ms) / 1e3, abs=0.01 + 1e-3 * float(per_row_ms)
        )
    assert any(int(rows) > 0 for _, rows, _, _ in loads)  # the pushes' rows seen coming in
    # Each report gives the share of its period the thread spent in steps: at most all of it.
    busy = [
        float(m.group(1))
        for r in caplog.records
        if (m := re.search(r"steps in \d+ s \(busy ([\d.]+)\)", r.getMessage()))
    ]
    assert len(busy) == len(loads) and all(0.0 <= b <= 1.0 for b in busy) and any(b > 0.0 for b in busy), busy


def test_a_device_decoder_failure_stops_the_engine_loudly(tiny_model: AsrModel) -> None:
    """An error on the device decoder's thread is fatal like one on the MLX thread: every stream ends
    with reason "error", `on_fatal` gets the error, and the engine takes nothing more."""
    fatal: list[BaseException] = []
    model = StepCountingModel(tiny_model, fail_decode_on=3)
    cols = [Stream() for _ in range(3)]
    eng = AsrEngine(model, config(mode="device", max_queued_chunks=1000), on_fatal=fatal.append).start()
    with contextlib.suppress(EngineStoppedError):  # pushes may fail once the engine stopped
        _push_all(eng, [synthetic_call(3.0, seed=50 + i) for i in range(3)], cols)
    assert [c.wait().reason for c in cols] == ["error"] * 3
    assert fatal and "device decoder lost" in str(fatal[0]) and eng.failure is fatal[0]
    with pytest.raises(EngineStoppedError):
        eng.open_stream("late", StreamOptions(), Stream())
    eng.shutdown(timeout=2.0)
