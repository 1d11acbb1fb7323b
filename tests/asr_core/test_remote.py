"""The engine in its own process, fed by front-end processes over shared-memory channels (real tiny
model, real processes): the same transcripts as in one process; a front end or the engine that dies
is seen, and what was decoded before is not lost."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from asr_core.api import StreamEnded, StreamOptions, TranscriptEvent
from asr_core.channel import ChannelWriter
from asr_core.config import DecoderConfig, EngineConfig, SchedulerConfig
from asr_core.engine import AsrEngine
from asr_core.frontend import FrontEndFactory, FrontEndSpec
from asr_core.model import GPU_CACHE_LIMIT_BYTES, GPU_PROCESS_RESERVE_BYTES, AsrModel, gpu_memory_limits
from asr_core.remote import ChunkSender, EngineProcess
from asr_core.wire import Event, Status, Step
from tools.bench.engine import synthetic_call

SECONDS = 3.0


def _config() -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_batch=16, max_wait_ms=5.0, max_queued_chunks=1000),
        decoder=DecoderConfig(mode="batched", workers=2),
    )


def _start_feeder(
    engine: EngineProcess, i: int, spec_file: Path, *, calls: int, first_key: int, die_after: float = 0.0
) -> subprocess.Popen[str]:
    end = engine.front_end_ends()[i]
    cmd = [
        sys.executable, "-m", "tools.bench.feeder", "--channel", end.encode(), "--spec", str(spec_file),
        "--calls", str(calls), "--seconds", str(SECONDS), "--first-key", str(first_key),
        "--seed", str(first_key),
    ]  # fmt: skip
    # A feeder that is to die mid-stream sends in real time; the others as fast as the channel takes.
    cmd += ["--die-after", str(die_after)] if die_after else ["--fast"]
    return subprocess.Popen(cmd, pass_fds=end.fds(), stdout=subprocess.PIPE, text=True)


def _collect(
    engine: EngineProcess, want_ends: int, timeout: float = 120.0
) -> tuple[dict[int, list[Any]], int]:
    """Events per key until `want_ends` StreamEnded came; and how many encoder steps were reported."""
    assert engine.results is not None
    events: dict[int, list[Any]] = {}
    ends = steps = 0
    deadline = time.monotonic() + timeout
    while ends < want_ends and time.monotonic() < deadline:
        select.select([engine.results], [], [], 1.0)
        for out in engine.read_results():
            if isinstance(out, Event):
                events.setdefault(out.key, []).append(out.event)
                ends += isinstance(out.event, StreamEnded)
            elif isinstance(out, Step):
                steps += 1
    return events, steps


def _text(events: list[Any]) -> list[tuple[str, int, str, int, int, tuple[int, ...]]]:
    return [
        (e.kind, e.segment_id, e.text, e.start_ms, e.end_ms, e.token_ids)
        for e in events
        if isinstance(e, TranscriptEvent)
    ]


@pytest.fixture
def engine_process(tiny_bundle: Path, tmp_path: Path) -> Any:
    engine = EngineProcess(tiny_bundle, "f32", _config(), front_ends=2)
    spec = engine.start(timeout=300)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json()))
    yield engine, spec_file
    if engine.proc is not None and engine.proc.poll() is None:
        engine.shutdown(drain=False, timeout=5)
    engine.close()


def test_streams_from_two_front_end_processes_get_the_transcripts_of_one_process(
    engine_process: Any, tiny_bundle: Path
) -> None:
    engine, spec_file = engine_process
    feeders = [
        _start_feeder(engine, 0, spec_file, calls=2, first_key=0),
        _start_feeder(engine, 1, spec_file, calls=2, first_key=100),
    ]
    engine.handed_over()
    events, steps = _collect(engine, want_ends=4)
    for f in feeders:
        assert f.wait(30) == 0
    assert sorted(events) == [0, 1, 100, 101]
    assert all(isinstance(ev[-1], StreamEnded) and ev[-1].reason == "finished" for ev in events.values())
    assert steps > 0  # the engine's hooks came along

    # The same audio through an engine in this process, stream by stream.
    model = AsrModel.load(tiny_bundle, "f32")
    with AsrEngine(model, _config()) as local:
        for key in events:
            got: list[Any] = []
            s = local.open_stream(f"call-{key}", StreamOptions(language="en-US"), got.append)
            audio = synthetic_call(SECONDS, seed=key)
            for a in range(0, audio.size, 1280):
                s.push(audio[a : a + 1280])
            s.finish()
            deadline = time.monotonic() + 60
            while not (got and isinstance(got[-1], StreamEnded)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _text(events[key]) == _text(got), f"stream {key}"
            assert events[key][-1].audio_ms == got[-1].audio_ms
            assert _text(got)  # there is text to compare
    assert engine.shutdown(drain=True, timeout=10) == 0


def test_a_front_end_that_dies_has_its_streams_closed_with_what_was_decoded(engine_process: Any) -> None:
    engine, spec_file = engine_process
    survivor = _start_feeder(engine, 0, spec_file, calls=1, first_key=0)
    doomed = _start_feeder(engine, 1, spec_file, calls=1, first_key=100, die_after=1.5)
    engine.handed_over()
    events, _ = _collect(engine, want_ends=2)
    assert doomed.wait(30) == 3 and survivor.wait(30) == 0
    assert events[0][-1].reason == "finished"
    ended = events[100][-1]
    assert isinstance(ended, StreamEnded) and ended.reason == "closed"
    assert 0 < ended.audio_ms < SECONDS * 1000  # it got part of its audio through
    assert engine.shutdown(drain=True, timeout=10) == 0


def test_a_front_end_added_to_the_running_engine_takes_the_place_of_a_dead_one(engine_process: Any) -> None:
    engine, spec_file = engine_process
    doomed = _start_feeder(engine, 0, spec_file, calls=1, first_key=0, die_after=1.0)
    engine.handed_over()
    assert doomed.wait(30) == 3
    newcomer = engine.add_front_end()  # its engine end goes over the control socket
    feeder = subprocess.Popen(
        [
            sys.executable, "-m", "tools.bench.feeder", "--channel", newcomer.encode(), "--spec",
            str(spec_file), "--calls", "1", "--seconds", str(SECONDS), "--first-key", "200", "--seed", "200",
            "--fast",
        ],
        pass_fds=newcomer.fds(),
    )  # fmt: skip
    engine.handed_over()
    events, _ = _collect(engine, want_ends=2)
    assert feeder.wait(30) == 0
    assert events[0][-1].reason == "closed"
    assert events[200][-1].reason == "finished" and _text(events[200])
    assert engine.shutdown(drain=True, timeout=10) == 0


def test_an_unknown_language_ends_the_stream_with_an_error(engine_process: Any) -> None:
    engine, _spec_file = engine_process
    end = engine.front_end_ends()[0]
    code = (
        "import sys; from asr_core.channel import ChannelEnd, ChannelWriter; "
        "from asr_core.remote import ChunkSender; "
        "s = ChunkSender(ChannelWriter.open(ChannelEnd.decode(sys.argv[1]))); "
        "s.open(7, None, 'xx-XX', 'bad'); s.flush(); import time; time.sleep(1)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, end.encode()], pass_fds=end.fds())
    engine.handed_over()
    events, _ = _collect(engine, want_ends=1)
    assert p.wait(30) == 0
    (ended,) = events[7]
    assert isinstance(ended, StreamEnded) and ended.reason == "error" and "xx-XX" in (ended.error or "")


def test_the_parent_sees_the_engine_process_die(engine_process: Any) -> None:
    engine, _ = engine_process
    engine.handed_over()
    assert engine.poll_control()
    os.kill(engine.pid, signal.SIGKILL)
    engine.proc.wait(10)
    assert not engine.poll_control()
    assert engine.failure is not None and "exited" in engine.failure


def test_the_engine_process_says_how_long_a_chunk_took_to_reach_it_from_its_front_end(
    engine_process: Any,
) -> None:
    """A front end that publishes a chunk half a second after completing it (a media worker's loop held
    up): the engine process's status counts that half second until it read the chunk (`arrival_lag_s`),
    a part of the way to its queue (`receive_lag_s`)."""
    engine, spec_file = engine_process
    spec = FrontEndSpec.from_json(json.loads(spec_file.read_text()))
    front = FrontEndFactory(spec).stream(spec.default_lookahead)
    sender = ChunkSender(ChannelWriter.open(engine.front_end_ends()[0]))
    sender.open(1, None, "en-US", "late")
    payloads = front.push(synthetic_call(1.0, seed=90))
    late = [dataclasses.replace(p, completed_at=time.monotonic() - 0.5) for p in payloads]
    sender.chunks(1, late, front.samples)
    assert late and sender.flush()
    seen: dict[str, Any] = {"arrival_lag_s": 0.0}  # the status with the largest arrival lag
    deadline = time.monotonic() + 30
    while seen["arrival_lag_s"] < 0.5 and time.monotonic() < deadline:
        select.select([engine.results], [], [], 1.0)
        for out in engine.read_results():
            if isinstance(out, Status) and out.values.get("arrival_lag_s", 0.0) > seen["arrival_lag_s"]:
                seen = out.values
    assert seen["arrival_lag_s"] >= 0.5, seen
    assert seen["receive_lag_s"] >= seen["arrival_lag_s"]
    sender.writer.close()


def test_the_engine_process_hands_the_interpreter_lock_over_at_the_interval_it_is_given(
    engine_process: Any, tiny_bundle: Path
) -> None:
    """The daemon's setting reaches the engine process, which runs with it; unset (the daemon's
    default), Python's own 5 ms."""
    from gateway.config import DaemonSettings

    assert DaemonSettings().engine_switch_interval_ms == 5.0
    unset, _ = engine_process
    assert unset.info["switch_interval_ms"] == 5.0
    engine = EngineProcess(tiny_bundle, "f32", _config(), front_ends=1, switch_interval_ms=1.5)
    try:
        engine.start(timeout=300)
        assert engine.info["switch_interval_ms"] == 1.5
    finally:
        engine.kill()
        engine.close()


