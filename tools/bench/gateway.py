"""Whole-gateway load run: redis-server + `ttg serve` + `ttg replay` on one machine, levels of calls.

    ttg bench gateway --levels 250,500,1000,2000 --call-seconds 30 --audio .kit/audio \\
        --env TTG_MODEL__DIR=/tmp/full --env TTG_DECODER__MODE=device --out $OUT/run
    ttg bench gateway --find-capacity --max-calls 256 --generate 10 --out var/bench/capacity

What it does, in order: starts a private redis-server (`--redis-server`, else the one on PATH) and
`python -m gateway serve` from `--repo` (default: this checkout; another checkout measures another
version with the same command), configured through TTG_* variables (`--env` adds or overrides
them; the adaptive call limit is off unless set); waits for /readyz; then per level runs `ttg replay`
(one process per `--calls-per-replay` calls, disjoint RTP ports, all started together) with N
concurrent calls and N calls in all, while
a sampler records every second the CPU time of each process (the daemon and its children by
command line, the replays, redis-server) and, where `nvidia-smi` exists, the GPU's utilisation.
Between levels the gateway keeps running. At the end SIGTERM, and the daemon's exit status and
whether its log shows an abort ("terminate called", "Aborted", "core dumped").

`--find-capacity` instead hands the search to one replay process (`ttg replay --find-capacity`).

Per level (summary.md / summary.json in `--out`, each replay's own report in `level_<N>/`):
calls offered, completed, rejected; TTF p50/p95 and first-partial p50 over every utterance of every
replay process (an utterance without a final counts as infinitely late in the p95, as in replay's
capacity rule). Of the utterances without a final, those without a partial either are counted, and
the p95 is given once more without them: a bundle that emits no token for an utterance publishes
nothing for it, which loses no final (the random benchmark bundle does so for a few sentences; a
partial without a final, or dropped chunks, would be a loss). RTP packets the gateway counted
over those sent; encoder batch size, step time and steps per second, decoder step time and dropped
chunks from /metrics deltas; mean CPU of each
process (% of one core) and the GPU's mean/peak utilisation over the level. The daemon's /metrics is
also read every second for admission (`ADMISSION_SERIES`: calls up, the adaptive call limit, the
engine's load and lag, INVITEs answered 503): each level's timeline goes into summary.json
(`admission_timeline`), its extremes into summary.md — how a burst met the call limit, second by second.
Each engine's own lag, load, busy share and the lag's first parts are read too (`ENGINE_SERIES`; the
one-process gateway's engine is engine 0): `engines` in summary.json, one line in summary.md — which engine
fell behind, when, at what load, whether its MLX thread had any time left then, and how much of the lag was
on the way to its queue (and of that, until its process read the chunk) and in it. Each media worker's
event-loop lag and the longest wait of its chunks to be published to the engine (`MEDIA_SERIES`) too:
`media_workers` in summary.json (their maxima), and at each engine's lag peak the workers' largest then —
how much of the way to the queue was the media workers' own.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The checkout this module was imported from, links not followed: a kit that links its tools into
# another checkout (tools/device/ab.sh's .before/) runs that checkout's gateway and replay.
REPO = Path(os.path.abspath(__file__)).parents[2]
ABORT_MARKS = ("terminate called", "Aborted", "core dumped", "Segmentation fault", "Fatal Python error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--levels", default="1,250,500,1000,2000", help="concurrent calls per level")
    parser.add_argument("--find-capacity", action="store_true", help="ttg replay --find-capacity instead")
    parser.add_argument("--max-calls", type=int, default=256, help="highest level --find-capacity tries")
    parser.add_argument("--call-seconds", type=float, default=30.0, help="speech per call (30)")
    parser.add_argument("--cps", type=float, default=50.0, help="new calls per second per replay process")
    parser.add_argument("--calls-per-replay", type=int, default=700, help="calls one replay process drives")
    parser.add_argument(
        "--replay-nice",
        type=int,
        default=0,
        help="niceness of the replay processes: >0 lets the gateway's processes run first when they share "
        "the machine's cores with the load (a PBX is another machine); 0 (default): equal priority",
    )
    parser.add_argument("--audio", type=Path, help="folder of speech files for the calls")
    parser.add_argument("--generate", type=int, default=10, help="else: espeak-ng files to generate (10)")
    parser.add_argument("--env", action="append", default=[], metavar="TTG_X=V", help="daemon setting")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose gateway and replay run")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the daemon and replay")
    parser.add_argument("--redis-server", default="", help="redis-server binary (default: on PATH)")
    parser.add_argument("--host", default="127.0.0.1")
    # Fixed ports below the kernel's ephemeral range (32768+ on Linux), where no outgoing connection
    # takes one between two levels, and below the band the tests draw theirs from (tools/ports.py).
    parser.add_argument("--sip-port", type=int, default=15060)
    parser.add_argument("--http-port", type=int, default=15090)
    parser.add_argument("--redis-port", type=int, default=15079)
    # One even port a call on each side (RFC 3550 §11): 2 000 calls, the default levels' largest, each.
    parser.add_argument("--rtp-ports", default="11000-14999", help="the gateway's RTP range")
    parser.add_argument("--replay-rtp-ports", default="15200-19999", help="split among replay processes")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /readyz")
    parser.add_argument("--drain", type=float, default=20.0, help="replay's wait for call_end events")
    parser.add_argument("--out", type=Path, default=Path("var/bench/gateway"))


# --- processes ---------------------------------------------------------------------------------------


def _port_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi)


def _replay_shares(args: argparse.Namespace, n: int) -> list[tuple[int, tuple[int, int]]]:
    """How a level of `n` calls is driven: each replay process's calls and its slice of the replay range."""
    procs = 1 if args.find_capacity else max(1, math.ceil(n / args.calls_per_replay))
    lo, hi = _port_range(args.replay_rtp_ports)
    width = (hi - lo + 1) // procs
    return [(calls, (lo + i * width, lo + (i + 1) * width - 1)) for i, calls in enumerate(_split(n, procs))]


