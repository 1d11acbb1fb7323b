"""`make demo` (`python -m tools.demo`): the whole gateway on this machine, one real call, its transcript.

    python -m tools.demo [--timeout 120] [--caller auto|sipp|replay] [--text "..."] [--keep]

1. a private redis-server on a free loopback port (files in a temporary directory);
2. `ttg serve` on the embedded demo model (a generated tiny random bundle until that ships: its
   transcripts are noise, and the demo says so), SIP/RTP/HTTP on free loopback ports;
3. speech: one of the demo model's held-out clips (asr_core/demo_model/clips/), else espeak-ng;
4. a real SIP call: sipp (Debian's sip-tester) sends INVITE/ACK, streams the audio as 8 kHz µ-law
   RTP (rtp_stream) and hangs up; where sipp is missing (a Mac), `ttg replay` places the call;
5. the call's events read back from Redis, printed by `ttg tail --call <id>`;
6. everything stopped by PID (SIGTERM; the gateway must exit 0), the temporary directory removed.

Every wait has a deadline within `--timeout`; on failure the reason and the gateway's last log lines
are printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.ports import free_port, port_block

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = (
    "Hello, thank you for calling. I would like to check the balance of my account, please. "
    "My account number is four nine zero five."
)
STREAM = "ttg:transcripts"


class DemoError(Exception):
    """What went wrong, for the newcomer: printed as is."""


def say(step: str, text: str) -> None:
    print(f"ttg demo: {step:<12} {text}", flush=True)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.total = seconds
        self.end = time.monotonic() + seconds

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise DemoError(f"the demo ran out of its {self.total:g} s while {what}")
        return left

    def wait(self, ok: Callable[[], bool], what: str, every_s: float = 0.1) -> None:
        while not ok():
            self.left(what)
            time.sleep(every_s)


# --- ports and processes -----------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM by PID, SIGKILL if it does not exit in time; returns the exit status."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        return self.popen.returncode

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def start(name: str, cmd: list[str], workdir: Path, env: dict[str, str] | None = None) -> Proc:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return Proc(name, popen, log)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()
    except (OSError, urllib.error.URLError):
        return 0, ""


def project_env() -> dict[str, str]:
    """This checkout importable, and no TTG_*/NEMO_* of the caller's shell changing the demo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTG_", "NEMO_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_redis(workdir: Path, procs: list[Proc], deadline: Deadline) -> int:
    """A private redis-server on a free loopback port (no persistence), up and answering; its port."""
    import redis

    port = free_port()
    cmd = [shutil.which("redis-server") or "redis-server", "--port", str(port),
           "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", "--appendonly", "no"]  # fmt: skip
    server = start("redis", cmd, workdir)
    procs.append(server)

    def up() -> bool:
        if not server.alive():
            raise DemoError(f"redis-server exited: {server.tail(5)}")
        with contextlib.suppress(redis.RedisError), redis.Redis(port=port, socket_timeout=0.5) as r:
            return bool(r.ping())
        return False

    deadline.wait(up, "starting redis-server")
    return port


def start_gateway(
    workdir: Path,
    procs: list[Proc],
    deadline: Deadline,
    *,
    sip_port: int,
    http_port: int,
    redis_url: str,
    rtp_ports: str,
    max_calls: int,
    model: Path | None = None,
) -> Proc:
    """`ttg serve` on loopback (the embedded demo model unless `model`), waited for until /readyz."""
    cmd = [
        sys.executable, "-m", "gateway", "serve",
        *(["--model", str(model.resolve())] if model is not None else []),
        "--sip-host", "127.0.0.1", "--sip-port", str(sip_port),
        "--rtp-host", "127.0.0.1", "--rtp-ports", rtp_ports, "--max-calls", str(max_calls),
        "--http-host", "127.0.0.1", "--http-port", str(http_port),
        "--redis-url", redis_url, "--spool-dir", str(workdir / "spool"),
    ]  # fmt: skip
    gateway = start("gateway", cmd, workdir, project_env())
    procs.append(gateway)

    def ready() -> bool:
        if not gateway.alive():
            raise DemoError(f"ttg serve exited with {gateway.popen.returncode}:\n{gateway.tail()}")
        return http_get(f"http://127.0.0.1:{http_port}/readyz")[0] == 200

    deadline.wait(ready, "waiting for the gateway's /readyz")
    return gateway


