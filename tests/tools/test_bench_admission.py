"""`ttg bench admission`: a burst against the call limit, with an engine read off a measured timeline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gateway.sip.admission import ConcurrencyLimit
from tools.bench.admission import Response, add_arguments, main, responses, run_burst


def _timeline() -> list[list[float]]:
    """A measured burst's seconds [t, streams, limit, load, lag, refused]: 100 more streams a second, a
    lag that rises from 0.1 s by 0.1 s a second once 600 streams are up, then calls ending."""
    rows = []
    for t in range(12):
        streams = 100.0 * t
        rows.append([float(t), streams, 2000.0, streams / 2000, 0.1 + max(0.0, (streams - 700) / 1000), 0.0])
    return [*rows, [12.0, 800.0, 2000.0, 0.4, 0.9, 0.0], [13.0, 300.0, 2000.0, 0.2, 0.2, 0.0]]


def test_the_engine_s_lag_is_read_against_the_streams_up_a_delay_before_over_the_rising_part() -> None:
    lag, load = responses(_timeline(), delay_rows=1)
    assert lag(500) == pytest.approx(0.1)  # 500 streams at 5 s, the lag at 6 s
    assert lag(900) == pytest.approx(0.4)  # 900 at 9 s -> 0.1 + (1000 - 700) / 1000 at 10 s
    assert lag(1200) == pytest.approx(lag(1000) + 0.1 * 2)  # past the largest count: the last slope
    assert load(1000) == pytest.approx(0.55)  # 1 100 / 2 000, a second later
    # The recovery after the peak (fewer streams, lower lag) is not part of the engine's curve.
    assert lag(800) == pytest.approx(0.3)


def test_a_response_never_falls_as_the_streams_grow() -> None:
    r = Response.from_pairs([(100, 0.2), (200, 0.1), (300, 0.3)])
    assert r(200) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="fewer than two"):
        Response.from_pairs([(100, 0.2)])


def test_a_burst_is_let_in_up_to_about_where_the_modelled_lag_reaches_the_limit_s_band() -> None:
    lag, load = responses(_timeline(), delay_rows=1)
    limit = ConcurrencyLimit(1.0, 32, 5000, max_load=0.8)
    run = run_burst(limit, lag, load, cps=100.0, calls=2000, seconds=60.0, delay_s=1.0)
    # The band (0.5 s) is reached at 1 100 streams in this engine.
    assert 900 <= run["admitted"] <= 1200 and run["admitted"] + run["refused"] == 2000
    assert run["per_second"][0][:3] == [0.0, 25, 32]


def test_the_program_prints_and_saves_each_rate_s_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(
        json.dumps({"levels": [{"calls": 2000, "rejected": 500, "admission_timeline": _timeline()}]})
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "out.json"
    assert (
        main(parser.parse_args([str(summary), "--cps", "100,50", "--calls", "1500", "--out", str(out)])) == 0
    )
    saved = json.loads(out.read_text())
    assert [r["cps"] for r in saved["runs"]] == [100.0, 50.0] and saved["measured_admitted"] == 1500
    assert "| 100 |" in capsys.readouterr().out