def port_range_problem(args: argparse.Namespace, levels: list[int]) -> str | None:
    """Why the RTP ranges cannot carry the largest level, or None: the gateway needs an RTP/RTCP pair a
    call (the daemon's own count), a replay process an even port a call (its `RtpPortPool`). Checked
    before anything starts, so that a run does not end minutes in on a daemon that refuses its range
    or a replay that runs out of ports."""
    from gateway.daemon import rtp_port_pairs
    from tools.replay.net import even_ports

    n = max(levels)
    if (have := rtp_port_pairs(*_port_range(args.rtp_ports))) < n:
        return f"--rtp-ports {args.rtp_ports} holds {have} calls (an RTP/RTCP pair each), the level has {n}"
    shares = _replay_shares(args, n)
    for i, (calls, (lo, hi)) in enumerate(shares):
        if (have := len(even_ports(lo, hi))) < calls:
            return (
                f"--replay-rtp-ports {args.replay_rtp_ports} split among {len(shares)} replay processes "
                f"leaves process {i} {have} even ports for its {calls} calls"
            )
    return None


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _cpu_ticks(pid: int) -> float | None:
    """utime + stime of a process in seconds (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine() -> tuple[int, int, int, int] | None:
    """The whole machine (Linux /proc/stat): busy and total jiffies of all CPUs, the tasks runnable
    now (running or waiting for a core), and the jiffies the hypervisor gave the vCPUs to others
    (steal; within busy): with the load generator on the same machine, whether the cores ran short is
    a property of the machine, not of any one process, and on a shared host of its neighbours too."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    jiffies = [int(x) for x in lines[0].split()[1:]]
    idle = jiffies[3] + (jiffies[4] if len(jiffies) > 4 else 0)  # idle + iowait
    runnable = next((int(line.split()[1]) for line in lines if line.startswith("procs_running ")), 0)
    steal = jiffies[7] if len(jiffies) > 7 else 0
    return sum(jiffies[:8]) - idle, sum(jiffies[:8]), runnable, steal


def machine_window(samples: list[dict[str, Any]], ncpu: int) -> dict[str, Any]:
    """Busy cores of the whole machine (mean over the samples' span, and the busiest one-sample step),
    of them stolen by the hypervisor (mean), and the runnable tasks (mean, max); {} without two samples
    that have /proc/stat."""
    have = [s["machine"] for s in samples if s.get("machine")]
    if len(have) < 2:
        return {}
    steps = [ncpu * (b[0] - a[0]) / (b[1] - a[1]) for a, b in itertools.pairwise(have) if b[1] > a[1]]
    (busy0, total0, _, steal0), (busy1, total1, _, steal1) = have[0], have[-1]
    runnable = [m[2] for m in have]
    return {
        "machine_cores": ncpu,
        "machine_busy_cores_mean": round(ncpu * (busy1 - busy0) / max(1, total1 - total0), 2),
        "machine_busy_cores_max": round(max(steps), 2) if steps else None,
        "machine_steal_cores_mean": round(ncpu * (steal1 - steal0) / max(1, total1 - total0), 2),
        "runnable_mean": round(float(np.mean(runnable)), 1),
        "runnable_max": max(runnable),
    }


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
    return out


def _role(pid: int, root: int, root_name: str) -> str:
    """A short name of a process of the run, from its command line."""
    if pid == root:
        return root_name
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid{pid}"
    words = [a.decode(errors="replace") for a in argv if a]
    for flag in ("--role", "--name"):
        if flag in words and words.index(flag) + 1 < len(words):
            return words[words.index(flag) + 1]
    return os.path.basename(words[0]) if words else f"pid{pid}"