# --- audio -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Speech:
    pcm8k: np.ndarray  # float32, 8 kHz mono
    text: str  # what is said (the reference transcript)
    lang: str
    source: str  # where it came from, for the progress line


def demo_clip() -> Speech | None:
    """The first English held-out clip the demo model ships, if it does."""
    import soundfile as sf
    import soxr

    from asr_core.model import embedded_model_dir

    model = embedded_model_dir()
    manifest = model / "clips" / "manifest.jsonl" if model is not None else None
    if manifest is None or not manifest.is_file():
        return None
    rows = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda r: r.get("lang") != "en-US")
    for row in rows:
        path = manifest.parent / row["audio"]
        if path.is_file():
            data, rate = sf.read(str(path), dtype="float32", always_2d=True)
            pcm = soxr.resample(data.mean(axis=1), rate, 8000, "HQ").astype(np.float32)
            return Speech(pcm, row["text"], row.get("lang", "en-US"), f"demo model clip {path.name}")
    return None


def espeak(text: str, workdir: Path) -> Speech:
    import soundfile as sf
    import soxr

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise DemoError("espeak-ng is not installed (Debian: apt-get install espeak-ng; `make deps` does it)")
    wav = workdir / "speech.wav"
    subprocess.run([exe, "-v", "en-us", "-s", "160", "-w", str(wav), text], check=True, timeout=60)
    data, rate = sf.read(str(wav), dtype="float32")
    pcm = soxr.resample(data, rate, 8000, "HQ").astype(np.float32)
    return Speech(pcm, text, "en-US", "espeak-ng")


def to_ulaw(speech: Speech, path: Path) -> int:
    """Raw µ-law (what sipp's rtp_stream sends byte for byte), padded to whole 20 ms packets."""
    from gateway.audio import g711

    quiet = np.zeros(8 * 300, np.float32)  # a little line silence before and after the words
    pcm = np.concatenate([quiet, speech.pcm8k, quiet])
    pcm = np.concatenate([pcm, np.zeros(-len(pcm) % 160, np.float32)])
    codes = g711.encode(np.clip(np.round(pcm * 32767), -32768, 32767).astype(np.int16), "PCMU")
    path.write_bytes(codes)
    return len(codes)


# --- the call ----------------------------------------------------------------------------------------

SIPP_SCENARIO = """<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="ttg demo call">
  <send retrans="500"><![CDATA[

      INVITE sip:1000@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch];rport
      From: "demo" <sip:demo@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:1000@[remote_ip]:[remote_port]>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: <sip:demo@[local_ip]:[local_port]>
      Max-Forwards: 70
      X-Language: @LANG@
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=- 1 1 IN IP[local_ip_type] [local_ip]
      s=-
      c=IN IP[media_ip_type] [media_ip]
      t=0 0
      m=audio [rtpstream_audio_port] RTP/AVP 0 101
      a=rtpmap:0 PCMU/8000
      a=rtpmap:101 telephone-event/8000
      a=ptime:20
      a=sendrecv

  ]]></send>
  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="200" rtd="true"/>
  <send><![CDATA[

      ACK sip:1000@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch];rport
      From: "demo" <sip:demo@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:1000@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Max-Forwards: 70
      Content-Length: 0

  ]]></send>
  <nop><action><exec rtp_stream="@AUDIO@,1,0"/></action></nop>
  <pause milliseconds="@HOLD_MS@"/>
  <send retrans="500"><![CDATA[

      BYE sip:1000@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch];rport
      From: "demo" <sip:demo@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:1000@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 2 BYE
      Max-Forwards: 70
      Content-Length: 0

  ]]></send>
  <recv response="200" crlf="true"/>
</scenario>
"""