def test_engine_processes_on_one_accelerator_split_its_memory_and_leave_room_for_their_own() -> None:
    """Each engine process may use its share of what MLX allows one process (95 % of a CUDA card) less
    what it holds outside MLX's count (GPU_PROCESS_RESERVE_BYTES), and caches at most a quarter of
    that (never above GPU_CACHE_LIMIT_BYTES): processes that each assumed the whole card, or exactly
    their share of it, would together outgrow it."""
    card = 80 << 30
    limit = int(card * 0.95)  # MLX's default for one process on an 80 GiB card
    assert gpu_memory_limits(limit, 1.0) == (limit, GPU_CACHE_LIMIT_BYTES)
    memory, cache = gpu_memory_limits(limit, 1 / 4)
    assert memory == limit // 4 - GPU_PROCESS_RESERVE_BYTES and cache == memory // 4
    assert 4 * (memory + GPU_PROCESS_RESERVE_BYTES) <= limit  # the four processes' whole footprints fit
    with pytest.raises(ValueError, match="too many engine processes"):
        gpu_memory_limits(limit, 1 / 64)  # 1.2 GiB each: less than the reserve
    with pytest.raises(ValueError):
        gpu_memory_limits(limit, 0.0)
    with pytest.raises(ValueError):
        gpu_memory_limits(limit, 1.5)
