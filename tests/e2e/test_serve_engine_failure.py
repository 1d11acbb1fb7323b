"""If the engine's MLX thread dies, the daemon says so loudly, turns not-ready, ends every call (BYE
and call_end with its finals so far) and exits with status 1 so that its supervisor restarts it.

The daemon runs in this process (its `engine_factory` seam) so a fault can be injected into the real
engine: the real tiny model, whose encoder step raises after a few steps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asr_core.accelerator import this_process
from asr_core.engine import AsrEngine
from asr_core.model import AsrModel
from gateway.config import Settings
from gateway.daemon import EXIT_FAILURE, Daemon, ModelChoice, engine_config
from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import (
    DATA,
    STREAM,
    Speech,
    rtp_range,
    sipp_calls,
    until,
)
from tools.ports import free_port

pytestmark = [pytest.mark.sipp, pytest.mark.redis]


class _FailingEncoder:
    def __init__(self, encoder: Any, fail_at_step: int) -> None:
        self._encoder = encoder
        self._left = fail_at_step

    def alloc(self, prompt_id: int, lookahead: int) -> int:
        return int(self._encoder.alloc(prompt_id, lookahead))

    def release(self, slot: int) -> None:
        self._encoder.release(slot)

    def step(self, rows: Sequence[tuple[int, np.ndarray, bool, bool]]) -> list[np.ndarray]:
        self._left -= 1
        if self._left <= 0:
            raise RuntimeError("injected: the GPU fell off the bus")
        return list(self._encoder.step(rows))


class FailingModel:
    """The real model, except that its encoder fails at step `fail_at_step`."""

    def __init__(self, model: AsrModel, fail_at_step: int) -> None:
        self._model = model
        self._fail_at = fail_at_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def create_encoder(self) -> _FailingEncoder:
        return _FailingEncoder(self._model.create_encoder(), self._fail_at)


async def test_an_engine_failure_ends_every_call_and_exits_with_status_1(
    tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lo, hi = rtp_range()
    settings = Settings(
        model={"dir": str(tiny_bundle)},
        sip={"host": "127.0.0.1", "port": free_port()},
        rtp={"host": "127.0.0.1", "port_min": lo, "port_max": hi},
        http={"host": "127.0.0.1", "port": free_port()},
        redis={"url": redis_url},
        sink={"spool_dir": str(tmp_path / "spool")},
    )
    model = await asyncio.to_thread(AsrModel.load, tiny_bundle, "f32")

    def engine(m: Any, on_fatal: Any) -> AsrEngine:
        return AsrEngine(FailingModel(m, 12), engine_config(settings, on=this_process()), on_fatal=on_fatal)

    daemon = Daemon(
        settings, model, ModelChoice(tiny_bundle, "tiny"), engine_factory=engine, install_signals=False
    )
    run = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.ready.wait(), 60)
    callers = asyncio.create_task(
        asyncio.to_thread(
            sipp_calls, settings.sip.port, DATA / "uac_stream_until_bye.xml", tmp_path / "sipp",
            speech=short_speech, calls=2, rate=20, loops=-1, timeout_s=40,
        )
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        code = await asyncio.wait_for(run, 60)
    assert code == EXIT_FAILURE
    assert "ASR engine failed" in daemon.readiness.reasons()
    result = await callers
    assert result.stats.get("SuccessfulCall(C)") == 2, result.stderr + result.errors  # both got a BYE

    await until(lambda: len([1 for _, f in read_stream(redis_url, STREAM) if f["type"] == "call_end"]) == 2,
                "two call_end events", timeout_s=10)  # fmt: skip
    entries = read_stream(redis_url, STREAM)
    report = audit(entries, ended=[f["call_id"] for _, f in entries if f["type"] == "call_start"])
    assert not report.problems, report.problems
    for events in report.calls.values():
        assert (events[-1]["reason"], events[-1]["asr"]) == ("error", "error"), events[-1]
        assert "injected" in events[-1]["asr_error"]
    critical = [r for r in caplog.records if r.name == "gateway.daemon" and r.levelno == logging.CRITICAL]
    assert len(critical) == 1 and "exiting with status 1" in critical[0].getMessage()
