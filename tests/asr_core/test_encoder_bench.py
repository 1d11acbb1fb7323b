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
            "--busy-threads",
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
        assert r["extra"]["host_ms"] > 0  # the step's host phase, beside a thread that wants the lock
    assert report["busy_threads"] == 1
    assert "| 3 |" in proc.stdout and "B=3: host phase" in proc.stdout


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


@pytest.mark.parametrize(("flags", "label"), [([], "ours"), (["--reference"], "transformers")])
def test_kernel_profile_script_runs_each_batch_size_without_cuda(flags: list[str], label: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench.gpu_kernels",
            "--smoke",
            "--batch",
            "3",
            "2",
            "--interleave",
            "2",
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for batch in (3, 2):  # one model, each batch size in turn
        assert f"{label} B={batch}: step wall median" in proc.stdout
        assert f"{label} B={batch}: 2 steps run" in proc.stdout
    # then the sizes in turn, as an engine alternates between them: one median per size
    interleaved = [line.split(":")[0] for line in proc.stdout.splitlines() if line.endswith("ms interleaved")]
    assert interleaved == [f"{label} B=3", f"{label} B=2"]


def test_kernel_profile_script_warms_every_batch_bucket_as_the_engine_does() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.gpu_kernels", "--smoke", "--warm-buckets", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "warm-up: 4 batch buckets up to 5" in proc.stdout  # 1, 2, 4, 8
    # and the device decoder's: rows 1, 2, 4, 8 by frames 1, 2, 4, 8, 16
    assert "device decoder warm-up: 20 shapes up to 5 rows" in proc.stdout


NCU_COLUMNS = [
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
    "Section Name",
    "Metric Name",
    "Metric Unit",
    "Metric Value",
]


def ncu_row(i: int, kernel: str, ns: str) -> str:
    """One line of `ncu --csv --metrics gpu__time_duration.sum --print-units base`."""
    values = [str(i), "4242", "python3.12", "127.0.0.1", kernel, "1", "7", "(256, 1, 1)", "(64, 4, 1)", "0"]
    values += ["9.0", "Command line profiler metrics", "gpu__time_duration.sum", "nsecond", ns]
    return ",".join(f'"{v}"' for v in values)


GEMM, COPY = "sm90_xmma_gemm_f16f16_f16f32", "void mlx::core::cu::copy_gg<__half>"
NCU_LOG = "\n".join(
    [
        "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
        ",".join(f'"{c}"' for c in NCU_COLUMNS),
        ncu_row(0, GEMM, "3,000"),
        ncu_row(1, COPY, "1,000"),
        ncu_row(2, GEMM, "5,000"),
        ncu_row(3, COPY, "1,000"),
        "==PROF== Disconnected from process 4242",
    ]
)


def test_kernel_profile_summary_groups_an_ncu_log_by_kind_and_name(tmp_path: Path) -> None:
    from tools.bench.gpu_kernels import summarize

    log = tmp_path / "ncu.csv"
    log.write_text(NCU_LOG)
    lines = summarize(log, steps=2, top=5).splitlines()
    # 10 µs of kernels over two steps: 5 µs and two launches a step.
    assert lines[0] == "ncu.csv: 0.01 ms of kernels per step, 2 launches per step"
    assert "| gemm | 0.00 | 80% | 1 |" in lines and "| copy | 0.00 | 20% | 1 |" in lines
    assert "| `sm90_xmma_gemm_f16f16_f16f32` | 0.00 | 80% | 1 | 4.0 |" in lines
    # Kinds and kernels come largest first.
    assert lines.index("| gemm | 0.00 | 80% | 1 |") < lines.index("| copy | 0.00 | 20% | 1 |")


def test_kernel_profile_summary_refuses_a_unit_it_does_not_know(tmp_path: Path) -> None:
    from tools.bench.gpu_kernels import summarize

    log = tmp_path / "ncu.csv"
    log.write_text(NCU_LOG.replace('"nsecond"', '"cycle"', 1))
    with pytest.raises(ValueError, match="unknown duration unit 'cycle'"):
        summarize(log, steps=1, top=5)
