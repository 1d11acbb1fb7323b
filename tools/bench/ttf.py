"""Time to final through real calls: redis-server + `ttg serve` + `ttg replay`, one command.

    ttg bench ttf [--calls 4] [--total 12] [--call-seconds 20] [--gateway-env TTG_X=Y ...]
                  [--gateway-cwd DIR] [--json OUT]

Starts a private redis-server and `ttg serve` with the embedded demo model on loopback, places
`--total` calls (`--calls` at a time) of espeak-ng speech with `ttg replay --generate` (two sentences
1.2 s apart per file, files repeated with `--gap-ms` until a call carries `--call-seconds`), and prints
the replay's time to final (TTF), time to first partial, WER and missing finals. TTF is replay's
definition (docs/replay.md): from the packet carrying an utterance's last speech sample (energy VAD of
the clip, 10 ms frames) to the arrival of its last final in Redis.

`--gateway-cwd DIR` runs the gateway from another checkout (e.g. a worktree of an older commit), so
the same command measures before and after a change; the replay always runs from this checkout.
`--gateway-env` passes settings to the gateway only. `--vad-ab` runs the same calls a second time
with `TTG_ASR__VAD=off` (utterances closed by the token-silence rules alone) and reports the WER
change caused by early finalization (same audio, same seed). Everything started is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tools import demo
from tools.bench.gateway import scrape
from tools.ports import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=4, help="concurrent calls")
    p.add_argument("--total", type=int, default=12, help="calls placed in all")
    p.add_argument("--call-seconds", type=float, default=20.0, help="speech per call (files repeated)")
    p.add_argument("--generate", type=int, default=8, help="espeak-ng files per language")
    p.add_argument("--gap-ms", type=int, default=1200, help="silence between files of a call")
    p.add_argument("--lang", default="en-US")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gateway-env", action="append", default=[], metavar="TTG_X=Y")
    p.add_argument("--gateway-cwd", type=Path, default=None, help="run `ttg serve` from this checkout")
    p.add_argument("--rtp-ports", default="44100-44399", help="the gateway's RTP range")
    p.add_argument("--replay-rtp-ports", default="44400-44699", help="the replay's RTP range")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--keep", type=Path, default=None, help="keep logs and the replay report here")
    p.add_argument("--vad-ab", action="store_true", help="also run with TTG_ASR__VAD=off: WER change")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")


def _gateway(
    args: argparse.Namespace, work: Path, procs: list[demo.Proc], deadline: demo.Deadline
) -> tuple[str, int, int]:
    redis_url = f"redis://127.0.0.1:{demo.start_redis(work, procs, deadline)}/0"
    sip_port, http_port = free_port(), free_port()
    env = demo.project_env()
    if args.gateway_cwd is not None:
        env["PYTHONPATH"] = str(args.gateway_cwd.resolve())
    for item in args.gateway_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("TTG_"):
            raise SystemExit(f"--gateway-env {item!r}: expected TTG_NAME=value")
        env[key] = value
    cmd = [
        sys.executable, "-m", "gateway", "serve",
        "--sip-host", "127.0.0.1", "--sip-port", str(sip_port),
        "--rtp-host", "127.0.0.1", "--rtp-ports", args.rtp_ports, "--max-calls", str(4 * args.calls),
        "--http-host", "127.0.0.1", "--http-port", str(http_port),
        "--redis-url", redis_url, "--spool-dir", str(work / "spool"),
    ]  # fmt: skip
    gateway = demo.start("gateway", cmd, args.gateway_cwd.resolve() if args.gateway_cwd else work, env)
    procs.append(gateway)

    def ready() -> bool:
        if not gateway.alive():
            raise demo.DemoError(f"ttg serve exited with {gateway.popen.returncode}:\n{gateway.tail()}")
        return demo.http_get(f"http://127.0.0.1:{http_port}/readyz")[0] == 200

    deadline.wait(ready, "waiting for the gateway's /readyz")
    return redis_url, sip_port, http_port


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 1)


def run(args: argparse.Namespace, work: Path, procs: list[demo.Proc]) -> dict[str, Any]:
    deadline = demo.Deadline(args.timeout)
    redis_url, sip_port, http_port = _gateway(args, work, procs, deadline)
    out = work / "replay"
    subprocess.run([
        sys.executable, "-m", "gateway", "replay", "--target", f"127.0.0.1:{sip_port}",
        "--generate", str(args.generate), "--lang", args.lang, "--calls", str(args.calls),
        "--total", str(args.total), "--call-seconds", str(args.call_seconds), "--gap-ms", str(args.gap_ms),
        "--seed", str(args.seed), "--rtp-ports", args.replay_rtp_ports, "--redis-url", redis_url,
        "--metrics-url", f"http://127.0.0.1:{http_port}/metrics", "--no-progress", "--out", str(out),
    ], cwd=work, env=demo.project_env(), check=True, timeout=deadline.left("replaying"))  # fmt: skip
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    s = report["summary"]
    inside = inside_the_gateway(scrape(f"http://127.0.0.1:{http_port}/metrics", INSIDE_METRICS))
    code = procs[-1].stop(30)
    if code != 0:
        raise demo.DemoError(f"ttg serve exited with {code}:\n{procs[-1].tail()}")
    return {
        "calls": args.calls,
        "total": args.total,
        "call_seconds": args.call_seconds,
        "gateway_env": args.gateway_env,
        "gateway_cwd": str(args.gateway_cwd) if args.gateway_cwd else None,
        "completed": s["completed"],
        "utterances": s["utterances"],
        "without_final": s["utterances_without_final"],
        "finals": s["finals"],
        "finals_outside": s["finals_outside"],
        "ttf_ms": {k: _ms(s["ttf_s"][k]) for k in ("p50", "p95", "p99", "mean", "max")},
        "ttfp_ms": {k: _ms(s["ttfp_s"][k]) for k in ("p50", "p95", "p99", "mean", "max")},
        "wer": s["wer"],
        "harness_cpu_percent": report["harness"]["cpu_percent"],
        "send_lateness_p99_ms": report["harness"]["send_lateness_ms"]["p99"],
        "inside_ms": inside,
    }


# Where a final's time goes inside the gateway, from its own histograms (means over the run).
INSIDE_METRICS = (
    "ttg_time_to_final_seconds",
    "ttg_transcript_latency_seconds",
    "ttg_asr_queue_wait_seconds",
    "ttg_encoder_step_seconds",
    "ttg_decoder_step_seconds",
    "ttg_redis_request_seconds",
)


def inside_the_gateway(m: dict[str, float]) -> dict[str, float | None]:
    def mean(name: str, label: str = "") -> float | None:
        label = "{" + label + "}" if label else ""
        n = m.get(f"{name}_count{label}", 0.0)
        return round(1000 * m[f"{name}_sum{label}"] / n, 1) if n else None

    return {
        # from the push of the media block holding the last speech sample to the final, in the engine
        "speech_end_to_final": mean("ttg_time_to_final_seconds"),
        # from the push that completed the chunk (for a VAD final: the flush) to the final event
        "chunk_to_final": mean("ttg_transcript_latency_seconds", "final"),
        "chunk_to_partial": mean("ttg_transcript_latency_seconds", "partial"),
        "queue_wait": mean("ttg_asr_queue_wait_seconds"),
        "encoder_step": mean("ttg_encoder_step_seconds"),
        "decoder_step": mean("ttg_decoder_step_seconds"),
        "redis_request": mean("ttg_redis_request_seconds"),
    }


def _once(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[demo.Proc] = []
    with tempfile.TemporaryDirectory(prefix="ttg-bench-ttf-") as tmp:
        work = Path(tmp)
        try:
            return run(args, work, procs)
        finally:
            for proc in reversed(procs):
                proc.stop(10)
            if args.keep is not None:
                subprocess.run(["cp", "-r", str(work), str(args.keep)], check=False)


def _line(result: dict[str, Any]) -> str:
    t, f = result["ttf_ms"], result["ttfp_ms"]
    return (
        f"{result['completed']}/{result['total']} calls, {result['utterances']} utterances "
        f"({result['without_final']} without a final, {result['finals']} finals, "
        f"{result['finals_outside']} outside every utterance); TTF p50 {t['p50']} ms, "
        f"p95 {t['p95']} ms, max {t['max']} ms; first partial p50 {f['p50']} ms, p95 {f['p95']} ms; "
        f"WER {result['wer']}; replay CPU {result['harness_cpu_percent']} %"
        "\n  inside the gateway (means, ms): " + ", ".join(f"{k} {v}" for k, v in result["inside_ms"].items())
    )


def main(args: argparse.Namespace) -> int:
    result = _once(args)
    print(_line(result))
    if args.vad_ab:
        args.gateway_env = [*args.gateway_env, "TTG_ASR__VAD=off"]
        args.keep = None
        off = _once(args)
        print(f"VAD off: {_line(off)}")
        if result["wer"] is not None and off["wer"] is not None:
            result["wer_vad_off"] = off["wer"]
            result["wer_change_from_finalization"] = round(result["wer"] - off["wer"], 5)
            change = 100 * result["wer_change_from_finalization"]
            print(f"WER change caused by early finalization: {change:+.2f} points")
        result["vad_off"] = off
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
