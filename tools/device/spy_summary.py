"""Where one thread's time goes in a py-spy profile (`py-spy record -f raw --threads --idle [--native]`,
as `h200_run.sh gateway` with PROFILE_AT_S and `h200_run.sh profile` take them): its samples by the
deepest Python frame, by the calls under one function, and, at chosen lines, by the C functions on the
stack below them (with `--native`).

    python3 -m tools.device.spy_summary all.raw --thread asr-encoder --under AsrEngine._run \\
        --site streaming.py:406 --site device.py:232

Every thread of the profile is also listed with the share of its samples spent waiting for the
interpreter lock (`waits_for_the_lock`): how much the process's Python threads hold each other up.

A marker is a substring of a C frame (`cuGraphInstantiate`), or `A>B`: a frame with A and one below it
(called from it) with B (`malloc_async>pthread_mutex_lock`: MLX's allocator waiting for its lock). A sample
counts once for a marker however many of its frames match.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# What the gateway's profiles were read for: MLX's CUDA graphs, its allocator, waits on the GPU, cuBLAS.
MARKERS: dict[str, str] = {
    "graph instantiated": "cuGraphInstantiate",
    "graph exec destroyed": "cuGraphExecDestroy",
    "graph exec updated": "cuGraphExecUpdate",
    "graph launched": "cuGraphLaunch",
    "MLX's allocator": "malloc_async",
    "its lock": "malloc_async>pthread_mutex_lock",
    "cudaMallocAsync": "cuMemAllocAsync",
    "waiting on the GPU": "cuEventSynchronize",
    "cuBLASLt": "cublasLt",
}

_PYTHON = re.compile(r"\.py:\d+\)$")
_UNNAMED = re.compile(r"^0x[0-9a-f]+ ")  # a C frame py-spy found no symbol for
_THREAD = re.compile(r"^thread \((\d+)\): (.*)$")


@dataclass(frozen=True)
class Sample:
    thread: str  # "asr-encoder (2421)"
    frames: tuple[str, ...]  # outermost first
    count: int

    @property
    def python(self) -> list[int]:
        """Indices of the Python frames."""
        return [i for i, f in enumerate(self.frames) if _PYTHON.search(f)]


def read_raw(text: str) -> list[Sample]:
    """py-spy's raw (collapsed) format: `frame;frame;... COUNT` a line, the thread first with `--threads`."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = ""
        if m := _THREAD.match(frames[0]):
            thread, frames = f"{m.group(2)} ({m.group(1)})", frames[1:]
        out.append(Sample(thread, tuple(frames), int(count)))
    return out


def _name(frame: str) -> str:
    """`AsrEngine._run (asr_core/engine.py:515)` -> `AsrEngine._run`."""
    return frame.split(" (", 1)[0]


def _site(frame: str) -> str:
    """`... (asr_core/encoder/streaming.py:406)` -> `asr_core/encoder/streaming.py:406`."""
    return frame.rsplit("(", 1)[-1].rstrip(")")


def has_marker(frames: Sequence[str], marker: str) -> bool:
    first, _, then = marker.partition(">")
    for i, frame in enumerate(frames):
        if first in frame:
            return not then or any(then in f for f in frames[i + 1 :])
    return False


def waits_for_the_lock(sample: Sample) -> bool:
    """Whether the thread was waiting to take the interpreter lock back: CPython's `take_gil` waits on a
    condition with a timeout (the switch interval), and with the symbols py-spy finds in a release build
    that shows as `pthread_cond_timedwait` right below Python code (or below a C extension's function that
    let go of the lock). Python-level waits (`threading` locks, queues) show `PyThread_acquire_lock*`
    below, and MLX's own waits `pthread_cond_wait` under MLX frames: neither counts."""
    python = sample.python
    native = [f for f in sample.frames[python[-1] + 1 :] if not _UNNAMED.match(f)] if python else []
    if not native:
        return False
    last = native[-1]
    return ("take_gil" in last or "pthread_cond_timedwait" in last) and not any(
        "mlx" in f.lower() or "PyThread_acquire_lock" in f for f in native
    )


