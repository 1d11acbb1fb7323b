"""The BLAS set-up of a process that runs MLX on the CPU, which `asr_core.configure_process()` makes
(explicitly, never on import) before anything imports mlx.core:
- it preloads Debian's OpenBLAS so that MLX's CPU backend uses it for matmuls. mlx[cpu] wheels resolve
  cblas_* symbols when mlx.core loads; a library loaded earlier with RTLD_GLOBAL wins, one loaded later
  is never used. Measured on the 2-core dev VM: fp32 1024x1024x4096 matmul 7.5 GFLOP/s (bundled BLAS)
  vs 242 GFLOP/s (openblas-pthread). Opt out with TTG_NO_OPENBLAS=1; a missing library is not an error.
- it names the library's kernels where the library does not know the CPU (`core_for`). OpenBLAS built for
  many CPUs (Debian's) picks its kernels by the CPU's model number when it loads; one older than the CPU
  (bookworm's 0.3.21 on a 5th-generation Xeon, model 207) falls back to its SSE3 "Prescott" kernels, 5x
  slower than the AVX-512 ones the CPU runs (docs/benchmarks.md, "OpenBLAS's kernels"). The choice is
  read once, at load, from OPENBLAS_CORETYPE: a child process loads the library to read what it picks
  alone, and this process sets the variable before its own load (the processes it starts inherit it).
  An operator's own OPENBLAS_CORETYPE is kept.
- it runs numpy's bundled OpenBLAS single-threaded (`limit_numpy_blas_threads`, which the engine's
  start also applies).
A process that also runs torch passes `torch=True`: torch is then imported first. Its library exports
BLAS symbols of its own (sgemm_, cblas_sgemm_batch, from its MKL) and binds them when it loads; loaded
after a global OpenBLAS it takes OpenBLAS's instead, and where those differ (Debian 13's OpenBLAS 0.3.29
has a cblas_sgemm_batch of another ABI) torch's batched matmul crashes.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_loaded: str | None = None
# What OpenBLAS's x86-64 builds run on a CPU whose model they do not know.
_FALLBACK_CORE = "Prescott"
# The kernels a CPU's feature flags can run, best first: AVX-512 (SkylakeX's also serve Cooper Lake and
# Sapphire Rapids for fp32), then AVX2 with FMA.
_CORES_BY_FLAGS = (
    ("SkylakeX", frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})),
    ("Haswell", frozenset({"avx2", "fma"})),
)


def core_for(detected: str, cpu_flags: frozenset[str]) -> str | None:
    """The kernels to name where OpenBLAS fell back to its generic ones on a CPU that runs better
    (None: keep what it chose)."""
    if detected.lower() != _FALLBACK_CORE.lower():
        return None
    return next((core for core, needs in _CORES_BY_FLAGS if needs <= cpu_flags), None)


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


_PROBE = """
import ctypes, sys
name = ctypes.CDLL(sys.argv[1]).openblas_get_corename
name.restype = ctypes.c_char_p
print(name().decode())
"""


def _detected_core(path: str) -> str | None:
    """The kernels `path` picks for this CPU on its own, read in a child process (the choice is made
    when the library loads, once per process)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    try:
        res = subprocess.run(
            [sys.executable, "-S", "-c", _PROBE, path], env=env, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (res.stdout.strip() or None) if res.returncode == 0 else None


def _name_kernels(path: str) -> None:
    """Set OPENBLAS_CORETYPE before `path` loads where the library would fall back (`core_for`)."""
    if os.environ.get("OPENBLAS_CORETYPE") or platform.machine() != "x86_64":
        return
    detected = _detected_core(path)
    core = core_for(detected, _cpu_flags()) if detected else None
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core
        logger.info(
            "OpenBLAS (%s) picks its %s kernels on this CPU; running its %s ones", path, detected, core
        )


def preload_openblas() -> str | None:
    """Load OpenBLAS globally (once); returns its path, or None when not used."""
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    if os.environ.get("TTG_NO_OPENBLAS") == "1":
        return None
    if "mlx.core" in sys.modules:
        logger.warning(
            "mlx.core was imported before OpenBLAS could be preloaded: MLX's CPU matmuls use its bundled "
            "BLAS (~30x slower); call asr_core.configure_process() before anything imports mlx"
        )
        return None
    for path in _CANDIDATES:
        if os.path.exists(path):
            _name_kernels(path)
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _loaded = path
            return path
    return None


def openblas_path() -> str | None:
    return _loaded


def openblas_kernels() -> str | None:
    """The kernels the preloaded OpenBLAS runs (its core name); None where none was preloaded."""
    name = getattr(ctypes.CDLL(_loaded), "openblas_get_corename", None) if _loaded is not None else None
    if name is None:
        return None
    name.restype = ctypes.c_char_p
    return str(name().decode())


def cpu_matmuls() -> str:
    """What runs MLX's CPU matmuls in this process, for the engine's start-up log."""
    if _loaded is None:
        if not sys.platform.startswith("linux"):
            return "MLX's own BLAS (Accelerate on macOS)"
        return "MLX's bundled BLAS (~30x slower than OpenBLAS: see asr_core._blas)"
    kernels = openblas_kernels()
    if kernels is None:
        return _loaded
    chosen = os.environ.get("OPENBLAS_CORETYPE")
    return f"OpenBLAS ({_loaded}), its {kernels} kernels" + (
        f" (OPENBLAS_CORETYPE={chosen})" if chosen else ""
    )


def set_openblas_threads(n: int) -> int | None:
    """Run the preloaded OpenBLAS (MLX's CPU matmuls) on `n` threads from now on; returns the count it
    had, or None where no OpenBLAS was preloaded (nothing changes)."""
    lib = ctypes.CDLL(_loaded) if _loaded is not None else None
    get = getattr(lib, "openblas_get_num_threads", None)
    set_ = getattr(lib, "openblas_set_num_threads", None)
    if get is None or set_ is None:
        return None
    before = int(get())
    set_(ctypes.c_int(n))
    return before


@contextlib.contextmanager
def openblas_threads(n: int) -> Iterator[None]:
    """Run the preloaded OpenBLAS on `n` threads inside the block. Its results depend on the thread
    count (the work is split, and summed, differently), so a computation that must give the same bytes
    on every run of a machine pins it. A no-op where no OpenBLAS was preloaded."""
    before = set_openblas_threads(n)
    try:
        yield
    finally:
        if before is not None:
            set_openblas_threads(before)


def _numpy_openblas() -> list[ctypes.CDLL]:
    """The OpenBLAS libraries bundled in numpy's wheel (numpy.libs)."""
    import numpy

    libs = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    found = []
    for path in glob.glob(os.path.join(libs, "libscipy_openblas*.so*")):
        try:
            found.append(ctypes.CDLL(path))
        except OSError:
            continue
    return found


def limit_numpy_blas_threads(n: int | None = None) -> bool:
    """Run numpy's bundled OpenBLAS single-threaded (or `TTG_NUMPY_BLAS_THREADS`).

    The per-call front end does small matmuls (mel filterbank on a few frames) on the caller's thread;
    a multi-threaded BLAS spends 5x the CPU on them (measured: 1.96 vs 0.38 ms per audio-second at
    320 ms pushes) and competes with the MLX thread. Parallelism in a gateway comes from calls.
    Returns True when the limit was applied.
    """
    if n is None:
        n = int(os.environ.get("TTG_NUMPY_BLAS_THREADS", "1"))
    for lib in _numpy_openblas():
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads"):
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                return True
    return False
