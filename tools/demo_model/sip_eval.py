"""WER of the held-out set through real SIP calls: redis-server + `ttg serve` + `ttg replay` with loss.

    python -m tools.demo_model.sip_eval --model asr_core/demo_model --set var/demo/test --loss 0.02

Each held-out clip of `--condition` becomes one call (round robin over a per-language folder with the
reference next to each clip): `ttg replay` places the calls over loopback, sends 8 kHz G.711 RTP at
real-time pace with random packet loss, and reads the finals back from Redis. The hypotheses are scored
with the same normalization and scorer as `ttg eval` (`tools.eval.score`), so the two WERs compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools import demo
from tools.eval import load_manifest, score
from tools.ports import free_port


def prepare_audio(test_set: Path, condition: str, folder: Path, limit: int | None) -> dict[str, int]:
    """`folder/<lang>/<name>.wav` + `.txt` for each clip of the condition; returns clips per language."""
    counts: dict[str, int] = {}
    for entry in load_manifest(test_set / "manifest.jsonl"):
        if entry.extra.get("condition") != condition or entry.lang is None:
            continue
        if limit is not None and counts.get(entry.lang, 0) >= limit:
            continue
        out = folder / entry.lang
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry.audio, out / entry.audio.name)
        (out / entry.audio.with_suffix(".txt").name).write_text(entry.text + "\n", encoding="utf-8")
        counts[entry.lang] = counts.get(entry.lang, 0) + 1
    return counts


def run(args: argparse.Namespace, tmp: Path, procs: list[demo.Proc]) -> dict[str, Any]:
    env = demo.project_env()
    counts = prepare_audio(args.set, args.condition, tmp / "audio", args.limit)
    deadline = demo.Deadline(args.timeout)
    redis_url = f"redis://127.0.0.1:{demo.start_redis(tmp, procs, deadline)}/0"
    sip_port = free_port()
    rtp_min = 30000 + 2 * (os.getpid() % 2000)
    gateway = demo.start_gateway(
        tmp, procs, deadline, sip_port=sip_port, http_port=free_port(), redis_url=redis_url,
        rtp_ports=f"{rtp_min}-{rtp_min + 399}", max_calls=100, model=args.model,
    )  # fmt: skip

    refs: dict[str, list[str]] = {}
    hyps: dict[str, list[str]] = {}
    reports: dict[str, Any] = {}
    for lang, n in sorted(counts.items()):
        out = tmp / f"replay-{lang}"
        t0 = time.monotonic()
        subprocess.run([
            sys.executable, "-m", "gateway", "replay", "--target", f"127.0.0.1:{sip_port}",
            "--audio", str(tmp / "audio"), "--lang", lang, "--calls", str(args.calls), "--total", str(n),
            "--loss", str(args.loss), "--seed", str(args.seed), "--codec", args.codec,
            "--redis-url", redis_url, "--no-metrics", "--no-progress", "--out", str(out),
        ], cwd=tmp, env=env, check=True, timeout=deadline.left(f"replaying {lang}"))  # fmt: skip
        report = json.loads((out / "report.json").read_text(encoding="utf-8"))
        calls = report["calls"]
        refs[lang] = [c["reference"] or "" for c in calls]
        hyps[lang] = [c["hypothesis"] for c in calls]
        summary = report["summary"]
        reports[lang] = {
            "calls": summary["calls"],
            "completed": summary["completed"],
            "rtp_sent": summary["rtp_sent"],
            "rtp_lost_impairment": sum(c["rtp_lost_impairment"] for c in calls),
            "gateway_rtp_lost": sum(c["gateway_rtp_lost"] or 0 for c in calls),
            "seconds": round(time.monotonic() - t0, 1),
            **score(refs[lang], hyps[lang]),
        }
    code = gateway.stop(30)
    if code != 0:
        raise demo.DemoError(f"ttg serve exited with {code}:\n{gateway.tail()}")
    every = [r for lang in sorted(refs) for r in refs[lang]], [h for lang in sorted(hyps) for h in hyps[lang]]
    return {
        "model": str(args.model),
        "condition": args.condition,
        "loss": args.loss,
        "codec": args.codec,
        "all": score(*every),
        "by_lang": reports,
        "examples": [{"ref": r, "hyp": h} for r, h in zip(*every, strict=True)][:6],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("asr_core/demo_model"))
    p.add_argument("--set", type=Path, default=Path("var/demo/test"), help="held-out set (manifest.jsonl)")
    p.add_argument("--condition", default="test")
    p.add_argument("--limit", type=int, default=None, help="at most N clips per language")
    p.add_argument("--loss", type=float, default=0.02, help="RTP packet loss probability")
    p.add_argument("--codec", choices=("pcmu", "pcma"), default="pcmu")
    p.add_argument("--calls", type=int, default=16, help="concurrent calls")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    procs: list[demo.Proc] = []
    with tempfile.TemporaryDirectory(prefix="ttg-sip-eval-") as tmp:
        try:
            result = run(args, Path(tmp), procs)
        finally:
            for proc in reversed(procs):
                proc.stop(10)
    for name, r in [("all", result["all"]), *result["by_lang"].items()]:
        print(
            f"SIP {name:6s} WER {r['wer']:.2%}  CER {r['cer']:.2%}  ({r['utterances']} calls, "
            f"{r['words']} words)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
