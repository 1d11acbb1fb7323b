"""A lent machine's fingerprint, printed at the head of every device run: how fast its host runs the
interpreter, and what one synchronized round trip to the accelerator costs through MLX.

Lent machines of one kind differ: the same gateway level can run at very different speeds on two of
them (docs/benchmarks.md). What such a difference moves is the engines' per-step host work (building
the lazy graph, launching kernels, waiting on a sync), so these numbers are printed before any level,
for a run's results to be read against the machine it ran on.

    python3 -m tools.device.machine_probe          # one JSON line
"""

from __future__ import annotations

import json
import platform
import time


def _python_loop_ms(n: int = 2_000_000) -> float:
    """Best of three: a plain interpreter loop (the engines' Python per row runs at this speed)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i & 7
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def _mlx_round_trip_us(n: int = 300) -> dict[str, float]:
    """Median microseconds of one tiny op evaluated and synchronized (launch + wait + return), and of
    ten dependent ops in one evaluation (launches queued behind each other)."""
    import mlx.core as mx
    import numpy as np

    x = mx.zeros((256,), dtype=mx.float32)
    mx.eval(x + 1)  # the kernel is built once, outside the timing
    one: list[float] = []
    ten: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(x + 1)
        one.append(time.perf_counter() - t)
    for _ in range(n):
        y = x
        t = time.perf_counter()
        for _ in range(10):
            y = y + 1
        mx.eval(y)
        ten.append(time.perf_counter() - t)
    return {
        "mlx_sync_us": round(1e6 * float(np.median(one)), 1),
        "mlx_ten_ops_us": round(1e6 * float(np.median(ten)), 1),
    }


def probe() -> dict[str, object]:
    out: dict[str, object] = {"python_loop_ms": round(_python_loop_ms(), 1), "machine": platform.machine()}
    try:
        import mlx.core as mx

        out["mlx_device"] = str(mx.default_device())
        out.update(_mlx_round_trip_us())
    except ImportError as e:
        out["mlx"] = f"not importable: {e}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