@dataclass
class Sampler:
    """Every second: CPU seconds of the daemon's process tree and of named others; GPU utilisation."""

    daemon: int
    others: dict[str, int] = field(default_factory=dict)
    root_name: str = "gateway"
    metrics_url: str | None = None  # the daemon's /metrics: its admission series each second too
    period: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        from tools.replay.scrape import parse_metrics

        smi = shutil.which("nvidia-smi")
        while not self._stop.is_set():
            t = time.monotonic()
            cpu: dict[str, float] = {}
            tree = [self.daemon]
            i = 0
            while i < len(tree):  # the daemon's descendants
                tree += _children(tree[i])
                i += 1
            for pid in tree:
                ticks = _cpu_ticks(pid)
                if ticks is not None:
                    name = _role(pid, self.daemon, self.root_name)
                    cpu[name] = cpu.get(name, 0.0) + ticks
            for name, pid in list(self.others.items()):
                ticks = _cpu_ticks(pid)
                if ticks is not None:
                    cpu[name] = ticks
            sample: dict[str, Any] = {"t": t, "cpu": cpu, "machine": _machine()}
            if self.metrics_url:
                with contextlib.suppress(OSError, ValueError):
                    text = _get(self.metrics_url, 2.0)
                    sample["series"] = parse_metrics(text, ADMISSION_SERIES + ENGINE_SERIES + MEDIA_SERIES)
            if smi:
                with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                    out = subprocess.run(
                        [smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                        capture_output=True,
                        text=True,
                        timeout=5,
                    ).stdout.split("\n")[0]
                    util, mem = (float(x) for x in out.split(","))
                    sample["gpu_util"], sample["gpu_mem_mib"] = util, mem
            self.samples.append(sample)
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t)))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Mean CPU % of one core per process, and GPU mean/max %, between two monotonic times."""
        inside = [s for s in self.samples if t0 <= s["t"] <= t1]
        out: dict[str, Any] = {"cpu_percent": {}}
        if len(inside) >= 2:
            a, b = inside[0], inside[-1]
            dt = b["t"] - a["t"]
            for name, v in b["cpu"].items():
                if name in a["cpu"] and dt > 0:
                    out["cpu_percent"][name] = round(100 * (v - a["cpu"][name]) / dt, 1)
        out.update(machine_window(inside, os.cpu_count() or 1))
        out.update(admission_window(inside))
        engines = engine_extremes(inside)
        if engines:
            out["engines"] = engines
        media = media_extremes(inside)
        if media:
            out["media_workers"] = media
        gpu = [s["gpu_util"] for s in inside if "gpu_util" in s]
        if gpu:
            out["gpu_util_mean"] = round(float(np.mean(gpu)), 1)
            out["gpu_util_max"] = float(max(gpu))
            out["gpu_mem_mib_max"] = float(max(s["gpu_mem_mib"] for s in inside if "gpu_mem_mib" in s))
        return out


# --- metrics -----------------------------------------------------------------------------------------


ENGINE_METRICS = (
    "ttg_encoder_batch_size",
    "ttg_encoder_step_seconds",
    "ttg_decoder_step_seconds",
    "ttg_asr_queue_wait_seconds",
    "ttg_transcript_latency_seconds",
    "ttg_asr_chunks_dropped",
    "ttg_calls",
    "ttg_rtp_packets_received",
    "ttg_rtcp_reports_sent",
)


# Histograms whose buckets are kept too, for a level's p95 (`bucket_quantile`): where the chunks' delay
# sat — waiting for their step, against the whole way from their audio to their transcript.
QUANTILE_HISTOGRAMS = ("ttg_asr_queue_wait_seconds", "ttg_transcript_latency_seconds")


def scrape(url: str, wanted: tuple[str, ...] = ENGINE_METRICS) -> dict[str, float]:
    """`scrape_text` of the daemon's /metrics now; empty when it does not answer."""
    try:
        return scrape_text(_get(url), wanted)
    except OSError:
        return {}


def scrape_text(text: str, wanted: tuple[str, ...] = ENGINE_METRICS) -> dict[str, float]:
    """Sums of counters and histograms (name -> value) of the families named by a prefix in `wanted`;
    a `result` or `type` label goes into the key: `ttg_calls_total{completed}`. The buckets of
    `QUANTILE_HISTOGRAMS`, summed over their other labels, are keyed by their bound:
    `ttg_asr_queue_wait_seconds_bucket{0.256}`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(wanted):
            continue
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count", "_total")):
                label = s.labels.get("result") or s.labels.get("type")
                key = s.name + ("" if not label else "{" + label + "}")
            elif s.name.endswith("_bucket") and fam.name in QUANTILE_HISTOGRAMS:
                key = f"{s.name}{{{s.labels['le']}}}"
            else:
                continue
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def bucket_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The upper bound of the bucket that holds the q-quantile of what histogram `name` observed
    between two scrapes (inf: past its last bound); None: it observed nothing."""
    prefix = f"{name}_bucket{{"
    counts = sorted(
        (float(k[len(prefix) : -1]), v - before.get(k, 0.0)) for k, v in after.items() if k.startswith(prefix)
    )
    if not counts or counts[-1][1] <= 0:
        return None
    total = counts[-1][1]  # the +Inf bucket counts every observation
    return next(bound for bound, n in counts if n >= q * total)


# What admission did, second by second: the calls up, the adaptive call limit, the engine's load and
# lag it is set from, and the INVITEs answered 503 (cumulative).
ADMISSION_SERIES = (
    "ttg_active_calls",
    "ttg_call_limit",
    "ttg_engine_load",
    "ttg_engine_lag_seconds",
    "ttg_sip_responses_total{503}",
)


