"""`ttg bench decoder` runs end to end on a tiny bundle (a smoke test: no timing is asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools.bench import decoder


def test_bench_decoder_reports_every_mode_with_identical_tokens(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    decoder.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(tiny_bundle),
            "--streams",
            "1,3",
            "--seconds",
            "2",
            "--signals",
            "2",
            "--json",
            str(out),
        ]
    )
    assert decoder.main(args) == 0
    report = json.loads(out.read_text())
    assert [(r["streams"], r["mode"]) for r in report["results"]] == [
        (n, m) for n in (1, 3) for m in ("workers", "batched", "numpy", "mlx")
    ]
    assert all(r["tokens_match_first_mode"] and r["calls_per_core"] > 0 for r in report["results"])
    assert report["vocab"] == 257 and report["seconds_per_call"] == 2.0
