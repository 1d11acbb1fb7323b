"""Shared fixtures. Fixture modules live in tests/fixtures/ (one per resource) and are registered
here, so that areas do not edit one file: bundle.py (tiny model bundles), mlx_audio.py (bundles in
the MLX layouts, made with mlx-audio's converter), redis.py (a real redis-server on loopback),
procs.py (helpers to start and stop processes by PID)."""

from __future__ import annotations

import asr_core  # noqa: F401  (preloads OpenBLAS before any test imports mlx)

pytest_plugins: list[str] = [
    "tests.fixtures.bundle",
    "tests.fixtures.mlx_audio",
    "tests.fixtures.redis",
    "tests.fixtures.replay",
    "tests.fixtures.telephony",
]
