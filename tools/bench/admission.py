"""The adaptive call limit against a burst, in a model of an engine measured under one.

    ttg bench admission SUMMARY.json               # a `ttg bench gateway` summary with an admission timeline
    ttg bench admission SUMMARY.json --cps 125,60,30 --calls 2500 --delay 1

A burst on a lent card costs minutes of its budget, and a new admission rule is worth judging before it
gets one. This program replays a burst against `gateway.sip.admission.ConcurrencyLimit` (the checkout's
own, so a worktree of other code measures that code) with an engine modelled on a measured one: the
engine's lag and load, as the daemon reads them four times a second, are functions of the streams up
`--delay` seconds before, read off the rising part of the level's admission timeline (each second's
streams against the lag and load one delay later, made non-decreasing, and beyond the largest count
measured, extended along the last two points' slope). Calls come at `--cps` a second until `--calls`
were offered; every call the limit allows is taken and stays (the calls outlast the run), every other
is refused, as `ttg replay` does.

What the model leaves out: the engine's queue past its capacity (a limit that lets in fewer streams than
the measured burst meets the lag the burst met at that count, which is the engine's steady curve only
while it keeps up), the cuts' effect on the lag, and calls ending. It compares rules on one engine's
measured response; a card's run decides. Prints a table and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.daemon import STATUS_PERIOD_S as UPDATE_S  # how often the daemon updates the limit
from gateway.sip.admission import ConcurrencyLimit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "summary", type=Path, help="a `ttg bench gateway` summary.json with an admission timeline"
    )
    parser.add_argument("--level", type=int, default=0, help="which of its levels (index)")
    parser.add_argument("--cps", default="125,60,30", help="new calls a second, one run each")
    parser.add_argument("--calls", type=int, default=2500, help="calls offered")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each run lasts")
    parser.add_argument(
        "--delay", type=float, default=1.0, help="how far the lag and load trail the streams (s)"
    )
    parser.add_argument("--lag-ms", type=float, default=1000.0, help="TTG_SIP__CALL_LIMIT_LAG_MS")
    parser.add_argument("--max-load", type=float, default=0.8, help="TTG_SIP__CALL_LIMIT_LOAD")
    parser.add_argument("--start", type=int, default=32, help="TTG_SIP__CALL_LIMIT_START")
    parser.add_argument("--ceiling", type=int, default=5000, help="TTG_SIP__MAX_CALLS")
    parser.add_argument("--out", type=Path, default=Path("var/bench/admission.json"))


@dataclass(frozen=True, slots=True)
class Response:
    """A signal as a non-decreasing function of the streams up a delay before."""

    streams: np.ndarray
    values: np.ndarray

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[float, float]]) -> Response:
        if len(pairs) < 2:
            raise ValueError("the timeline's rising part has fewer than two seconds with streams up")
        xs, ys = np.array(sorted(pairs)).T
        return cls(xs, np.maximum.accumulate(ys))

    def __call__(self, streams: float) -> float:
        xs, ys = self.streams, self.values
        if streams <= xs[-1]:
            return float(np.interp(streams, xs, ys))
        slope = (ys[-1] - ys[-2]) / max(1.0, xs[-1] - xs[-2])
        return float(ys[-1] + max(0.0, slope) * (streams - xs[-1]))


def responses(timeline: Sequence[Sequence[float]], delay_rows: int) -> tuple[Response, Response]:
    """(lag, load) against the streams up `delay_rows` seconds before, over the rows up to the peak of
    the streams (the burst's rising part: later rows hold the engine's recovery and calls ending).
    A timeline row is [t, streams up, limit, load, lag, refused]."""
    peak = max(range(len(timeline)), key=lambda i: timeline[i][1])
    rows = list(timeline[: peak + 1])
    pairs = [(rows[i][1], rows[i + delay_rows]) for i in range(len(rows) - delay_rows) if rows[i][1] > 0]
    lag = Response.from_pairs([(s, later[4]) for s, later in pairs])
    load = Response.from_pairs([(s, later[3]) for s, later in pairs])
    return lag, load


def run_burst(
    limit: ConcurrencyLimit,
    lag: Response,
    load: Response,
    cps: float,
    calls: int,
    seconds: float,
    delay_s: float,
) -> dict[str, Any]:
    """One burst: admitted, refused, and per second [t, streams, limit, lag, load]."""
    streams = offered = refused = 0
    history: list[int] = []  # the streams up after each update's calls
    behind = round(delay_s / UPDATE_S)  # updates the signals trail the streams by
    per_second: list[list[float]] = []
    steps = round(seconds / UPDATE_S)
    for k in range(steps):
        t = k * UPDATE_S
        due = min(calls, int(cps * (t + UPDATE_S)))
        while offered < due:
            offered += 1
            if streams < limit.limit:
                streams += 1
            else:
                refused += 1
        history.append(streams)
        then = history[k - behind] if k >= behind else 0
        lag_s, load_now = lag(then), load(then)
        limit.update(lag_s, streams, t, load_now)
        if k % round(1 / UPDATE_S) == 0:
            per_second.append([t, streams, limit.limit, round(lag_s, 3), round(load_now, 3)])
    return {"cps": cps, "admitted": streams, "refused": refused, "per_second": per_second}


def main(args: argparse.Namespace) -> int:
    summary = json.loads(args.summary.read_text())
    level = summary["levels"][args.level]
    lag, load = responses(level["admission_timeline"], max(1, round(args.delay)))
    runs = []
    for cps in (float(c) for c in args.cps.split(",")):
        limit = ConcurrencyLimit(args.lag_ms / 1000, args.start, args.ceiling, max_load=args.max_load)
        runs.append(run_burst(limit, lag, load, cps, args.calls, args.seconds, args.delay))
    measured = level["calls"] - level["rejected"]
    print(f"measured: {measured} of {level['calls']} admitted ({args.summary})")
    print("| calls a second | admitted | refused | limit at 5 s intervals (streams up / limit) |")
    print("| --- | --- | --- | --- |")
    for r in runs:
        marks = " ".join(f"{int(s)}/{int(lim)}" for _, s, lim, _, _ in r["per_second"][::5])
        print(f"| {r['cps']:g} | {r['admitted']} | {r['refused']} | {marks} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"summary": str(args.summary), "measured_admitted": measured, "runs": runs})
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