def lock_waits(samples: Iterable[Sample]) -> dict[str, tuple[int, int]]:
    """thread -> (samples, of them waiting for the interpreter lock), busiest waiter first."""
    totals: Counter[str] = Counter()
    waits: Counter[str] = Counter()
    for s in samples:
        totals[s.thread] += s.count
        if waits_for_the_lock(s):
            waits[s.thread] += s.count
    return {t: (totals[t], waits[t]) for t in sorted(totals, key=lambda t: -waits[t])}


@dataclass
class Summary:
    thread: str
    total: int
    leaves: Counter[str]  # deepest Python frame
    under: Counter[str]  # the calls under `under` (depth levels, " > "-joined)
    sites: dict[str, Counter[str]]  # site -> marker label -> samples ("" : all samples there)
    lock: dict[str, tuple[int, int]]  # every thread of the profile: samples, waiting for the lock


def summarize(
    samples: Iterable[Sample],
    thread: str,
    *,
    under: str | None = None,
    depth: int = 2,
    sites: Sequence[str] = (),
) -> Summary:
    samples = list(samples)
    chosen = [s for s in samples if thread in s.thread]
    names = sorted({s.thread for s in chosen})
    leaves: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    at: dict[str, Counter[str]] = {site: Counter() for site in sites}
    for s in chosen:
        python = s.python
        leaf = s.frames[python[-1]] if python else "(no Python frame)"
        leaves[f"{_name(leaf)} ({_site(leaf)})" if python else leaf] += s.count
        if under is not None:
            chain = [_name(s.frames[i]) for i in python]
            if under in chain:
                k = chain.index(under)
                calls[" > ".join(chain[k + 1 : k + 1 + depth]) or "(itself)"] += s.count
            else:
                calls["(elsewhere)"] += s.count
        for site, counter in at.items():
            if python and _site(leaf).endswith(site):
                native = s.frames[python[-1] + 1 :]
                counter[""] += s.count
                for label, marker in MARKERS.items():
                    if has_marker(native, marker):
                        counter[label] += s.count
    return Summary(", ".join(names), sum(s.count for s in chosen), leaves, calls, at, lock_waits(samples))


def render(summary: Summary, top: int = 15) -> str:
    total = max(1, summary.total)

    def pct(n: int) -> str:
        return f"{n} ({100 * n / total:.0f} %)"

    lines = [f"thread {summary.thread or '(none matched)'}: {summary.total} samples", ""]
    if summary.under:
        lines += ["| under | samples |", "| --- | --- |"]
        lines += [f"| {k} | {pct(v)} |" for k, v in summary.under.most_common(top)] + [""]
    lines += ["| deepest Python frame | samples |", "| --- | --- |"]
    lines += [f"| {k} | {pct(v)} |" for k, v in summary.leaves.most_common(top)]
    if summary.sites:
        labels = list(MARKERS)
        lines += ["", "| at | samples | " + " | ".join(labels) + " |", "| --- " * (len(labels) + 2) + "|"]
        for site, counter in summary.sites.items():
            here = counter[""]
            cells = [f"{counter[label]} ({100 * counter[label] / max(1, here):.0f} %)" for label in labels]
            lines.append(f"| {site} | {pct(here)} | " + " | ".join(cells) + " |")
    lines += ["", "| thread | samples | waiting for the interpreter lock |", "| --- | --- | --- |"]
    for name, (n, waiting) in summary.lock.items():
        lines.append(f"| {name} | {n} | {waiting} ({100 * waiting / max(1, n):.0f} %) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("raw", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--thread", default="", help="a substring of the thread's name or id (default: all)")
    parser.add_argument("--under", help="group the samples by the calls under this function")
    parser.add_argument("--depth", type=int, default=2, help="levels of calls under --under")
    parser.add_argument("--site", action="append", default=[], help="file.py:LINE: the C functions there")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    summary = summarize(
        read_raw(args.raw.read_text()), args.thread, under=args.under, depth=args.depth, sites=args.site
    )
    print(render(summary, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
