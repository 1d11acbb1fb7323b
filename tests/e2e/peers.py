"""Third-party SIP software the interop tests drive against `ttg serve` (Debian packages, installed
by `make deps`): baresip and linphone (softphones, headless), Kamailio (a proxy/dispatcher) and
sipvicious.

Each runs as a real process on loopback ports, started and stopped by its PID, bounded in time.
A peer that is not installed fails the test (CI must not pass without it).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import REPO, STREAM, Serve, espeak_8k, terminate, until
from tests.fixtures.peers import tool
from tools.ports import free_port, port_block

KAMAILIO_CFG = REPO / "ops" / "kamailio" / "kamailio.cfg"


def the_call(redis_url: str) -> tuple[dict[str, str], list[dict[str, str]], dict[str, str]]:
    """The one call in the stream, audited: its call_start, every event, its call_end."""
    report = audit(read_stream(redis_url, STREAM))
    assert not report.problems, report.problems
    (events,) = report.calls.values()
    start, end = events[0], events[-1]
    assert start["type"] == "call_start" and end["type"] == "call_end"
    return start, events, end


async def call_ended(redis_url: str, gw: Serve, timeout_s: float = 30.0) -> None:
    """Until a call_end is in the stream."""

    def ended() -> bool:
        return any(f["type"] == "call_end" for _, f in read_stream(redis_url, STREAM))

    await until(ended, "call_end in Redis", timeout_s=timeout_s, detail=gw.log_tail)


def speech_wav(workdir: Path, sentences: Sequence[str], *, tail_silence_s: float = 0.0) -> Path:
    """espeak-ng speech as an 8 kHz 16-bit mono WAV (baresip's aufile source plays it at 8 kHz)."""
    parts = [espeak_8k(text, workdir) for text in sentences]
    pcm = np.concatenate([*parts, np.zeros(int(8000 * tail_silence_s), np.float32)])
    path = workdir / "speech8k.wav"
    sf.write(str(path), pcm, 8000, subtype="PCM_16")
    return path


class _Phone:
    """What the softphones share: a process driven over one control socket, and a log."""

    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _sock: socket.socket | None = None

    def stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self.proc is not None:
            terminate(self.proc, 10.0)

    def log_tail(self, n: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.replace("\r", "\n").splitlines()[-n:])


# --- baresip ---------------------------------------------------------------------------------------


class Baresip(_Phone):
    """One headless baresip (v1.x): `aufile` plays `audio` into every call, `ctrl_tcp` takes commands
    (netstring-framed JSON: dial, sndcode, hangup) and reports call events, which a thread collects."""

    def __init__(self, workdir: Path, audio: Path, *, codecs: str = "PCMA", password: str = "") -> None:
        self.workdir = workdir / "baresip"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.binary = tool("baresip")
        base = port_block(24, tcp=True)  # SIP (UDP/TCP) at base, TLS at base+1 (libre's default), RTP after
        self.sip_port = base
        self.ctrl_port = free_port()
        (self.workdir / "config").write_text(
            "\n".join(
                [
                    "poll_method epoll",
                    f"sip_listen 127.0.0.1:{self.sip_port}",
                    "net_interface 127.0.0.1",
                    f"audio_source aufile,{audio}",
                    f"audio_player aufile,{self.workdir / 'played.wav'}",
                    f"audio_alert aufile,{self.workdir / 'alert.wav'}",
                    "ausrc_srate 8000",
                    "auplay_srate 8000",
                    "ausrc_channels 1",
                    f"rtp_ports {base + 4}-{base + 23}",
                    # baresip's own no-RTP timeout, shorter than every call here: the gateway answers
                    # recvonly and sends no RTP, which baresip must not take for a dead call (it checks
                    # only a stream it receives on: "check_rtp: not checking (dir=sendonly)").
                    "rtp_timeout 2",
                    "module_path /usr/lib/baresip/modules",
                    "module g711.so",
                    "module aufile.so",
                    "module account.so",
                    "module menu.so",
                    "module ctrl_tcp.so",
                    f"ctrl_tcp_listen 127.0.0.1:{self.ctrl_port}",
                    "",
                ]
            )
        )
        auth = f";auth_user=trunk;auth_pass={password}" if password else ""  # answers digest challenges
        account = f"<sip:trunk@127.0.0.1>;regint=0;audio_codecs={codecs}{auth}"
        (self.workdir / "accounts").write_text(account + "\n")
        self.log_path = self.workdir / "baresip.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._events: list[dict[str, Any]] = []
        self._responses: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None

    def start(self, timeout_s: float = 20.0) -> Baresip:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [self.binary, "-f", str(self.workdir)], cwd=self.workdir, stdin=subprocess.DEVNULL,
            stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while self._sock is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"baresip did not start: {self.log_tail()}")
            try:
                self._sock = socket.create_connection(("127.0.0.1", self.ctrl_port), timeout=1.0)
            except OSError:
                time.sleep(0.1)
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def command(self, command: str, params: str = "", timeout_s: float = 10.0) -> dict[str, Any]:
        assert self._sock is not None
        body = json.dumps({"command": command, "params": params, "token": command}).encode()
        with self._cond:
            n = len(self._responses)
            self._sock.sendall(b"%d:%s," % (len(body), body))
            if not self._cond.wait_for(lambda: len(self._responses) > n, timeout_s):
                raise TimeoutError(f"baresip did not answer {command}: {self.log_tail()}")
            response = self._responses[n]
        if not response.get("ok"):
            raise RuntimeError(f"baresip refused {command} {params}: {response}")
        return response

    def wait_event(self, kind: str, timeout_s: float = 20.0) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: any(e["type"] == kind for e in self._events), timeout_s):
                got = [e["type"] for e in self._events]
                raise TimeoutError(f"no baresip event {kind} in {timeout_s} s (got {got}): {self.log_tail()}")
            return next(e for e in self._events if e["type"] == kind)

    @property
    def events(self) -> list[str]:
        with self._cond:
            return [e["type"] for e in self._events]

    def _read(self) -> None:
        assert self._sock is not None
        buf = b""
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            buf += data
            while b":" in buf:
                size, _, rest = buf.partition(b":")
                n = int(size)
                if len(rest) < n + 1:
                    break
                message = json.loads(rest[:n])
                buf = rest[n + 1 :]
                with self._cond:
                    (self._events if message.get("event") else self._responses).append(message)
                    self._cond.notify_all()


