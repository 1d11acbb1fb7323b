"""exp, sigmoid and softmax as fused array ops (asr_core.encoder.expmath) against exact values.

The encoder uses them on x86-64 CPUs in place of MLX's kernels, so they must be at least as accurate:
exp within 1 ulp of the correctly rounded value over the range that does not under- or overflow,
saturating outside it, NaN kept; x * sigmoid(gate) closer to the exact value than MLX's kernels; softmax
as MLX's within float rounding, a masked (-inf) score weighing exactly 0. After warm-up no step waits
for MLX's CPU JIT to build them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from asr_core.encoder import expmath
from tests.fixtures import peers


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in units in the last place between float32 arrays of one sign."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_exp_is_within_one_ulp_of_the_exact_value() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-87.0, 88.0, 200_001), rng.standard_normal(100_000) * 6])
    x = x.astype(np.float32)
    exact = np.exp(x.astype(np.float64)).astype(np.float32)
    got = np.array(expmath.exp(mx.array(x)))
    assert ulps(got, exact).max() <= 1


def test_exp_saturates_and_keeps_nan() -> None:
    x = mx.array([-np.inf, -1000.0, -88.0, 0.0, 89.0, np.inf, np.nan], dtype=mx.float32)
    got = np.array(expmath.exp(x))
    assert got[0] == got[1] == got[2] == 0.0  # exactly 0, so a masked score weighs nothing
    assert got[3] == 1.0
    assert np.isfinite(got[4]) and got[4] == got[5] > 1e38  # clamped at 88, not inf
    assert np.isnan(got[6])


def test_exp_keeps_a_half_precision_input_dtype() -> None:
    x = mx.array(np.linspace(-10, 10, 101), dtype=mx.float16)
    got = expmath.exp(x)
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got, np.float32), np.exp(np.array(x, np.float32)), rtol=1e-3)


@pytest.mark.parametrize("shape", [(7,), (256, 704), (3, 4, 4, 60)])
def test_gated_is_closer_to_the_exact_value_than_mlx_kernels(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x, gate = (mx.array(rng.standard_normal(shape).astype(np.float32) * 8) for _ in range(2))
    for a, g in ((x, x), (x, gate)):  # SiLU, GLU
        exact = np.array(a, np.float64) / (1.0 + np.exp(-np.array(g, np.float64)))
        ours = np.array(expmath.gated(a, g, True), np.float64)
        np.testing.assert_allclose(ours, exact, rtol=3e-7, atol=1e-30)
        # MLX's sigmoid (array_ops=False) reduces its exp's argument in one step: up to ~2e-6 off.
        theirs = np.array(expmath.gated(a, g, False), np.float64)
        np.testing.assert_allclose(theirs, exact, rtol=3e-6, atol=1e-30)


def test_softmax_agrees_with_mlx_and_gives_masked_scores_zero_weight() -> None:
    rng = np.random.default_rng(2)
    s = rng.standard_normal((5, 4, 4, 60)).astype(np.float32) * 5
    s[..., :10] = -np.inf  # cache slots a query may not see
    x = mx.array(s)
    ours = np.array(expmath.softmax(x, True))
    np.testing.assert_allclose(ours, np.array(expmath.softmax(x, False)), rtol=1e-6, atol=1e-9)
    assert (ours[..., :10] == 0.0).all()
    np.testing.assert_allclose(ours.sum(axis=-1), 1.0, rtol=1e-6)


NO_LIVE_BUILDS = """
import glob, sys
import numpy as np
from asr_core._process import configure_process
configure_process()
from asr_core.bundle import load_bundle
from asr_core.encoder import ChunkInput, StreamingEncoder, chunk_frames, first_chunk_frames
built = lambda: len(glob.glob(sys.argv[2] + "/**/*.so", recursive=True))
b = load_bundle(sys.argv[1], "f32")
enc = StreamingEncoder(b.encoder_weights, b.config.encoder, "f32", array_exp=True)
rng = np.random.default_rng(0)
mel = lambda n: rng.standard_normal((n, 128)).astype(np.float32)
for la in (0, 3):
    enc.warmup(la, 1)
    before = built()
    F, L = first_chunk_frames(la), chunk_frames(la)
    for B in (1, 2, 5):
        slots = [enc.alloc(0, la) for _ in range(B)]
        for rows in (
            [ChunkInput(s, mel(F + L), flush=True) for s in slots],
            [ChunkInput(s, mel(F)) for s in slots],
            [ChunkInput(s, mel(L * (1 + i % 2)), flush=True) for i, s in enumerate(slots)],
            [ChunkInput(s, mel(L), flush=bool(i % 2)) for i, s in enumerate(slots)],
            [ChunkInput(s, mel(1 + 3 * i % L), is_last=True) for i, s in enumerate(slots)],
        ):
            enc.step(rows)
        for s in slots:
            enc.release(s)
        short = [enc.alloc(0, la) for _ in range(B)]
        enc.step([ChunkInput(s, mel(1 + i % F), is_last=True) for i, s in enumerate(short)])
        for s in short:
            enc.release(s)
    print("lookahead", la, "kernels built after warm-up:", built() - before)
