"""`tools.device.spy_summary` reads py-spy's raw profiles of the engine process: one thread's samples by
the deepest Python frame, by the calls under a function, and by the C functions below a chosen line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.device.spy_summary import has_marker, lock_waits, main, read_raw, summarize

RUN = "AsrEngine._run (asr_core/engine.py:515)"
STEP = "StreamingEncoder.step (asr_core/encoder/streaming.py:406)"
DECODE = "DeviceDecoder.decode (asr_core/decoder/device.py:232)"
LIB = "(libmlx.so)"


def _sample(thread: str, frames: list[str], count: int) -> str:
    """One line of py-spy's raw output with `--threads`: `thread (ID): NAME;frame;frame;... COUNT`."""
    return ";".join([thread, *frames]) + f" {count}"


ENCODER, RESULTS = "thread (7): asr-encoder", "thread (8): asr-results"
INSTANTIATE, LOCK, ALLOC = (
    "cuGraphInstantiate (libcuda.so)",
    "pthread_mutex_lock (libc.so.6)",
    f"cu::malloc_async {LIB}",
)
RAW = "\n".join(
    [
        _sample(
            ENCODER,
            ["0x1 (libc.so.6)", RUN, STEP, f"mlx::core::eval {LIB}", "cuGraphInstantiateWithFlags"],
            5,
        ),
        _sample(ENCODER, [RUN, STEP, ALLOC, LOCK], 3),
        _sample(ENCODER, [RUN, STEP, LOCK, ALLOC], 2),
        _sample(ENCODER, [RUN, DECODE, INSTANTIATE, "0x2 (libcuda.so)", INSTANTIATE], 4),
        _sample(RESULTS, [RUN, STEP, INSTANTIATE], 100),
        "a line that is not a sample",
        "",
    ]
)


def test_samples_keep_their_thread_their_frames_outermost_first_and_their_count() -> None:
    samples = read_raw(RAW)
    assert len(samples) == 5  # the malformed and empty lines are not samples
    assert samples[0].thread == "asr-encoder (7)" and samples[0].count == 5
    assert samples[0].frames[0] == "0x1 (libc.so.6)"
    assert samples[0].frames[-1].startswith("cuGraphInstantiate")
    assert samples[0].python == [1, 2]


def test_a_marker_with_a_callee_needs_the_callee_below_the_caller() -> None:
    assert has_marker(["malloc_async (x)", "pthread_mutex_lock (y)"], "malloc_async>pthread_mutex_lock")
    assert not has_marker(["pthread_mutex_lock (y)", "malloc_async (x)"], "malloc_async>pthread_mutex_lock")
    assert has_marker(["a", "cuGraphInstantiateWithFlags (z)"], "cuGraphInstantiate")


def test_one_threads_samples_by_line_by_call_and_by_the_c_functions_at_a_line() -> None:
    summary = summarize(
        read_raw(RAW),
        "asr-encoder",
        under="AsrEngine._run",
        depth=1,
        sites=["streaming.py:406", "device.py:232"],
    )
    assert summary.thread == "asr-encoder (7)" and summary.total == 14  # the other thread's 100 left out
    assert summary.leaves == {
        "StreamingEncoder.step (asr_core/encoder/streaming.py:406)": 10,
        "DeviceDecoder.decode (asr_core/decoder/device.py:232)": 4,
    }
    assert summary.under == {"StreamingEncoder.step": 10, "DeviceDecoder.decode": 4}
    step, decode = summary.sites["streaming.py:406"], summary.sites["device.py:232"]
    assert step[""] == 10 and step["graph instantiated"] == 5
    assert step["MLX's allocator"] == 5 and step["its lock"] == 3  # the lock taken under the allocator only
    assert decode[""] == 4 and decode["graph instantiated"] == 4  # once a sample, not once a frame


TIMEDWAIT = "pthread_cond_timedwait (libc.so.6)"
QUEUE = "Queue.get (queue.py:180)"


def test_a_thread_waits_for_the_interpreter_lock_where_a_timed_wait_sits_right_below_its_code() -> None:
    raw = "\n".join(
        [
            _sample(ENCODER, [RUN, STEP, TIMEDWAIT, "0x7f92 (libc.so.6)"], 3),  # take_gil, unnamed
            _sample(ENCODER, [RUN, STEP, "raw_array_assign_scalar (numpy.so)", TIMEDWAIT], 2),  # numpy let go
            _sample(ENCODER, [RUN, STEP, f"mlx::core::eval {LIB}", TIMEDWAIT], 7),  # MLX's own wait
            _sample(RESULTS, [RUN, QUEUE, "PyThread_acquire_lock_timed (python3.12)", TIMEDWAIT], 11),  # idle
            _sample(RESULTS, [RUN, QUEUE, "take_gil (python3.12)", TIMEDWAIT], 1),
            _sample(RESULTS, [TIMEDWAIT], 4),  # no Python frame: not the interpreter's
        ]
    )
    assert lock_waits(read_raw(raw)) == {"asr-encoder (7)": (12, 5), "asr-results (8)": (16, 1)}


def test_the_command_prints_the_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "all.raw"
    raw.write_text(RAW)
    args = ["--thread", "asr-encoder", "--under", "AsrEngine._run", "--site", "device.py:232"]
    assert main([str(raw), *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("thread asr-encoder (7): 14 samples")
    assert "| device.py:232 | 4 (29 %) | 4 (100 %) |" in out
    assert "| asr-results (8) | 100 | 0 (0 %) |" in out
