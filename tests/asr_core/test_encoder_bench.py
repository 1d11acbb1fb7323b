"""The encoder benchmarks run end to end (tiny model, a few steps): numbers are printed, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.reference

ROOT = Path(__file__).resolve().parents[2]


def test_bench_encoder_times_ours_and_the_reference(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "encoder.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "bench",
            "encoder",
            "--model",
            str(tiny_bundle),
            "--batch",
            "1",
            "3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["error"] is None and r["ours"]["n"] == 2 and r["reference"]["n"] == 2
        assert r["ratio"] > 0
        # Same mel into both: the frames agree (random tiny weights, fp32).
        assert r["max_abs_diff"] < 1e-4
    assert "| 3 |" in proc.stdout


def test_gpu_benchmark_script_smoke_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.gpu_encoder", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_encoder.json").read_text())
    assert report["parity"]["f32_max_abs_diff"] < 1e-4
    assert report["parity"]["f32_final_short_chunk_vs_offline"] < 1e-4
    for dtype in ("f16", "bf16"):
        results = report["timings"][dtype]
        assert [r["batch"] for r in results] == [1, 2] and all(r["error"] is None for r in results)
    assert report["kernels"]["kernels"] > 0
    assert (tmp_path / "gpu_encoder.md").read_text().count("| 2 |") >= 2
