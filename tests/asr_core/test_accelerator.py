"""Which accelerator a gateway runs its engines on, and what its "auto" settings come to there."""

from __future__ import annotations

import sys

import pytest

from asr_core.accelerator import (
    Accelerator,
    AcceleratorProbeError,
    EngineProfile,
    probe,
    profile,
    this_process,
)
from asr_core.config import DecoderConfig, SchedulerConfig

GIB = 1 << 30


def test_a_child_interpreter_sees_the_device_this_process_sees() -> None:
    assert probe() == this_process()


def test_a_probe_that_cannot_run_is_an_error_not_a_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(AcceleratorProbeError, match="probe failed: exit status 1"):
        probe()


def test_off_cuda_the_engine_keeps_its_own_defaults() -> None:
    engine_defaults = EngineProfile(1, DecoderConfig().mode, SchedulerConfig().max_batch)
    assert profile(Accelerator("cpu")) == engine_defaults == EngineProfile(1, "batched", 64)
    assert profile(Accelerator("metal", 48 * GIB)) == engine_defaults


def test_a_cuda_card_gets_four_engines_decoding_on_the_device_in_batches_of_512() -> None:
    assert profile(Accelerator("cuda", 134 * GIB)) == EngineProfile(4, "device", 512)  # 141 GB card
    assert profile(Accelerator("cuda", 75 * GIB)) == EngineProfile(4, "device", 512)  # 80 GB card


def test_a_smaller_cuda_card_gets_one_engine_per_16_gib() -> None:
    assert profile(Accelerator("cuda", 38 * GIB)).engines == 2
    assert profile(Accelerator("cuda", 22 * GIB)).engines == 1
    assert profile(Accelerator("cuda", 8 * GIB)).engines == 1
