"""A CUDA MPS server of the gateway's own, for several engine processes on one NVIDIA GPU.

Why: each engine process has a CUDA context of its own, and a GPU time-slices between contexts — one
engine's kernels never run beside another's, and an engine's step waits out the others' slices. Under
the Multi-Process Service the engines' work goes through one server and their kernels run side by side
(docs/benchmarks.md, "The engines through CUDA MPS": 1 500 calls on an H200 at p95 0.57 s instead of
0.90 s).

The server belongs to this gateway: the control daemon runs as its child (`-f`, in a session of its own
so that a signal to the gateway's process group does not stop it under engines still draining; on
Linux it gets SIGTERM if the gateway dies outright), with
its pipe and log directories in a private temporary directory, and only the engine processes are given
those directories (`CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`); other users of the GPU do not
go through it, and the GPU's compute mode is left as it is. At shutdown, after the engines stopped, the
daemon is told `quit` (it waits for its clients) and reaped; one that does not go is killed by PID.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

MpsSetting = Literal["auto", "on", "off"]
CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_VAR = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VAR = "CUDA_MPS_LOG_DIRECTORY"
READY_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class MpsError(RuntimeError):
    """The MPS control daemon could not be started."""


@dataclass(frozen=True, slots=True)
class MpsPlan:
    """Whether to start a server, and why (or why not): logged once the engines are up."""

    start: bool
    reason: str
    binary: str | None = None


def plan_mps(setting: MpsSetting, engines: int, env: dict[str, str], binary: str | None) -> MpsPlan:
    """`TTG_DAEMON__CUDA_MPS` against the situation. `binary`: the control daemon's path, None when it is
    not on PATH. `auto` starts one for two or more engines where the NVIDIA tools are installed; `on`
    insists (no binary is then a startup error); an MPS server the environment names already
    (`CUDA_MPS_PIPE_DIRECTORY`, e.g. the site's own) is used as it is."""
    if setting == "off":
        return MpsPlan(False, "TTG_DAEMON__CUDA_MPS=off")
    if engines < 2:
        return MpsPlan(False, "one engine process: nothing to share the GPU with")
    if env.get(PIPE_VAR):
        return MpsPlan(False, f"{PIPE_VAR} is set: the engines use that MPS server")
    if binary is None:
        if setting == "on":
            raise MpsError(f"TTG_DAEMON__CUDA_MPS=on but {CONTROL_BINARY} is not on PATH")
        return MpsPlan(False, f"{CONTROL_BINARY} is not on PATH (no NVIDIA driver tools)")
    return MpsPlan(True, f"{engines} engine processes share the GPU", binary)


class MpsServer:
    """The control daemon, started by `start()` and stopped by `stop()`; `client_env` is what the engine
    processes add to their environment."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="ttg-mps-"))
        self.client_env = {PIPE_VAR: str(self.root / "pipe"), LOG_VAR: str(self.root / "log")}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start the daemon and wait for its pipes (MpsError if it exits or never makes them)."""
        for d in self.client_env.values():
            Path(d).mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.root / "stdio.log", "wb") as out:
            self.proc = subprocess.Popen(
                [self.binary, "-f"],
                env={**os.environ, **self.client_env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_dies_with_parent(os.getpid()) if sys.platform == "linux" else None,
            )
        # Ready once its pipes exist: a client that looked earlier would run without MPS.
        pipes = Path(self.client_env[PIPE_VAR])
        deadline = time.monotonic() + timeout
        while not any(pipes.iterdir()):
            if self.proc.poll() is not None:
                status = self.proc.returncode
                raise MpsError(f"{self.binary} -f exited with status {status}: {self._output()}")
            if time.monotonic() > deadline:
                self._kill()
                raise MpsError(f"{self.binary} made no pipe within {timeout:.0f} s: {self._output()}")
            time.sleep(0.05)

    def stop(self, timeout: float = QUIT_TIMEOUT_S) -> int | None:
        """`quit` (the daemon waits for its clients, so stop the engines first), reap it, remove the
        directories; the daemon's exit status (None if it had to be killed or never started)."""
        status: int | None = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                subprocess.run(
                    [self.binary],
                    input=b"quit\n",
                    env={**os.environ, **self.client_env},
                    capture_output=True,
                    timeout=timeout,
                    check=False,
                )
                status = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the CUDA MPS control daemon (pid %d) did not quit: killing it", self.proc.pid)
                self._kill()
        elif self.proc is not None:
            status = self.proc.returncode
        shutil.rmtree(self.root, ignore_errors=True)
        return status

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _output(self) -> str:
        try:
            return (self.root / "stdio.log").read_text(errors="replace").strip()[-500:] or "no output"
        except OSError:
            return "no output"


def _dies_with_parent(parent: int) -> Callable[[], None]:
    """Run in the child before exec (Linux): SIGTERM to it when the thread that started it ends, so a
    gateway killed outright (SIGKILL, the OOM killer) leaves no control daemon behind. The gateway
    starts it from its main thread, which lives as long as the process."""

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent was gone before the line above
            os._exit(1)

    return arm


def start_for_engines(setting: MpsSetting, engines: int) -> tuple[MpsServer | None, str | None]:
    """The startup step: plan, start if planned (MpsError: `on` and it could not). Returns the server
    and what to log once the engines are up (None with one engine: nothing to say). `auto` goes on
    without MPS when the daemon fails to start, with a warning now."""
    plan = plan_mps(setting, engines, dict(os.environ), shutil.which(CONTROL_BINARY))
    note = None if engines < 2 else f"not started ({plan.reason})"
    if not plan.start or plan.binary is None:
        return None, note
    server = MpsServer(plan.binary)
    try:
        server.start()
    except MpsError as e:
        server.stop()
        if setting == "on":
            raise
        logger.warning("CUDA MPS: could not start, the engines share the GPU time-sliced: %s", e)
        return None, f"not started ({e})"
    return server, f"the engines run through control daemon {server.pid} ({plan.reason})"
