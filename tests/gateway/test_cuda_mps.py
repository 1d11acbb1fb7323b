"""The gateway's own CUDA MPS server for several engine processes (gateway/cuda_mps.py): when one is
started, and its control daemon's life — started as a child in its own directories, told `quit` and
reaped at the end, its failure a clear error (`on`) or a warning and no MPS (`auto`)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gateway.cuda_mps import PIPE_VAR, MpsError, MpsServer, plan_mps, start_for_engines
from tests.fixtures import mps_control, peers

BINARY = "/usr/bin/nvidia-cuda-mps-control"


def test_auto_starts_a_server_for_two_or_more_engines_where_the_nvidia_tools_are() -> None:
    plan = plan_mps("auto", 4, {}, BINARY)
    assert (plan.start, plan.binary) == (True, BINARY)


@pytest.mark.parametrize(
    ("setting", "engines", "env", "binary", "why"),
    [
        ("off", 4, {}, BINARY, "off"),
        ("auto", 1, {}, BINARY, "one engine process"),
        ("on", 1, {}, BINARY, "one engine process"),
        ("auto", 4, {PIPE_VAR: "/run/site-mps"}, BINARY, "the engines use that MPS server"),
        ("on", 4, {PIPE_VAR: "/run/site-mps"}, BINARY, "the engines use that MPS server"),
        ("auto", 4, {}, None, "not on PATH"),
    ],
)
def test_no_server_is_started_when(
    setting: str, engines: int, env: dict[str, str], binary: str | None, why: str
) -> None:
    plan = plan_mps(setting, engines, env, binary)  # type: ignore[arg-type]
    assert not plan.start and why in plan.reason


def test_on_without_the_nvidia_tools_is_a_startup_error() -> None:
    with pytest.raises(MpsError, match="not on PATH"):
        plan_mps("on", 2, {}, None)


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in control program first on PATH; returns the file it records to."""
    exe = mps_control.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_VAR, raising=False)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("MPS_STANDIN_RECORD", str(record))
    return record


def test_the_daemon_runs_in_private_directories_and_quits_at_stop(standin: Path) -> None:
    server, note = start_for_engines("auto", 2)
    assert server is not None and server.pid is not None
    assert note == f"the engines run through control daemon {server.pid} (2 engine processes share the GPU)"
    pipe, logs = Path(server.client_env[PIPE_VAR]), Path(server.client_env["CUDA_MPS_LOG_DIRECTORY"])
    assert pipe.is_dir() and logs.is_dir() and (pipe / "control").exists()
    assert pipe.stat().st_mode & 0o077 == 0  # only this user's processes can reach it
    assert standin.read_text().splitlines() == [f"daemon {server.pid} {pipe} {logs}"]
    assert server.stop() == 0
    assert standin.read_text().splitlines()[1:] == ["client quit", "daemon exits"]
    assert not server.root.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


def test_a_daemon_that_fails_is_an_error_with_its_words_under_on_and_a_warning_under_auto(
    standin: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MPS_STANDIN_FAIL", "An instance of this daemon is already running")
    before = set(Path(tempfile.gettempdir()).glob("ttg-mps-*"))
    with pytest.raises(MpsError, match="status 3: An instance of this daemon is already running"):
        start_for_engines("on", 2)
    with caplog.at_level(logging.WARNING, logger="gateway.cuda_mps"):
        server, note = start_for_engines("auto", 2)
    assert server is None and note is not None and "already running" in note
    assert "time-sliced" in caplog.text and "already running" in caplog.text
    assert set(Path(tempfile.gettempdir()).glob("ttg-mps-*")) == before  # its directories removed


def test_stop_kills_a_daemon_that_does_not_quit(standin: Path, tmp_path: Path) -> None:
    server = MpsServer(str(mps_control.install(tmp_path / "deaf")))
    server.start()
    # Its client now sends nothing: a daemon that never hears `quit`.
    (tmp_path / "deaf" / mps_control.NAME).write_text("#!/bin/sh\ncat > /dev/null\n")
    assert server.stop(timeout=0.5) is None
    assert server.proc is not None and server.proc.returncode is not None


def test_one_engine_has_nothing_to_say_about_mps(standin: Path) -> None:
    """A bundle that does not load stays a one-line error: nothing is logged for one engine."""
    assert start_for_engines("auto", 1) == (None, None)
    assert not standin.exists()  # no daemon was started


@peers.linux_only  # PR_SET_PDEATHSIG is Linux's
def test_a_gateway_killed_outright_leaves_no_control_daemon(standin: Path, tmp_path: Path) -> None:
    """SIGKILL (the OOM killer) skips the gateway's shutdown; its control daemon goes with it."""
    script = (
        "import os, signal, sys\n"
        "from gateway.cuda_mps import MpsServer\n"
        f"server = MpsServer({str(mps_control.install(tmp_path / 'bin'))!r})\n"
        "server.start()\n"
        "print(server.pid, server.root, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, root = proc.stdout.split()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(root, ignore_errors=True)
    assert not Path(f"/proc/{pid}").exists()