# Each engine's own lag, load, busy share and the lag's first two parts (which one fell behind, and why).
MAX_ENGINES = 16


def _engine_series(name: str, k: int) -> str:
    """Engine process k's series `name` (ttg_engine_process_NAME{k}) as the samples key it."""
    return f"ttg_engine_process_{name}{{{k}}}"


ENGINE_SERIES = tuple(
    _engine_series(name, k)
    for name in (
        "lag_seconds",
        "load",
        "busy",
        "receive_lag_seconds",
        "arrival_lag_seconds",
        "queue_wait_seconds",
    )
    for k in range(MAX_ENGINES)
)


# Each media worker's event-loop lag and the wait of its chunks to be published (the media worker's part of
# an engine's receive lag): each a maximum over the worker's last report period.
MAX_MEDIA_WORKERS = 64


def _media_series(name: str, k: int) -> str:
    """Media worker k's series `name` (ttg_media_worker_NAME{k}) as the samples key it."""
    return f"ttg_media_worker_{name}{{{k}}}"


MEDIA_SERIES = tuple(
    _media_series(name, k)
    for name in ("loop_lag_seconds", "flush_delay_seconds")
    for k in range(MAX_MEDIA_WORKERS)
)


def _media_max(series: dict[str, float], name: str) -> float:
    """The largest of the media workers' series `name` in one sample."""
    return max(series.get(_media_series(name, k), 0.0) for k in range(MAX_MEDIA_WORKERS))


