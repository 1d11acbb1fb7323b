"""`ttg bench engine-procs --barrier DIR:N`: several benches start their levels together."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.bench.engine_procs import wait_for_peers

WAIT = "from tools.bench.engine_procs import wait_for_peers; import sys; wait_for_peers(sys.argv[1], 30)"


def test_a_bench_waits_at_the_barrier_until_all_are_ready(tmp_path: Path) -> None:
    barrier = f"{tmp_path / 'b'}:2"
    first = subprocess.Popen([sys.executable, "-c", WAIT, barrier], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert first.poll() is None, "the first bench went on alone"
    second = subprocess.run([sys.executable, "-c", WAIT, barrier], capture_output=True, text=True, timeout=60)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == second.returncode == 0
    assert "2 benches ready" in out and "2 benches ready" in second.stdout


def test_a_barrier_nobody_else_reaches_ends_the_bench_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="1 of 2 benches ready"):
        wait_for_peers(f"{tmp_path}:2", timeout_s=0.5)


@pytest.mark.parametrize("spec", ["2", ":2", "dir:x", "dir:0"])
def test_a_malformed_barrier_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="expected DIR:N"):
        wait_for_peers(spec, timeout_s=0.1)