"""


def test_after_warm_up_no_step_waits_for_the_jit(tiny_bundle: Path, tmp_path: Path) -> None:
    """A kernel the JIT builds in a live step stalls every call for a second: warm-up builds them all,
    whatever the batch, the chunk kind (first, later, flushes of one and two chunks, mixed in one
    step, last and first-and-last of any length) and the lookahead. Counted as the shared objects
    in a fresh JIT cache (MLX keeps it under the temp directory)."""
    peers.tool("g++")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", NO_LIVE_BUILDS, str(tiny_bundle), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "lookahead 0 kernels built after warm-up: 0",
        "lookahead 3 kernels built after warm-up: 0",
    ]


def test_used_by_default_only_where_mlx_can_fuse_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expmath.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(expmath.shutil, "which", lambda name: "/usr/bin/g++")
    assert expmath.array_exp_default() is (mx.default_device() == mx.cpu)
    monkeypatch.setattr(expmath.shutil, "which", lambda name: None)  # no JIT compiler
    assert not expmath.array_exp_default()
    monkeypatch.setattr(expmath.shutil, "which", lambda name: "/usr/bin/g++")
    monkeypatch.setattr(expmath.platform, "machine", lambda: "aarch64")  # MLX's exp is vectorized there
    assert not expmath.array_exp_default()


FALLBACK = """
import logging, sys
import numpy as np
from asr_core._process import configure_process
configure_process()
from asr_core.bundle import load_bundle
from asr_core.encoder import ChunkInput, StreamingEncoder, first_chunk_frames
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
b = load_bundle(sys.argv[1], "f32")
enc = StreamingEncoder(b.encoder_weights, b.config.encoder, "f32", array_exp=True)
enc.warmup(3, 8)
slot = enc.alloc(0, 3)
frames = enc.step([ChunkInput(slot, np.ones((first_chunk_frames(3), 128), np.float32))])[0]
print("array_exp", enc.params.array_exp, "frames", frames.shape, bool(np.isfinite(frames).all()))
"""


def test_an_encoder_whose_fused_kernels_cannot_be_built_goes_on_with_mlx_kernels(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """MLX's CPU JIT writes its kernels under the temp directory; where it cannot (here a file stands
    where its folder would be), warm-up logs it and the encoder steps with MLX's own kernels."""
    peers.tool("g++")  # without g++ MLX never tries to build them
    (tmp_path / "mlx").write_text("not a folder")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", FALLBACK, str(tiny_bundle)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "could not build the fused kernels" in run.stdout
    assert "array_exp False frames (4, " in run.stdout and run.stdout.strip().endswith("True")


def test_engines_build_the_kernels_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one process holds the build lock, another's flock on the same file waits (here: fails
    non-blocking); the lock file is opened read-only, so one left read-only works."""
    import fcntl
    import tempfile

    from asr_core.encoder.streaming import _jit_build_lock

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lock_file = tmp_path / "ttg-mlx-jit.lock"
    lock_file.touch(mode=0o444)
    other = os.open(lock_file, os.O_RDONLY)
    try:
        with _jit_build_lock(), pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving
    finally:
        os.close(other)
