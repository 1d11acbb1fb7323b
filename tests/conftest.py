"""Shared fixtures. Fixture modules live in tests/fixtures/ (one per resource) and are registered
here, so that areas do not edit one file: bundle.py (tiny model bundles), mlx_audio.py (bundles in
the MLX layouts, made with mlx-audio's converter), redis.py (a real redis-server on loopback),
procs.py (helpers to start and stop processes by PID)."""

from __future__ import annotations

from asr_core import configure_process

# The test session runs MLX on the CPU (OpenBLAS under its matmuls, before any test module imports mlx)
# and torch (the reference implementation).
configure_process(torch=True)

pytest_plugins: list[str] = [
    "tests.fixtures.bundle",
    "tests.fixtures.mlx_audio",
    "tests.fixtures.redis",
    "tests.fixtures.replay",
    "tests.fixtures.telephony",
]
