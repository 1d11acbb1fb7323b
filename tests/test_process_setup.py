"""Importing asr_core changes nothing in the process; `configure_process()` is the explicit set-up that
the programs running MLX make: OpenBLAS under MLX's CPU matmuls, with kernels the CPU runs, numpy's BLAS
on one thread, MLX's CUDA graphs off unless the environment chose.

Each check runs in a fresh interpreter, since the test session itself has been set up (conftest), with
an environment of its own (`fresh_env`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asr_core._blas import core_for
from asr_core._process import MLX_DEFAULTS
from tests.fixtures import peers

REPO = Path(__file__).resolve().parents[2]
# Prints the BLAS libraries the process has loaded, with their thread counts, before and after importing
# asr_core down to the modules that load mlx; SETUP is where an entry point's explicit set-up goes.
PROBE = """
import json, sys
import numpy
from threadpoolctl import threadpool_info

def blas():
    return {lib["filepath"]: lib["num_threads"] for lib in threadpool_info()}

before = blas()
SETUP
import asr_core, asr_core.bundle, asr_core.engine, asr_core.model
print(json.dumps({"before": before, "after": blas(), "mlx_loaded": "mlx.core" in sys.modules}))
"""


def in_fresh_interpreter(code: str, *args: str, **env: str) -> Any:
    """What `code` (run with `args`) prints last, as JSON. Its environment is this one without what the
    test session's own set-up put in it and without TTG_ settings, plus `env`; numpy's BLAS starts with
    two threads, whatever the machine."""
    session = {*MLX_DEFAULTS, "OPENBLAS_CORETYPE"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("TTG_") and k not in session}
    res = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO, env={**base, "OPENBLAS_NUM_THREADS": "2", **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def blas_libraries(setup: str = "") -> tuple[dict[str, int], dict[str, int]]:
    """{library path: threads} before and after the imports."""
    out = in_fresh_interpreter(PROBE.replace("SETUP", setup))
    assert out["mlx_loaded"], "the imports reach mlx.core, which a preload has to precede"
    return out["before"], out["after"]


@peers.linux_only
def test_importing_asr_core_loads_no_blas_library_and_sets_no_thread_count() -> None:
    before, after = blas_libraries()
    assert list(before.values()) == [2]  # numpy's own OpenBLAS, as the environment set it
    assert after == before


@peers.linux_only
def test_configure_process_preloads_openblas_and_runs_numpy_blas_on_one_thread() -> None:
    before, after = blas_libraries("from asr_core import configure_process; configure_process()")
    [numpy_blas] = before
    added = [path for path in after if path not in before]
    assert after[numpy_blas] == 1
    assert len(added) == 1 and "openblas-pthread" in added[0], (
        f"{added}: MLX's OpenBLAS is Debian's libopenblas0-pthread (`make deps` installs it)"
    )


@peers.linux_only
def test_the_ttg_commands_that_run_mlx_set_it_up_first_and_the_others_do_not() -> None:
    code = """
import json, os, sys
from gateway import cli
try:
    cli.main([sys.argv[1], "--help"])
except SystemExit:
    pass
openblas = "openblas-pthread" in open("/proc/self/maps").read()
print(json.dumps([openblas, os.environ.get("MLX_USE_CUDA_GRAPHS")]))
"""
    found = {command: in_fresh_interpreter(code, command) for command in ("serve", "transcribe", "tail")}
    assert found == {"serve": [True, "0"], "transcribe": [True, "0"], "tail": [False, None]}


@peers.linux_only
def test_the_engine_and_media_worker_processes_set_themselves_up() -> None:
    """`ttg serve` starts them as programs of their own: the engine process runs MLX (OpenBLAS under
    it, no CUDA graphs); a media worker runs only the streams' front ends (numpy's BLAS on one thread,
    no OpenBLAS, nothing of MLX's)."""
    code = """
import json, os, runpy, sys
from threadpoolctl import threadpool_info
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
numpy_threads = [lib["num_threads"] for lib in threadpool_info() if "scipy_openblas" in lib["filepath"]]
graphs = os.environ.get("MLX_USE_CUDA_GRAPHS")
print(json.dumps(["openblas-pthread" in open("/proc/self/maps").read(), numpy_threads, graphs]))
"""
    found = {
        program: in_fresh_interpreter(code, program)
        for program in ("asr_core.host", "gateway.workers.media_worker")
    }
    assert found == {"asr_core.host": [True, [1], "0"], "gateway.workers.media_worker": [False, [1], None]}


