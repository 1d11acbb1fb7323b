"""The coverage-guided fuzzer of the parsers (tools/fuzz) in a short, bounded run per target.

The long runs (10^6 inputs per parser) and their counts are in docs/fuzzing.md. Here each target runs
a few thousand mutated inputs from its seeds under atheris/libFuzzer in a subprocess: any exception
other than the parser's own error, or a hang, fails the test with libFuzzer's report. atheris has
Linux wheels only; on macOS the same targets take hypothesis-generated inputs in-process instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.peers import atheris_platform, hypothesis_fuzz_platform
from tools.fuzz.targets import TARGETS, check

REPO = Path(__file__).resolve().parents[2]
RUNS = {"sip": 3000, "framer": 3000, "agent": 600, "sdp": 5000, "rtp": 5000, "dtmf": 5000, "media": 150}


@atheris_platform
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_short_coverage_guided_run_raises_nothing_but_parse_errors(name: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.fuzz", name, "--runs", str(RUNS[name]), "--artifacts", str(tmp_path),
         "--", "-timeout=20"],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    done = re.search(r"Done (\d+) runs", report)
    assert done is not None and int(done.group(1)) >= RUNS[name], report[-2000:]
    assert not list(tmp_path.glob(f"{name}-crash-*")), report[-4000:]


@hypothesis_fuzz_platform
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_hypothesis_inputs_raise_nothing_but_parse_errors(name: str) -> None:  # pragma: no cover
    target = TARGETS[name]

    @settings(max_examples=RUNS[name] // 10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=2048), st.sampled_from(target.seeds())))
    def one(data: bytes) -> None:
        check(target, data)

    one()
