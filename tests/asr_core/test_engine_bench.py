"""`ttg bench engine` runs end to end (tiny bundle, two calls, one second) and writes its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_smoke_writes_a_report(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "engine", "--model", str(tiny_bundle), "--calls", "2",
         "--seconds", "1.5", "--warmup-s", "0", "--decoder-mode", "both", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert [run["decoder_mode"] for run in report["runs"]] == ["workers", "batched"]
    for run in report["runs"]:
        assert run["calls"] == 2 and run["steps"] > 0 and run["errors"] == 0
        assert run["step_ms"]["p50"] > 0 and run["batch"]["p100"] >= 1
    assert "| calls |" in r.stdout