AVX512 = frozenset({"sse3", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def test_openblas_falling_back_to_its_generic_kernels_gets_the_best_the_cpu_runs() -> None:
    assert core_for("Prescott", AVX512) == "SkylakeX"
    assert core_for("Prescott", AVX512 - {"avx512bw"}) == "Haswell"
    assert core_for("Prescott", frozenset({"sse3", "avx"})) is None  # nothing better to name


def test_openblas_knowing_the_cpu_keeps_its_own_choice() -> None:
    for detected in ("Haswell", "Zen", "SkylakeX", "SapphireRapids", "Sandybridge"):
        assert core_for(detected, AVX512) is None


CORE = """
import json, os
from asr_core import configure_process
from asr_core._blas import openblas_kernels
configure_process()
flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split()
print(json.dumps([openblas_kernels(), flags, os.environ.get("OPENBLAS_CORETYPE")]))
"""


@peers.linux_only
@peers.x86_64_only
def test_mlxs_openblas_runs_kernels_this_cpu_supports_not_its_fallback() -> None:
    """Debian bookworm's OpenBLAS runs SSE3 kernels on CPUs newer than it (5x slower matmuls); the set-up
    names better ones where the CPU has them. On any CPU: what runs is not a fallback `core_for` would
    replace."""
    running, flags, _ = in_fresh_interpreter(CORE)
    assert core_for(running, frozenset(flags)) is None, (
        f"{running} kernels on a CPU with {sorted(f for f in flags if f.startswith(('avx', 'fma')))}"
    )


@peers.linux_only
@peers.x86_64_only
def test_an_operators_own_openblas_kernels_are_kept() -> None:
    assert in_fresh_interpreter(CORE, OPENBLAS_CORETYPE="Prescott")[::2] == ["Prescott", "Prescott"]


@peers.linux_only
def test_a_model_loaded_on_the_cpu_logs_what_runs_its_matmuls(caplog: pytest.LogCaptureFixture) -> None:
    from asr_core.model import AsrModel, embedded_model_dir

    model_dir = embedded_model_dir()
    assert model_dir is not None, "the demo model ships with the package"
    with caplog.at_level(logging.INFO, logger="asr_core.model"):
        AsrModel.load(model_dir, "f32")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU matmuls")]
    assert line.startswith("CPU matmuls: OpenBLAS (") and " kernels" in line, line


def test_an_operators_own_cuda_graph_setting_is_kept() -> None:
    code = """
import json, os
from asr_core import configure_process
configure_process()
print(json.dumps(os.environ["MLX_USE_CUDA_GRAPHS"]))
"""
    assert in_fresh_interpreter(code, MLX_USE_CUDA_GRAPHS="1") == "1"


@peers.linux_only
def test_torch_and_mlx_run_in_one_process_set_up_with_torch_first() -> None:
    """torch's batched matmul with OpenBLAS global: it crashed (SIGSEGV) where OpenBLAS has a
    cblas_sgemm_batch of its own (Debian 13) when torch was loaded after it."""
    code = """
from asr_core import configure_process
configure_process(torch=True)
import mlx.core as mx
import torch
q, k = torch.randn(1, 8, 50, 64), torch.randn(1, 8, 64, 100)
a = mx.random.normal((64, 64))
print(tuple((q @ k).shape), (a @ a).shape)
"""
    peers.module("torch")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["(1,", "8,", "50,", "100)", "(64,", "64)"]


@peers.linux_only
def test_the_engine_runs_the_encoders_cpu_matmuls_on_the_threads_its_config_names() -> None:
    """TTG_ENCODER__CPU_THREADS (default 1): a step's matmuls are a few rows per call, and OpenBLAS's
    other threads would spin on the cores that the calls' audio and signalling need."""
    code = """
import json
from asr_core import configure_process
configure_process()
from threadpoolctl import threadpool_info
from asr_core.config import EngineConfig
from asr_core.engine import AsrEngine
from asr_core.model import AsrModel, embedded_model_dir

def threads():
    return [lib["num_threads"] for lib in threadpool_info() if "openblas-pthread" in lib["filepath"]]

before = threads()
with AsrEngine(AsrModel.load(embedded_model_dir(), "f32"), EngineConfig(cpu_threads=1)):
    during = threads()
print(json.dumps([before, during]))
"""
    assert in_fresh_interpreter(code) == [[2], [1]]
