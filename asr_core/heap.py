"""The interpreter's heap of a long-running process, once it has started."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then move every object still alive (modules, the model and its traced
    graphs, settings, sockets) to the interpreter's permanent generation, where the cyclic collector
    does not look at them again; returns how many were frozen.

    Each of the gateway's processes calls this once, when it is ready. A full collection walks every
    object the collector tracks, with the event loop or an engine's MLX thread stopped meanwhile: tens
    of milliseconds for a start-up heap of ~100 000 objects (docs/benchmarks.md); after this, only what
    the calls made. A frozen object that later dies is still freed by its reference count; only a
    reference cycle among frozen objects stays until `gc.unfreeze()`, which the MLX threads' release
    (`model.release_mlx_thread`) calls before its collection: such a cycle may hold device arrays, which
    must go before the accelerator's runtime does."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