def call_with_sipp(sip_port: int, speech: Speech, workdir: Path, deadline: Deadline) -> str:
    """One call; returns its SIP Call-ID."""
    ulaw = workdir / "speech.ulaw"
    samples = to_ulaw(speech, ulaw)
    hold_ms = samples // 8 + 1500  # the audio, then a pause so the last words end an utterance
    scenario = workdir / "call.xml"
    text = SIPP_SCENARIO.replace("@AUDIO@", str(ulaw)).replace("@HOLD_MS@", str(hold_ms))
    scenario.write_text(text.replace("@LANG@", speech.lang))
    call_id = f"ttg-demo-{os.getpid()}@127.0.0.1"
    cmd = [
        shutil.which("sipp") or "sipp", f"127.0.0.1:{sip_port}", "-sf", str(scenario), "-m", "1",
        "-i", "127.0.0.1", "-p", str(free_port()), "-mi", "127.0.0.1", "-mp", str(port_block(4)),
        "-cid_str", call_id,
        "-timeout", f"{int(deadline.left('placing the call'))}s", "-timeout_error", "-nostdin",
        "-trace_err", "-error_file", str(workdir / "sipp_errors.log"),
    ]  # fmt: skip
    sipp = start("sipp", cmd, workdir)
    try:
        sipp.popen.wait(deadline.left("the call was in progress") + 5)
    except subprocess.TimeoutExpired:
        sipp.stop(5)
        raise DemoError("sipp did not finish the call in time") from None
    if sipp.popen.returncode != 0:
        err_file = workdir / "sipp_errors.log"
        errors = err_file.read_text(errors="replace") if err_file.exists() else ""
        raise DemoError(f"sipp's call failed (exit {sipp.popen.returncode}): {errors.strip()[-500:]}")
    return call_id


def call_with_replay(sip_port: int, redis_url: str, speech: Speech, workdir: Path, deadline: Deadline) -> str:
    import soundfile as sf

    from tools.replay import LanguageMix, LoadConfig, MediaConfig, ReplayConfig, run_replay

    audio = workdir / "audio"
    audio.mkdir()
    sf.write(str(audio / "speech.wav"), speech.pcm8k, 8000, subtype="PCM_16")
    (audio / "speech.txt").write_text(speech.text + "\n", encoding="utf-8")
    cfg = ReplayConfig(
        target=("127.0.0.1", sip_port),
        audio_dir=audio,
        lang=LanguageMix(((speech.lang, 1.0),)),
        media=MediaConfig(tail_ms=1500),
        load=LoadConfig(calls=1),
        redis_url=redis_url,
        metrics_url=None,
        run_timeout_s=deadline.left("placing the call"),
        call_id_prefix="ttg-demo",
    )
    rep = run_replay(cfg)
    (result,) = rep.calls
    if result.outcome != "completed":
        raise DemoError(f"the call did not complete: {result.outcome} {result.detail}")
    return result.sip_call_id


# --- reading back --------------------------------------------------------------------------------------


def call_events(redis_url: str, sip_call_id: str) -> tuple[str | None, bool]:
    """(the gateway's call_id for this SIP call, whether its call_end is in the stream)."""
    import redis

    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        entries = r.xrange(STREAM)
    call_id = next((f["call_id"] for _, f in entries if f.get("sip_call_id") == sip_call_id), None)
    ended = any(f.get("type") == "call_end" and f.get("call_id") == call_id for _, f in entries)
    return call_id, ended


