"""Issue 6, acceptance 1: `make demo` (python -m tools.demo) starts Redis and the gateway, places a real
SIP call with speech, prints the transcript from Redis and stops everything cleanly; bounded in time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.e2e.conftest import REPO, Serve
from tools import demo

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]


def run_demo(*args: str, timeout_s: float = 150) -> subprocess.CompletedProcess[str]:
    env = Serve(REPO, bundle="", redis_url="").env
    return subprocess.run(
        [sys.executable, "-m", "tools.demo", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


def dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie of an exited child is gone for our purposes (its parent, the demo, has exited).
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" in status.read_text()


def test_make_demo_places_a_call_prints_its_transcript_and_stops_everything() -> None:
    proc = run_demo()
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    steps = re.findall(r"^ttg demo: (\S+)", out, re.M)
    for step in ("1/5", "2/5", "3/5", "4/5", "5/5", "stopped"):
        assert step in steps, out
    call_id = re.search(r"is call ([0-9a-f]{32}) in Redis", out)
    assert call_id is not None, out
    # What `ttg tail` printed: the call's start, its transcript line(s) and its end.
    tail = [line.strip() for line in out.splitlines() if line.startswith("    ")]
    assert any(f"call {call_id[1]} started" in line for line in tail), out
    assert any(f"{call_id[1]}/caller  #0" in line for line in tail), out
    assert any(f"call {call_id[1]} ended  bye" in line for line in tail), out
    for pid in map(int, re.findall(r"\(pid (\d+)\)", out)):
        assert dead(pid), f"process {pid} left running"
    assert "logs and files are in" not in out  # nothing left behind on success


def test_the_demo_gives_up_with_a_clear_message_when_out_of_time() -> None:
    proc = run_demo("--timeout", "0.5")
    assert proc.returncode == 1
    assert "ttg demo: FAILED: the demo ran out of its 0.5 s while" in proc.stderr
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", proc.stdout)]
    assert all(dead(p) for p in pids)
    kept = re.search(r"logs and files are in (\S+)", proc.stdout)
    assert kept is not None
    shutil.rmtree(kept[1], ignore_errors=True)


def test_the_demo_speaks_a_shipped_held_out_clip_when_the_demo_model_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "demo_model"
    (model / "clips").mkdir(parents=True)
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)
    sf.write(str(model / "clips" / "uk.wav"), tone, 16000)
    sf.write(str(model / "clips" / "en.wav"), tone[:8000], 16000)
    rows = [
        {"audio": "uk.wav", "text": "добрий день", "lang": "uk-UA"},
        {"audio": "en.wav", "text": "good morning", "lang": "en-US"},
    ]
    (model / "clips" / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr("asr_core.model.embedded_model_dir", lambda: model)
    speech = demo.demo_clip()
    assert speech is not None
    assert (speech.text, speech.lang, speech.source) == ("good morning", "en-US", "demo model clip en.wav")
    assert len(speech.pcm8k) == 4000  # 0.5 s at 8 kHz