def media_extremes(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The media workers' largest event-loop lag and flush delay over the samples, each with the worker it
    came from; {} where no media worker reported (the one-process gateway)."""
    have = [s for s in samples if s.get("series")]
    out: dict[str, float] = {}
    for name, key in (("loop_lag_seconds", "loop_lag"), ("flush_delay_seconds", "flush_delay")):
        seen = [
            (s["series"][series], k)
            for s in have
            for k in range(MAX_MEDIA_WORKERS)
            if (series := _media_series(name, k)) in s["series"]
        ]
        if seen:
            value, worker = max(seen)
            out[f"{key}_max_s"], out[f"{key}_max_worker"] = round(value, 3), worker
    return out


def engine_extremes(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per engine process seen in the samples' series: its largest lag, when (seconds from the first
    sample with series), its load, busy share and the lag's first parts then (to the queue, of that until
    its process read the chunk, in the queue), and its largest load and busy share; where media workers
    report, their largest event-loop lag and flush delay in that sample (what of the way to the queue was
    the media workers')."""
    have = [s for s in samples if s.get("series")]
    out: dict[str, dict[str, float]] = {}
    for k in range(MAX_ENGINES):
        lag_key, load_key, busy_key = (_engine_series(name, k) for name in ("lag_seconds", "load", "busy"))
        parts = tuple(
            _engine_series(name, k)
            for name in ("receive_lag_seconds", "arrival_lag_seconds", "queue_wait_seconds")
        )
        rows = [
            (
                s["t"],
                s["series"][lag_key],
                *(s["series"].get(key, 0.0) for key in (load_key, busy_key, *parts)),
                s["series"],
            )
            for s in have
            if lag_key in s["series"]
        ]
        if not rows:
            continue
        t, lag, load, busy, receive, arrival, queue, series = max(rows, key=lambda r: r[1])
        out[str(k)] = {
            "lag_max_s": round(lag, 3),
            "lag_max_at_s": round(t - have[0]["t"], 1),
            "load_at_lag_max": round(load, 3),
            "load_max": round(max(r[2] for r in rows), 3),
            "busy_at_lag_max": round(busy, 3),
            "busy_max": round(max(r[3] for r in rows), 3),
            "receive_lag_at_lag_max_s": round(receive, 3),
            "arrival_lag_at_lag_max_s": round(arrival, 3),
            "queue_wait_at_lag_max_s": round(queue, 3),
        }
        if any(name.startswith("ttg_media_worker_") for name in series):
            peak = out[str(k)]
            peak["media_loop_lag_at_lag_max_s"] = round(_media_max(series, "loop_lag_seconds"), 3)
            peak["media_flush_delay_at_lag_max_s"] = round(_media_max(series, "flush_delay_seconds"), 3)
    return out


def admission_window(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The admission series over a level: a timeline (seconds from the first sample, then the series in
    ADMISSION_SERIES' order, 503s counted from the level's start) and its extremes; {} where the
    daemon's /metrics was not read."""
    have = [s for s in samples if s.get("series")]
    if not have:
        return {}
    t0 = have[0]["t"]
    refused0 = have[0]["series"].get("ttg_sip_responses_total{503}", 0.0)
    timeline = []
    for s in have:
        values = [s["series"].get(name) for name in ADMISSION_SERIES]
        if values[-1] is not None:
            values[-1] -= refused0
        timeline.append([round(s["t"] - t0, 1), *(None if v is None else round(v, 3) for v in values)])

    def column(i: int) -> list[float]:
        return [row[i + 1] for row in timeline if row[i + 1] is not None]

    active, limit, load, lag, refused = (column(i) for i in range(len(ADMISSION_SERIES)))
    return {
        "admission": {
            "active_calls_max": int(max(active)) if active else None,
            "call_limit_first": int(limit[0]) if limit else None,
            "call_limit_max": int(max(limit)) if limit else None,
            "call_limit_last": int(limit[-1]) if limit else None,
            "engine_load_max": max(load, default=None),
            "engine_lag_max_s": max(lag, default=None),
            "refused_503": int(refused[-1]) if refused else None,
        },
        "admission_timeline": timeline,
    }


def _engine_numbers(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = d("ttg_encoder_step_seconds_count")
    dec = d("ttg_decoder_step_seconds_count")
    waits = d("ttg_asr_queue_wait_seconds_count")
    return {
        "encoder_steps": int(steps),
        "steps_per_s": round(steps / seconds, 2) if seconds > 0 else None,
        "mean_batch": round(d("ttg_encoder_batch_size_sum") / steps, 1) if steps else None,
        "mean_step_ms": round(1000 * d("ttg_encoder_step_seconds_sum") / steps, 2) if steps else None,
        "mean_decoder_step_ms": round(1000 * d("ttg_decoder_step_seconds_sum") / dec, 2) if dec else None,
        "mean_queue_wait_ms": round(1000 * d("ttg_asr_queue_wait_seconds_sum") / waits, 1) if waits else None,
        "queue_wait_p95_s_at_most": _bound(
            bucket_quantile(before, after, "ttg_asr_queue_wait_seconds", 0.95)
        ),
        "transcript_latency_p95_s_at_most": _bound(
            bucket_quantile(before, after, "ttg_transcript_latency_seconds", 0.95)
        ),
        "dropped_chunks": int(d("ttg_asr_chunks_dropped_total")),
        "rtcp_reports": int(d("ttg_rtcp_reports_sent_total")),
    }


# --- one level ---------------------------------------------------------------------------------------


def _bound(value: float | None) -> float | str | None:
    """A time for summary.json: "inf" where it is infinite (JSON has no infinity)."""
    return value if value is None or math.isfinite(value) else "inf"


def _p95(values: list[float]) -> float | str | None:
    """The capacity rule's p95 (`p95_nearest_rank`), rounded; "inf" when it falls on a missing final."""
    from tools.replay.analysis import p95_nearest_rank

    value = p95_nearest_rank(values)
    return None if value is None else _bound(round(value, 3))


def _merge_reports(folders: list[Path]) -> dict[str, Any]:
    calls = completed = rejected = 0
    sent = counted = rtcp = 0
    ttf: list[float] = []
    ttfp: list[float] = []
    published: list[float] = []  # TTF to the final's XADD, where the report has it
    missing = 0
    silent: Counter[str] = Counter()  # of `missing`: no partial either, by sentence ("clip#k")
    said: Counter[str] = Counter()  # every utterance, by sentence
    uncovered: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (call, utterance) of `silent`
    harness_cpu: list[float] = []
    lateness_p99: list[float] = []
    outside: int | None = 0  # finals covering no utterance (None where a report predates the count)
    for folder in folders:
        path = folder / "report.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        s = r["summary"]
        outside = None if outside is None or "finals_outside" not in s else outside + s["finals_outside"]
        calls += s["calls"]
        completed += s["completed"]
        rejected += s["rejected"]
        sent += s.get("rtp_sent_to_reporting_calls") or 0
        counted += s.get("gateway_rtp_packets") or 0
        rtcp += s.get("rtcp_received") or 0
        harness_cpu.append(r["harness"]["cpu_percent"])
        lateness_p99.append(r["harness"]["send_lateness_ms"]["p99"] or 0.0)
        for c in r["calls"]:
            for u in c.get("utterances") or []:
                said[u.get("sentence") or "?"] += 1
                if u.get("ttf_s") is None:
                    missing += 1
                    if u.get("ttfp_s") is None:
                        silent[u.get("sentence") or "?"] += 1
                        uncovered.append((c, u))
                else:
                    ttf.append(u["ttf_s"])
                    if u.get("ttf_published_s") is not None:
                        published.append(u["ttf_published_s"])
                if u.get("ttfp_s") is not None:
                    ttfp.append(u["ttfp_s"])
    everything = ttf + [math.inf] * missing
    spoken = ttf + [math.inf] * (missing - silent.total())  # utterances with any transcript
    return {
        "calls": calls,
        "completed": completed,
        "rejected": rejected,
        "utterances": len(everything),
        "without_final": missing,
        "without_any_transcript": silent.total(),
        "without_any_transcript_by_sentence": dict(sorted(silent.items())),
        "without_any_transcript_examples": _uncovered_examples(uncovered, silent, said),
        "ttf_p50_s": round(float(np.percentile(ttf, 50)), 3) if ttf else None,
        "ttf_p95_s": _p95(everything),
        "ttf_p95_spoken_s": _p95(spoken),
        # The same rule with each final's XADD time: what the gateway took, without the load
        # generator's lag in reading (None where the reports predate it).
        "ttf_p95_published_s": _p95(published + [math.inf] * missing) if len(published) == len(ttf) else None,
        "ttfp_p50_s": round(float(np.percentile(ttfp, 50)), 3) if ttfp else None,
        "finals_outside": outside,
        "rtp_received_percent": round(100 * counted / sent, 1) if sent else None,
        "rtcp_received": rtcp,  # the gateway's reports that reached the replay (rtcp_reports: it sent)
        "replay_cpu_percent": [round(x, 1) for x in harness_cpu],
        "replay_lateness_p99_ms": [round(x, 1) for x in lateness_p99],
    }


def _uncovered_examples(
    uncovered: list[tuple[dict[str, Any], dict[str, Any]]],
    silent: Counter[str],
    said: Counter[str],
    n: int = 6,
) -> list[dict[str, Any]]:
    """A few utterances with no partial and no final whose sentence most calls did get a transcript for
    (not a sentence the model says nothing for), one per call, with what that call got: the leads to
    follow in the gateway's log (its Call-ID)."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for call, u in uncovered:
        sentence = u.get("sentence") or "?"
        call_id = str(call.get("sip_call_id", "?"))
        if 2 * silent[sentence] >= said[sentence] or call_id in seen:
            continue
        seen.add(call_id)
        out.append(
            {
                "sip_call_id": call_id,
                "sentence": sentence,
                "span_ms": [u.get("start_ms"), u.get("end_ms")],
                "outcome": call.get("outcome"),
                "partials": call.get("partials"),
                "finals": call.get("finals"),
                "call_end": call.get("call_end", {}).get("reason"),
                "gateway_rtp_lost": call.get("gateway_rtp_lost"),
                "hypothesis": str(call.get("hypothesis", ""))[:160],
            }
        )
        if len(out) == n:
            break
    return out


def _replay_cmd(
    args: argparse.Namespace, audio: Path, out: Path, ports: tuple[int, int], n: int
) -> list[str]:
    cmd = [
        args.python, "-m", "gateway.cli", "replay",
        "--target", f"{args.host}:{args.sip_port}", "--local-ip", args.host,
        "--rtp-ports", f"{ports[0]}-{ports[1]}", "--audio", str(audio),
        "--call-seconds", str(args.call_seconds), "--cps", str(args.cps),
        "--redis-url", f"redis://{args.host}:{args.redis_port}/0",
        "--metrics-url", f"http://{args.host}:{args.http_port}/metrics",
        "--drain", str(args.drain), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    if args.find_capacity:
        cmd += ["--find-capacity", "--max-calls", str(n)]
    else:
        cmd += ["--calls", str(n), "--total", str(n)]
    return ["nice", "-n", str(args.replay_nice), *cmd] if args.replay_nice else cmd


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_level(
    args: argparse.Namespace, n: int, audio: Path, sampler: Sampler, env: dict[str, str]
) -> dict[str, Any]:
    shares = _replay_shares(args, n)
    folders, running = [], []
    metrics_url = f"http://{args.host}:{args.http_port}/metrics"
    before = scrape(metrics_url)
    t0 = time.monotonic()
    for i, (calls, ports) in enumerate(shares):
        folder = args.out / f"level_{n}" / f"replay_{i}"
        folder.mkdir(parents=True, exist_ok=True)
        log = (folder / "replay.log").open("w")
        p = subprocess.Popen(
            _replay_cmd(args, audio, folder, ports, calls),
            cwd=args.repo, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        sampler.others[f"replay_{i}"] = p.pid
        folders.append(folder)
        running.append((p, log))
    codes = []
    try:
        for p, log in running:
            codes.append(p.wait())
            log.close()
    finally:
        for p, _ in running:
            if p.poll() is None:  # the run is being stopped (SIGTERM, ^C): stop its replays too
                p.terminate()
                p.wait(30)
    t1 = time.monotonic()
    for i in range(len(shares)):
        sampler.others.pop(f"replay_{i}", None)
    after = scrape(metrics_url)
    out: dict[str, Any] = {
        "level": n,
        "replay_processes": len(shares),
        "replay_exit": codes,
        "seconds": round(t1 - t0, 1),
    }
    if args.find_capacity:
        cap = folders[0] / "capacity.json"
        out["capacity"] = json.loads(cap.read_text()) if cap.exists() else None
        out["capacity_report"] = str(folders[0] / "capacity.md")
    else:
        out.update(_merge_reports(folders))
    out.update(_engine_numbers(before, after, t1 - t0))
    out.update(sampler.window(t0, t1))
    return out


# --- the run -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
        try:
            yield p
        finally:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _daemon_env(args: argparse.Namespace, max_calls: int) -> dict[str, str]:
    env = dict(os.environ)
    lo, hi = _port_range(args.rtp_ports)
    env.update(
        {
            "PYTHONPATH": str(args.repo) + os.pathsep + env.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            "TTG_SIP__HOST": args.host,
            "TTG_SIP__PORT": str(args.sip_port),
            "TTG_RTP__HOST": args.host,
            "TTG_RTP__PORT_MIN": str(lo),
            "TTG_RTP__PORT_MAX": str(hi),
            "TTG_HTTP__HOST": args.host,
            "TTG_HTTP__PORT": str(args.http_port),
            "TTG_REDIS__URL": f"redis://{args.host}:{args.redis_port}/0",
            "TTG_SINK__SPOOL_DIR": str(args.out / "spool"),
            "TTG_SIP__MAX_CALLS": str(max_calls),
            # A level measures what the engine does with N calls: the adaptive call limit, which
            # admits a ramp at the pace the engine absorbs it, would answer part of it 503. Off unless
            # --env sets it (to measure the limit itself).
            "TTG_SIP__CALL_LIMIT_LAG_MS": "0",
        }
    )
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--env {item!r}: expected NAME=VALUE")
        env[key] = value
    return env


def _audio(args: argparse.Namespace) -> Path:
    if args.audio:
        return Path(args.audio).resolve()
    from tools.replay.audio import generate_espeak

    return generate_espeak(args.out / "audio", args.generate).resolve()


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| calls | completed | TTF p50 / p95 s | first partial p50 s | RTP received | batch | step ms | "
        "steps/s | decoder ms | dropped | GPU mean / max % | CPU % per process |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        # A capacity search is one row: the whole search's CPU, batches and drops, no level's latencies
        # (those are in its own table, `_capacity_text`).
        label = f"search, 1 … {r['level']}" if "capacity" in r else str(r["level"])
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.get("cpu_percent", {}).items()))
        if "machine_busy_cores_mean" in r:
            cpu += (
                f"; machine {r['machine_busy_cores_mean']} (max {r['machine_busy_cores_max']}) of "
                f"{r['machine_cores']} cores busy (stolen {r.get('machine_steal_cores_mean', '-')}), "
                f"{r['runnable_mean']} (max {r['runnable_max']}) runnable"
            )
        gpu = f"{r['gpu_util_mean']:.0f} / {r['gpu_util_max']:.0f}" if "gpu_util_mean" in r else "-"
        missing = ""
        if r.get("without_final"):
            silent = r.get("without_any_transcript")
            missing = (
                f" ({r['without_final']} without a final, {silent} of them without a partial; "
                f"p95 of the others {r.get('ttf_p95_spoken_s')})"
            )
        if r.get("ttf_p95_published_s") is not None:
            missing += f" [p95 to the finals' XADD {r['ttf_p95_published_s']}]"
        if r.get("finals_outside"):
            missing += f" ({r['finals_outside']} finals outside every utterance: in no TTF)"
        lines.append(
            f"| {label} | {r.get('completed', '-')} | "
            f"{_or_dash(r.get('ttf_p50_s'))} / {_or_dash(r.get('ttf_p95_s'))}{missing} | "
            f"{_or_dash(r.get('ttfp_p50_s'))} | {_or_dash(r.get('rtp_received_percent'))} % | "
            f"{_or_dash(r.get('mean_batch'))} | {_or_dash(r.get('mean_step_ms'))} | "
            f"{_or_dash(r.get('steps_per_s'))} | {_or_dash(r.get('mean_decoder_step_ms'))} | "
            f"{_or_dash(r.get('dropped_chunks'))} | {gpu} | {cpu} |"
        )
    return "\n".join(lines)


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _capacity_text(rows: list[dict[str, Any]]) -> str:
    """A capacity search's result: the load generator's own table of the levels it tried (its
    capacity.md, without the title and plots), or why there is none."""
    parts = []
    for r in rows:
        if "capacity" not in r:
            continue
        report = Path(r.get("capacity_report", ""))
        if r["capacity"] is None or not report.is_file():
            parts.append(f"capacity search up to {r['level']} calls: no result (see the replay's log)")
            continue
        lines = report.read_text(encoding="utf-8").splitlines()
        body = "\n".join(line for line in lines if not line.startswith(("# ", "![")))
        parts.append(re.sub(r"\n{3,}", "\n\n", body).strip())
    return "\n\n".join(parts)


def _admission_lines(rows: list[dict[str, Any]]) -> str:
    """Per level, what admission did (`admission_window`); the timeline itself is in summary.json."""
    lines = []
    for r in rows:
        a = r.get("admission")
        if a:
            lines.append(
                f"- {r['level']} calls: up at most {a['active_calls_max']}; call limit "
                f"{a['call_limit_first']} -> {a['call_limit_last']} (max {a['call_limit_max']}); engine load "
                f"max {a['engine_load_max']}, lag max {a['engine_lag_max_s']} s; INVITEs answered 503: "
                f"{a['refused_503']}"
            )
        engines = r.get("engines")
        if engines:
            lines.append(
                f"- {r['level']} calls, each engine's lag max (then: its load, busy share, the lag's parts "
                "to and in the queue, of the first the part until its process read the chunk; the load's "
                "and busy share's maxima): "
                + ", ".join(
                    f"{k}: {e['lag_max_s']} s at {e['lag_max_at_s']} s "
                    f"({e['load_at_lag_max']}, busy {e['busy_at_lag_max']}, "
                    f"{e.get('receive_lag_at_lag_max_s')} (read after {e.get('arrival_lag_at_lag_max_s')}) + "
                    f"{e.get('queue_wait_at_lag_max_s')} s; "
                    f"{e['load_max']}, busy {e['busy_max']})"
                    for k, e in engines.items()
                )
            )
        media = r.get("media_workers")
        if media:
            at_peaks = [
                f"{k}: {e['media_loop_lag_at_lag_max_s']} / {e['media_flush_delay_at_lag_max_s']} s"
                for k, e in (engines or {}).items()
                if "media_loop_lag_at_lag_max_s" in e
            ]
            at = f"; both, largest of the workers, at each engine's lag max: {', '.join(at_peaks)}"
            loop_lag = f"{media.get('loop_lag_max_s')} s (worker {media.get('loop_lag_max_worker')})"
            flush = f"{media.get('flush_delay_max_s')} s (worker {media.get('flush_delay_max_worker')})"
            lines.append(
                f"- {r['level']} calls, the media workers' event-loop lag max {loop_lag}, a chunk's wait to "
                f"be published to its engine max {flush}" + (at if at_peaks else "")
            )
        if r.get("transcript_latency_p95_s_at_most") is not None:
            lines.append(
                f"- {r['level']} calls, a chunk's delay p95 (at most, by bucket): "
                f"{r['queue_wait_p95_s_at_most']} s waiting for its encoder step of "
                f"{r['transcript_latency_p95_s_at_most']} s from its audio to its transcript"
            )
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    # SIGTERM (a time limit, a supervisor) unwinds like ^C: every `finally` below stops the redis-server,
    # gateway and replay processes this run started instead of leaving them holding its ports.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [args.max_calls] if args.find_capacity else [int(x) for x in args.levels.split(",")]
    problem = port_range_problem(args, levels)
    if problem:
        print(f"ttg bench gateway: {problem}: widen the range", file=sys.stderr)
        return 2
    audio = _audio(args)
    redis_bin = args.redis_server or shutil.which("redis-server")
    if not redis_bin:
        print("ttg bench gateway: no redis-server (give --redis-server)", file=sys.stderr)
        return 2
    env = _daemon_env(args, max(levels))
    summary: dict[str, Any] = {"command": " ".join(sys.argv), "repo": str(args.repo), "env": args.env}
    summary["load_before"] = os.getloadavg()
    redis_cmd = [
        redis_bin,
        "--port",
        str(args.redis_port),
        "--bind",
        args.host,
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    with _process(redis_cmd, args.out / "redis.log") as redis:
        serve_log = args.out / "serve.log"
        serve = subprocess.Popen(
            [args.python, "-m", "gateway.cli", "serve"],
            cwd=args.repo, env=env, stdout=serve_log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        sampler = Sampler(
            serve.pid, {"redis-server": redis.pid}, metrics_url=f"http://{args.host}:{args.http_port}/metrics"
        )
        sampler.start()
        rows: list[dict[str, Any]] = []
        try:
            t0 = time.monotonic()
            ready_url = f"http://{args.host}:{args.http_port}/readyz"
            while not _http_ok(ready_url):
                if serve.poll() is not None or time.monotonic() - t0 > args.ready_timeout:
                    print(
                        f"ttg bench gateway: the daemon did not get ready (see {serve_log})", file=sys.stderr
                    )
                    return 1
                time.sleep(0.5)
            summary["ready_after_s"] = round(time.monotonic() - t0, 1)
            print(f"gateway ready after {summary['ready_after_s']} s", flush=True)
            for n in levels:
                row = run_level(args, n, audio, sampler, env)
                rows.append(row)
                print(json.dumps(row), flush=True)
                (args.out / "summary.json").write_text(json.dumps({**summary, "levels": rows}, indent=2))
        finally:
            t_stop = time.monotonic()
            if serve.poll() is None:
                serve.send_signal(signal.SIGTERM)
            try:
                code = serve.wait(120)
            except subprocess.TimeoutExpired:
                serve.kill()
                code = serve.wait()
            sampler.stop()
            log_text = serve_log.read_text(errors="replace")
            summary["exit_status"] = code
            summary["stop_seconds"] = round(time.monotonic() - t_stop, 1)
            summary["abort_in_log"] = [m for m in ABORT_MARKS if m in log_text]
            summary["load_after"] = os.getloadavg()
            summary["levels"] = rows
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = _table(rows)
    capacity = _capacity_text(rows)
    if capacity:
        table = f"{capacity}\n\nThe whole search:\n\n{table}"
    admission = _admission_lines(rows)
    (args.out / "summary.md").write_text(
        f"command: `{summary['command']}`\n\nload before/after: {summary['load_before']} / "
        f"{summary['load_after']}\n\n{table}\n\nadmission (sampled each second):\n{admission}\n\n"
        f"exit status {summary['exit_status']}, abort marks in the log: {summary['abort_in_log'] or 'none'}\n"
    )
    print(table)
    print(admission)
    print(
        f"daemon exit status {summary['exit_status']}; "
        f"abort marks in the log: {summary['abort_in_log'] or 'none'}"
    )
    return 0 if summary["exit_status"] == 0 and not summary["abort_in_log"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(main(p.parse_args()))