# --- the run -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def workspace(keep: bool) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="ttg-demo-"))
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        if keep or not ok:
            say("files", f"logs and files are in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.timeout)
    caller = args.caller
    if caller == "auto":
        caller = "sipp" if shutil.which("sipp") else "replay"
    if shutil.which("redis-server") is None:
        raise DemoError("redis-server is not installed (Debian: apt-get install redis-server; `make deps`)")
    if caller == "sipp" and shutil.which("sipp") is None:
        raise DemoError("sipp is not installed (Debian: apt-get install sip-tester; `make deps`)")
    procs: list[Proc] = []
    with workspace(args.keep) as tmp:
        try:
            return _run(args, caller, deadline, tmp, procs)
        finally:
            for p in reversed(procs):
                if p.alive():
                    p.stop(10)


def _run(args: argparse.Namespace, caller: str, deadline: Deadline, tmp: Path, procs: list[Proc]) -> int:
    env = project_env()
    # 1. Redis
    redis_port = start_redis(tmp, procs, deadline)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    say("1/5 redis", f"redis-server (pid {procs[0].popen.pid}) answers on 127.0.0.1:{redis_port}")

    # 2. the gateway
    sip_port, http_port, rtp_min = free_port(), free_port(), port_block(100)
    say("2/5 gateway", f"starting `ttg serve` (SIP 127.0.0.1:{sip_port}, HTTP 127.0.0.1:{http_port}) ...")
    t0 = time.monotonic()
    gateway = start_gateway(
        tmp, procs, deadline, sip_port=sip_port, http_port=http_port, redis_url=redis_url,
        rtp_ports=f"{rtp_min}-{rtp_min + 99}", max_calls=10,
    )  # fmt: skip
    log = gateway.log.read_text(errors="replace")
    model = "the embedded demo model" if "model demo" in log else "the bundle in TTG_MODEL__DIR"
    say("2/5 gateway", f"ready in {time.monotonic() - t0:.1f} s (pid {gateway.popen.pid}) on {model}")

    # 3. speech
    speech = demo_clip() or espeak(args.text, tmp)
    seconds = len(speech.pcm8k) / 8000
    say("3/5 audio", f'{seconds:.1f} s of speech ({speech.source}, {speech.lang}): "{speech.text}"')

    # 4. the call
    how = "sipp sends INVITE, streams G.711 µ-law RTP, then BYE" if caller == "sipp" else "`ttg replay` calls"
    say("4/5 call", f"{how} to sip:1000@127.0.0.1:{sip_port} ...")
    if caller == "sipp":
        sip_call_id = call_with_sipp(sip_port, speech, tmp, deadline)
    else:
        sip_call_id = call_with_replay(sip_port, redis_url, speech, tmp, deadline)
    found: dict[str, str] = {}

    def ended() -> bool:
        call_id, done = call_events(redis_url, sip_call_id)
        if call_id:
            found["call_id"] = call_id
        return done

    deadline.wait(ended, "waiting for the call's call_end event in Redis")
    call_id = found["call_id"]
    say("4/5 call", f"done: SIP Call-ID {sip_call_id} is call {call_id} in Redis")

    # 5. the transcript, as `ttg tail` prints it
    say("5/5 result", f"`ttg tail --call {call_id}` prints:")
    tail = subprocess.run(
        [sys.executable, "-m", "gateway", "tail", "--url", redis_url, "--call", call_id],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=deadline.left("reading the transcript"),
        check=False,
    )  # fmt: skip
    for line in tail.stdout.splitlines():
        print(f"    {line}", flush=True)
    if tail.returncode != 0:
        raise DemoError(f"ttg tail failed: {tail.stderr.strip()}")
    say("5/5 result", f'what was said: "{speech.text}"')

    # 6. stop
    code = gateway.stop(max(5.0, deadline.left("stopping the gateway")))
    if code != 0:
        raise DemoError(f"ttg serve exited with {code} on SIGTERM:\n{gateway.tail()}")
    procs[0].stop(10)
    say("stopped", "gateway (exit 0) and redis-server stopped; try `ttg serve` yourself: README.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    parser.add_argument(
        "--caller", choices=["auto", "sipp", "replay"], default="auto", help="who places the call"
    )
    parser.add_argument("--text", default=DEFAULT_TEXT, help="what espeak-ng says (without the demo model)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DemoError as e:
        print(f"ttg demo: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("ttg demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
