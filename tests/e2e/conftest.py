"""Daemon-level tests: `ttg serve` as a real subprocess on loopback ports, real redis-server, sipp as
the caller, speech made with espeak-ng. Every process is started and stopped by its PID (also when a
test fails); waits poll an observable condition (readiness, a Redis entry, a metric) with a deadline.

- `Serve`: one `python -m gateway serve` process (`start()`, `signal()`, `wait()`, `stop()`, `readyz()`,
  `metric()`); the `serve` fixture makes them and stops what is left after the test.
- `Speech`: raw 8 kHz µ-law (what sipp's rtp_stream sends as is), whole 20 ms packets.
- `sipp_call(...)`: run a sipp scenario against a gateway in a thread (bounded in calls and time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import soxr
from prometheus_client.parser import text_string_to_metric_families

from gateway.audio import g711
from gateway.audio.pipeline import AudioBlock, AudioPipeline
from gateway.config import RtpSettings
from tests.fixtures import peers
from tests.fixtures.telephony import SippResult, run_sipp
from tools.ports import free_port, port_block

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
SIPP_DATA = REPO / "tests" / "data" / "sipp"
STREAM = "ttg:transcripts"


@pytest.fixture(autouse=True)
def _daemon_peers() -> None:
    """sipp calls, espeak-ng speaks and redis-server stores in every test here."""
    for tool in ("sipp", "espeak-ng", "redis-server"):
        peers.tool(tool)


# --- ports ----------------------------------------------------------------------------------------------


def rtp_range(pairs: int = 100) -> tuple[int, int]:
    base = port_block(2 * pairs)
    return base, base + 2 * pairs - 1


# --- the daemon -------------------------------------------------------------------------------------------


# The process models `ttg serve` ships: everything in one process, and the engine in a process of its
# own with media worker processes (TTG_DAEMON__MEDIA_WORKERS). Every test that uses `serve` runs in both.
PROCESS_MODES = {"one_process": "0", "media_workers": "2"}


class Serve:
    """One `ttg serve` process with its own ports, log file and spool directory."""

    def __init__(
        self,
        workdir: Path,
        *,
        bundle: Path | str,
        redis_url: str,
        spool_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        max_calls: int = 40,
        mode: str = "one_process",
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bundle = bundle
        self.redis_url = redis_url
        self.spool_dir = spool_dir or self.workdir / "spool"
        self.mode = mode
        # A gateway sized for the test's calls: the adaptive call limit starts at max_calls, so that a
        # test's burst of calls is not refused before the limit has opened (its own spec sets it lower).
        self.extra_env = {
            "TTG_DAEMON__MEDIA_WORKERS": PROCESS_MODES[mode],
            "TTG_SIP__CALL_LIMIT_START": str(max_calls),
            **(env or {}),
        }
        self.args = list(args)
        self.max_calls = max_calls
        self.sip_port = free_port()
        self.http_port = free_port()
        self.rtp_ports = rtp_range()
        self.log_path = self.workdir / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        lo, hi = self.rtp_ports
        return [
            sys.executable, "-m", "gateway", "serve",
            "--model", str(self.bundle),
            "--sip-host", "127.0.0.1", "--sip-port", str(self.sip_port),
            "--rtp-host", "127.0.0.1", "--rtp-ports", f"{lo}-{hi}",
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--redis-url", self.redis_url, "--spool-dir", str(self.spool_dir),
            "--max-calls", str(self.max_calls),
            *self.args,
        ]  # fmt: skip

    @property
    def env(self) -> dict[str, str]:
        # The developer's own TTG_*/NEMO_* variables must not change what a test runs.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TTG_", "NEMO_"))}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        return env

    def start(self, *, wait: str = "ready", timeout_s: float = 120.0) -> Serve:
        """Start and wait until /readyz is 200 (`wait="ready"`) or only the model is up
        (`wait="loaded"`: Redis may be down, so readiness may say degraded)."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command, cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,  # a Ctrl-C of the test run is not the daemon's SIGINT
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ttg serve exited with {self.proc.returncode}: {self.log_tail()}")
            status, body = self.readyz()
            if status == 200 or (
                wait == "loaded" and status == 503 and "model not loaded" not in body["reasons"]
            ):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"ttg serve not ready within {timeout_s} s: {self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.running:
            os.kill(self.pid, sig)

    def signal_group(self, sig: signal.Signals) -> None:
        """`sig` to every process of the daemon's group (it leads its own session: `start`), as
        systemd's default KillMode and a terminal's Ctrl-C do."""
        if self.running:
            os.killpg(self.pid, sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 40.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns its exit status."""
        return None if self.proc is None else terminate(self.proc, timeout_s)

    def http(self, path: str, timeout_s: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=timeout_s) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()
        except (OSError, urllib.error.URLError):
            return 0, ""

    def readyz(self) -> tuple[int, dict[str, Any]]:
        status, text = self.http("/readyz")
        try:
            body = json.loads(text) if text else {"reasons": []}
        except json.JSONDecodeError:
            body = {"reasons": [text]}
        return status, body

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one sample of /metrics (0 when absent)."""
        status, text = self.http("/metrics")
        assert status == 200, f"/metrics answered {status}"
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 25) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def terminate(proc: subprocess.Popen[Any], timeout_s: float) -> int:
    """SIGTERM `proc` (by its PID), then SIGKILL if it has not exited within `timeout_s`; its status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


@pytest.fixture(params=list(PROCESS_MODES))
def serve(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Serve]]:
    """`serve(bundle=..., redis_url=..., **kw)` → a `Serve` (not started); all stopped after the test.
    Each test that uses it runs once per process mode."""
    made: list[Serve] = []

    def factory(**kwargs: Any) -> Serve:
        kwargs.setdefault("mode", request.param)
        s = Serve(tmp_path / f"serve{len(made)}", **kwargs)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.stop(timeout_s=20.0)


# --- speech -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Speech:
    path: Path  # raw 8 kHz µ-law, no header (rtp_stream sends the file's bytes as payload)
    samples: int

    @property
    def codes(self) -> bytes:
        return self.path.read_bytes()

    @property
    def ms(self) -> int:
        return self.samples // 8


def espeak_8k(text: str, workdir: Path) -> np.ndarray:
    wav = workdir / f"espeak-{abs(hash(text))}.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(wav), text], check=True, timeout=60)
    pcm, rate = sf.read(str(wav), dtype="float32")
    return np.asarray(soxr.resample(pcm, rate, 8000, "HQ"), dtype=np.float32)


def make_speech(workdir: Path, name: str, sentences: Sequence[str], pause_ms: int = 1500) -> Speech:
    """The sentences with `pause_ms` of digital silence between them (each pause closes an utterance
    for the endpointer), cut to whole 20 ms packets, as µ-law."""
    parts: list[np.ndarray] = []
    for i, text in enumerate(sentences):
        if i:
            parts.append(np.zeros(8 * pause_ms, np.float32))
        parts.append(espeak_8k(text, workdir))
    pcm = np.concatenate(parts)
    pcm = pcm[: len(pcm) // 160 * 160]
    codes = g711.encode(np.clip(np.round(pcm * 32767), -32768, 32767).astype(np.int16), "PCMU")
    path = workdir / f"{name}.ulaw"
    path.write_bytes(codes)
    return Speech(path, len(codes))


@pytest.fixture(scope="session")
def two_sentences(tmp_path_factory: pytest.TempPathFactory) -> Speech:
    return make_speech(
        tmp_path_factory.mktemp("speech"),
        "two",
        [
            "Thank you for calling, how can I help you today?",
            "I would like to check the balance of my account.",
        ],
    )


@pytest.fixture(scope="session")
def short_speech(tmp_path_factory: pytest.TempPathFactory) -> Speech:
    return make_speech(tmp_path_factory.mktemp("speech"), "short", ["One two three four five."])


def gateway_pcm(codes: bytes, codec: str = "PCMU", packet: int = 160) -> np.ndarray:
    """The 16 kHz audio the gateway hands to the engine for these G.711 packets, in order, no loss:
    its own pipeline fed packet by packet (soxr's output depends on the segment lengths it is run
    over at the level of float rounding, so only the same path gives the same floats)."""
    rtp = RtpSettings()
    pipeline = AudioPipeline(codec, rtp.block_ms, rtp.resample_quality)
    blocks: list[AudioBlock] = []
    for i in range(0, len(codes), packet):
        pipeline.append_codes(codes[i : i + packet], blocks)
    pipeline.finish(blocks)
    assert [b.start_ms for b in blocks] == [k * rtp.block_ms for k in range(len(blocks))]
    return np.concatenate([b.pcm for b in blocks])


# --- sipp ---------------------------------------------------------------------------------------------


def sipp_calls(
    sip_port: int,
    scenario: Path,
    workdir: Path,
    *,
    speech: Speech,
    calls: int = 1,
    limit: int | None = None,
    rate: float = 10.0,
    loops: int = 1,
    hold_ms: int = 0,
    timeout_s: float = 60.0,
) -> SippResult:
    """sipp places `calls` calls streaming `speech`, `rate` new calls per second, at most `limit` at once
    (default: all); `hold_ms`: the pause between ACK and BYE of scenarios that hang up themselves
    (uac_stream.xml)."""
    keys = {"dnis": "1000", "lang": "en-US", "pt": "0", "codec": "PCMU", "pad": "x"}
    extra = tuple(a for k, v in keys.items() for a in ("-key", k, v))
    if hold_ms:
        extra += ("-d", str(hold_ms))
    workdir.mkdir(parents=True, exist_ok=True)
    ports = port_block(8 + 4 * (limit or calls))  # sipp's own SIP port, then its RTP ports
    return run_sipp(
        scenario,
        sip_port,
        workdir,
        local_port=ports + 1,
        media_port=ports + 4,
        calls=calls,
        limit=limit or calls,
        rate=rate,
        timeout_s=timeout_s,
        extra=extra,
        substitute={"AUDIO": str(speech.path), "PT": "0", "LOOPS": str(loops)},
    )


async def until(
    predicate: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout_s: float = 30.0,
    every_s: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll `predicate` until it holds; fail naming `what` (and `detail()`, e.g. a log) after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            pytest.fail(
                f"timed out after {timeout_s} s waiting for: {what}" + (f"\n{detail()}" if detail else "")
            )
        await asyncio.sleep(every_s)