# --- linphone --------------------------------------------------------------------------------------


class Linphone(_Phone):
    """One `linphone-daemon` (Debian's linphone-cli 5.x: liblinphone, belle-sip, mediastreamer2) with no
    sound card: commands over its Unix socket (`--pipe`, /tmp/NAME), call state by polling `call-status`,
    the call's audio from a WAV file (`incall-player-start`).

    Two quirks of that build the tests work around: the player's end of file crashes the daemon
    (SIGSEGV in its player callback), so `audio` must outlast the call (`speech_wav`'s tail silence);
    and the SIP transport is set by the `port` command (the daemon opens none from its configuration).
    `nortp_timeout_s`: linphone ends a call when neither RTP nor RTCP came for this long."""

    def __init__(
        self,
        workdir: Path,
        audio: Path,
        *,
        password: str = "",
        algorithm: str = "MD5",
        nortp_timeout_s: int = 30,
    ) -> None:
        self.workdir = workdir / "linphone"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.binary = tool("linphone-daemon")
        self.audio = audio
        base = port_block(4, tcp=True)  # SIP at base, RTP/RTCP at base+2 and base+3
        self.sip_port = base
        self.rtp_port = base + 2
        self.pipe = f"ttg-linphone-{os.getpid()}-{base}"
        lines = [
            "[sip]",
            "sip_port=-1",
            "sip_tcp_port=-1",
            "contact=<sip:trunk@127.0.0.1>",
            "[rtp]",
            f"audio_rtp_port={self.rtp_port}-{self.rtp_port}",
            f"nortp_timeout={nortp_timeout_s}",
        ]
        if password:  # answers the gateway's digest challenge for realm "ttg" with this algorithm only
            lines += [
                "[auth_info_0]",
                "username=trunk",
                f"passwd={password}",
                "realm=ttg",
                "domain=127.0.0.1",
                f"algorithm={algorithm}",
                f"available_algorithms={algorithm}",
            ]
        self.config = self.workdir / "linphonerc"
        self.config.write_text("\n".join(lines) + "\n")
        self.log_path = self.workdir / "linphone.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def socket_path(self) -> Path:
        return Path("/tmp") / self.pipe

    def start(self, transport: str = "udp", timeout_s: float = 20.0) -> Linphone:
        out = (self.workdir / "daemon.out").open("ab")
        (self.workdir / ".local/share/linphone").mkdir(parents=True, exist_ok=True)  # its call history
        self.proc = subprocess.Popen(
            [self.binary, "--config", str(self.config), "--pipe", self.pipe, "--log", str(self.log_path)],
            cwd=self.workdir, env={**os.environ, "HOME": str(self.workdir)}, stdin=subprocess.DEVNULL,
            stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
        out.close()
        deadline = time.monotonic() + timeout_s
        while self._sock is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"linphone-daemon did not start: {self.log_tail()}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.socket_path))
            except OSError:
                sock.close()
                time.sleep(0.1)
                continue
            self._sock = sock
        self.command("port", "sip", str(self.sip_port), transport)
        return self

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def command(self, *words: str, timeout_s: float = 10.0) -> dict[str, str]:
        """One command; its answer's `Key: Value` lines. Raises on `Status: Error`.

        One connection for all (the daemon serves one client at a time, and notices a closed one late).
        Its answers have no end marker; each is written at once, so what comes within 0.2 s of the first
        bytes is the answer."""
        sock = self._sock
        assert sock is not None
        with self._lock:
            sock.settimeout(timeout_s)
            sock.sendall(" ".join(words).encode() + b"\n")
            data = sock.recv(65536)
            sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                while chunk := sock.recv(65536):
                    data += chunk
        answer = dict(
            line.split(": ", 1) for line in data.decode(errors="replace").splitlines() if ": " in line
        )
        if answer.get("Status") != "Ok":
            raise RuntimeError(f"linphone refused {' '.join(words)}: {answer}")
        return answer

    def state(self) -> str:
        """The current call's state (LinphoneCallStreamsRunning, ...), or "" when there is none."""
        try:
            return self.command("call-status").get("State", "")
        except RuntimeError:  # "No current call available."
            return ""

    def wait_state(self, state: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (now := self.state()) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"linphone call not {state or 'ended'} (is {now!r}): {self.log_tail()}")
            time.sleep(0.2)

    def dial(self, uri: str) -> None:
        """Call `uri`, and once the call is up, play the audio into it."""
        self.command("call", uri)
        self.wait_state("LinphoneCallStreamsRunning")
        self.command("incall-player-start", str(self.audio))


# --- Kamailio ----------------------------------------------------------------------------------------


class Kamailio:
    """ops/kamailio/kamailio.cfg in the foreground, its listen address, gateway list and probe interval
    given as -A defines (the file itself is used as shipped)."""

    def __init__(self, workdir: Path, gateways: Sequence[int], *, probe_interval_s: int = 1) -> None:
        self.workdir = workdir / "kamailio"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.binary = tool("kamailio")
        self.port = port_block(2)
        self.list_file = self.workdir / "dispatcher.list"
        self.list_file.write_text("".join(f"1 sip:127.0.0.1:{p} 0 0\n" for p in gateways))
        (self.workdir / "run").mkdir(exist_ok=True)
        self.log_path = self.workdir / "kamailio.log"
        self.probe_interval_s = probe_interval_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [
            self.binary, "-DD", "-E", "-f", str(KAMAILIO_CFG),
            "-A", f"LISTEN=udp:127.0.0.1:{self.port}",
            "-A", f'DISPATCHER_LIST="{self.list_file}"',
            "-A", f"PROBE_INTERVAL={self.probe_interval_s}",
            "-A", "CHILDREN=2",
            "-Y", str(self.workdir / "run"), "-P", str(self.workdir / "kamailio.pid"),
        ]  # fmt: skip

    def start(self, timeout_s: float = 20.0) -> Kamailio:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while "main(): processes" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kamailio did not start: {self.log()[-3000:]}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
