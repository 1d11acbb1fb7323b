"""PNG plots of a report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tools.replay.report import CapacityReport, Report


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * 1000.0)
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(x, y, where="post", label=f"{label} (n={len(x)})")


def latency_cdf(report: Report, path: Path) -> bool:
    completed = [c for c in report.calls if c.outcome == "completed"]
    ttf = [u.ttf_s for c in completed for u in c.utterances if u.ttf_s is not None]
    ttfp = [u.ttfp_s for c in completed for u in c.utterances if u.ttfp_s is not None]
    if not ttf and not ttfp:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _cdf(ax, ttf, "time to final")
    _cdf(ax, ttfp, "time to first partial")
    for q in (0.5, 0.95, 0.99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("share of utterances")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(
        f"Latency CDF, {report.summary.calls} calls, peak {report.summary.peak_active_calls} concurrent"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def batch_over_time(report: Report, path: Path) -> bool:
    pts = [p for p in report.batch_series if p.mean_batch is not None]
    if not pts and not report.concurrency_series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if pts:
        ax.plot(
            [p.t for p in pts],
            [p.mean_batch or 0.0 for p in pts],
            "o-",
            ms=3,
            label="mean encoder batch (/metrics)",
        )
    if report.concurrency_series:
        t, n = zip(*report.concurrency_series, strict=True)
        ax.step(t, n, where="post", color="tab:orange", alpha=0.8, label="active calls (replay)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("calls / chunks per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title("Encoder batch size over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def latency_vs_concurrency(cap: CapacityReport, path: Path) -> bool:
    levels = sorted((lv for lv in cap.levels if lv.summary.ttf_s.n), key=lambda lv: lv.concurrency)
    if not levels:
        return False
    x = [lv.concurrency for lv in levels]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in ("p50", "p95", "p99"):
        ax.plot(x, [1000 * (getattr(lv.summary.ttf_s, name) or 0) for lv in levels], "o-", ms=4, label=name)
    ax.axhline(cap.bound_s * 1000, color="red", ls="--", lw=1, label=f"bound {cap.bound_s * 1000:.0f} ms")
    if cap.capacity:
        ax.axvline(cap.capacity, color="green", ls=":", lw=1, label=f"capacity {cap.capacity}")
    ax.set_xlabel("concurrent calls")
    ax.set_ylabel("time to final (ms)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Time to final vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
