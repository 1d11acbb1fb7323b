"""The systemd unit passes `systemd-analyze verify`; the launchd plist is a valid property list."""

from __future__ import annotations

import plistlib
import subprocess
import sys
from pathlib import Path

from tests.fixtures import peers

from .queries import OPS

UNIT = OPS / "systemd" / "ttg.service"
PLIST = OPS / "launchd" / "org.ttg.gateway.plist"


@peers.linux_only
def test_the_systemd_unit_verifies_without_warnings(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert "ExecStart=/opt/ttg/.venv/bin/ttg serve" in text
    # The install path does not exist here: point ExecStart at a real executable to verify the rest.
    unit = tmp_path / "ttg.service"
    unit.write_text(text.replace("/opt/ttg/.venv/bin/ttg", sys.executable))
    analyze = peers.tool("systemd-analyze")
    res = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


def test_the_systemd_unit_keeps_its_spool_and_kernel_cache_across_restarts_and_stops_gracefully() -> None:
    text = UNIT.read_text()
    for line in [
        "StateDirectory=ttg",
        "Environment=TTG_SINK__SPOOL_DIR=/var/lib/ttg/spool",
        # MLX's compiled kernels (under the temp directory) outlive a restart: not the private /tmp
        "CacheDirectory=ttg",
        "Environment=TMPDIR=/var/cache/ttg",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ]:
        assert line in text.splitlines(), line


def test_the_launchd_plist_parses_and_runs_ttg_serve_with_restart_on_crash() -> None:
    with PLIST.open("rb") as f:
        job = plistlib.load(f)
    assert job["Label"] == "org.ttg.gateway"
    assert job["ProgramArguments"][-1] == "serve" and job["ProgramArguments"][0].endswith("/ttg")
    assert job["KeepAlive"] == {"SuccessfulExit": False} and job["RunAtLoad"] is True
    assert job["ExitTimeOut"] >= 10  # time to end calls and flush the sink before SIGKILL
    assert job["EnvironmentVariables"]["TTG_SINK__SPOOL_DIR"].startswith(job["WorkingDirectory"])


@peers.macos_only
def test_plutil_lints_the_plist() -> None:  # pragma: no cover  (macOS)
    subprocess.run(["plutil", "-lint", str(PLIST)], check=True, timeout=30)
