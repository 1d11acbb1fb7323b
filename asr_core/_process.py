"""The set-up of a process that runs asr_core: an explicit call at the program's start, before anything
imports mlx.core, never done on import. The programs that make it: the `ttg` commands that run MLX, the
engine process, the test session, the benchmarks; a media worker, which runs the streams' front ends but
no MLX, with `mlx=False`.

- MLX's CPU BLAS and numpy's BLAS threads: see `asr_core._blas`.
- MLX's CUDA graphs off unless the environment says otherwise (`MLX_DEFAULTS`). MLX records each
  evaluation's kernels into CUDA graphs and, for a graph of a shape its cache lacks, instantiates a new
  one. The engine's steps change shape with their rows and the decoder's loop with its rows left, so on
  the GPU the engine thread spent its launch time instantiating and destroying graphs rather than
  launching kernels; launched directly they cost it less (docs/benchmarks.md, "CUDA graphs off"). MLX
  reads the variable once, at its first use of the GPU; other backends ignore it.
"""

from __future__ import annotations

import contextlib
import os

from asr_core._blas import limit_numpy_blas_threads, preload_openblas

MLX_DEFAULTS = {"MLX_USE_CUDA_GRAPHS": "0"}


def configure_process(*, torch: bool = False, mlx: bool = True) -> str | None:
    """Set this process up to run asr_core; returns the preloaded OpenBLAS's path, or None when not used.
    `torch=True`: import torch first where it is installed (`asr_core._blas`). `mlx=False`: a process
    that runs no MLX gets numpy's BLAS limit only."""
    if torch:
        with contextlib.suppress(ImportError):
            import torch as _torch  # noqa: F401
    path = None
    if mlx:
        for name, value in MLX_DEFAULTS.items():
            os.environ.setdefault(name, value)  # an operator's own setting wins
        path = preload_openblas()
    limit_numpy_blas_threads()
    return path
