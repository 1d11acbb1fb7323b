"""The multi-process gateway when a process dies: a media worker killed mid-call ends its calls as
errors with their finals and call_end and is replaced while the gateway goes on (other calls continue,
new calls are taken, SIGTERM still exits 0); the only engine process killed ends every call and exits
1 for the supervisor; one of two engine processes killed ends its workers' calls and is replaced while
the other engine's calls go on."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import DATA, SIPP_DATA, STREAM, Serve, Speech, sipp_calls, until
from tests.fixtures import mps_control

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]


def _children(pid: int) -> dict[int, str]:
    """The process's children: pid -> command line."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def _callers(gw: Serve, speech: Speech, workdir: Path, n: int) -> asyncio.Task[Any]:
    """n callers that keep talking (their file in a loop) until the gateway hangs up."""
    return asyncio.create_task(
        asyncio.to_thread(
            sipp_calls, gw.sip_port, DATA / "uac_stream_until_bye.xml", workdir,
            speech=speech, calls=n, rate=20, loops=-1, timeout_s=90,
        )
    )  # fmt: skip


async def _one_more_call_then_sigterm(
    gw: Serve, speech: Speech, workdir: Path, callers: asyncio.Task[Any]
) -> None:
    """A new call is taken and transcribed to its end; then SIGTERM drains the rest and exits 0."""
    newcomer = await asyncio.to_thread(
        sipp_calls, gw.sip_port, SIPP_DATA / "uac_stream.xml", workdir,
        speech=speech, hold_ms=speech.ms + 1500, timeout_s=60,
    )  # fmt: skip
    assert newcomer.stats.get("SuccessfulCall(C)") == 1, newcomer.stderr + newcomer.errors
    gw.signal(signal.SIGTERM)
    assert await asyncio.to_thread(gw.wait, 60) == 0, gw.log_tail()
    await callers


def _audited(redis_url: str) -> dict[tuple[str, str], list[dict[str, str]]]:
    """Every call of the stream, by (call_id, leg): each is call_start ... call_end with gapless seq."""
    entries = read_stream(redis_url, STREAM)
    report = audit(entries, ended=[f["call_id"] for _, f in entries if f["type"] == "call_start"])
    assert not report.problems, report.problems
    return report.calls


def _talking(redis_url: str, n: int) -> Callable[[], bool]:
    def check() -> bool:
        entries = read_stream(redis_url, STREAM)
        started = {f["call_id"] for _, f in entries if f["type"] == "call_start"}
        talking = {f["call_id"] for _, f in entries if f["type"] in ("partial", "final")}
        return len(started) >= n and talking >= started

    return check


@pytest.fixture
def workers_gateway(tiny_bundle: Path, redis_url: str, tmp_path: Path) -> Iterator[Serve]:
    gw = Serve(tmp_path / "serve", bundle=tiny_bundle, redis_url=redis_url, mode="media_workers",
               env={"TTG_DAEMON__SHUTDOWN_GRACE_S": "0"})  # fmt: skip
    yield gw
    gw.stop(timeout_s=20.0)


async def test_a_media_worker_that_dies_ends_its_calls_as_errors_and_is_replaced(
    workers_gateway: Serve, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    gw = workers_gateway
    await asyncio.to_thread(gw.start)
    callers = _callers(gw, short_speech, tmp_path / "callers", 4)
    await until(_talking(redis_url, 4), "4 calls transcribing", timeout_s=60, detail=gw.log_tail)
    workers = {pid: cmd for pid, cmd in _children(gw.pid).items() if "gateway.workers.media_worker" in cmd}
    assert len(workers) == 2, workers
    victim = next(pid for pid, cmd in workers.items() if "--index 0" in cmd)
    os.kill(victim, signal.SIGKILL)

    def two_ended() -> bool:
        return sum(1 for _, f in read_stream(redis_url, STREAM) if f["type"] == "call_end") == 2

    await until(two_ended, "the dead worker's 2 calls ended", timeout_s=30, detail=gw.log_tail)
    await until(lambda: "media worker 0 replaced by process" in gw.log(), "worker 0 replaced", timeout_s=30,
                detail=gw.log_tail)  # fmt: skip
    assert gw.running
    status, body = gw.readyz()
    assert status == 200, body
    assert gw.metric("ttg_media_worker_deaths_total") == 1
    assert gw.metric("ttg_media_workers") == 2
    workers = {pid: cmd for pid, cmd in _children(gw.pid).items() if "gateway.workers.media_worker" in cmd}
    assert len(workers) == 2 and victim not in workers, workers

    # The survivors keep transcribing; a new call goes to the fresh worker 0 (it holds no legs), whose
    # new channel the running engine took on, and is transcribed to its end.
    before = len(read_stream(redis_url, STREAM))
    await until(lambda: len(read_stream(redis_url, STREAM)) > before + 2, "more transcripts", timeout_s=30)
    await _one_more_call_then_sigterm(gw, short_speech, tmp_path / "newcomer", callers)

    calls = _audited(redis_url)
    ends = [events[-1] for events in calls.values()]
    assert sorted(e["reason"] for e in ends) == ["bye", "error", "error", "shutdown", "shutdown"], ends
    for end in ends:
        events = calls[(end["call_id"], "caller")]
        # What the engine had decoded when the worker died still came out as finals; the newcomer
        # (the one that hung up itself) was transcribed through the replacement worker.
        assert any(f["type"] == "final" and f["text"] for f in events), events
    assert "front end 2 added" in gw.log()  # the engine's third input: the new worker's channel


async def test_the_engine_process_dying_ends_every_call_and_exits_1(
    workers_gateway: Serve, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    gw = workers_gateway
    await asyncio.to_thread(gw.start)
    callers = _callers(gw, short_speech, tmp_path / "callers", 2)
    await until(_talking(redis_url, 2), "2 calls transcribing", timeout_s=60, detail=gw.log_tail)
    engine = [pid for pid, cmd in _children(gw.pid).items() if "asr_core.host" in cmd]
    assert len(engine) == 1
    os.kill(engine[0], signal.SIGKILL)
    assert await asyncio.to_thread(gw.wait, 60) == 1, gw.log_tail()
    result = await callers
    assert result.stats.get("SuccessfulCall(C)") == 2, result.stderr + result.errors  # both got a BYE
    calls = _audited(redis_url)
    for events in calls.values():
        assert (events[-1]["reason"], events[-1]["asr"]) == ("error", "error"), events[-1]
        # Each call was talking: what the engine had decoded is there as finals.
        assert any(f["type"] == "final" and f["text"] for f in events), events
    assert "ASR engine failed" in gw.log()


def _environ(pid: int) -> list[str]:
    return (Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")).split("\0")


async def test_two_engine_processes_share_the_calls_of_their_workers_and_stop_cleanly(
    tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    """TTG_DAEMON__ENGINES=2 with three media workers: worker i feeds engine i mod 2, so engine 0 has two
    workers and engine 1 one, yet the calls spread evenly over both engines' encoder threads (a new leg
    goes to the engine with the fewest); every call gets its finals and call_end, and SIGTERM drains both
    (exit 0). Where NVIDIA's MPS control program is installed (here its stand-in), the engines — and only
    they — run through the gateway's own MPS server, which is told to quit after them."""
    mps = mps_control.install(tmp_path / "bin")
    record = tmp_path / "mps.txt"
    env = {
        "TTG_DAEMON__SHUTDOWN_GRACE_S": "0",
        "TTG_DAEMON__ENGINES": "2",
        "TTG_DAEMON__MEDIA_WORKERS": "3",
        "PATH": f"{mps.parent}{os.pathsep}{os.environ['PATH']}",
        "MPS_STANDIN_RECORD": str(record),
    }
    gw = Serve(tmp_path / "serve", bundle=tiny_bundle, redis_url=redis_url, mode="media_workers", env=env)
    try:
        await asyncio.to_thread(gw.start)
        children = _children(gw.pid)
        engines = [pid for pid, cmd in children.items() if "asr_core.host" in cmd]
        assert len(engines) == 2, gw.log_tail()
        _, daemon_pid, pipe, _ = record.read_text().splitlines()[0].split()
        assert int(daemon_pid) in children
        for pid, cmd in children.items():
            wanted = "asr_core.host" in cmd or pid == int(daemon_pid)  # not the media workers
            assert (f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in _environ(pid)) == wanted, cmd
        assert gw.metric("ttg_cuda_mps") == 1
        callers = _callers(gw, short_speech, tmp_path / "callers", 4)
        await until(_talking(redis_url, 4), "4 calls transcribing", timeout_s=60, detail=gw.log_tail)

        def per_engine() -> list[float]:
            return [gw.metric("ttg_engine_streams", engine=k) for k in ("0", "1")]

        await until(
            lambda: per_engine() == [2.0, 2.0], "two streams on each engine", detail=lambda: str(per_engine())
        )
        _, page = gw.http("/metrics")  # each engine's own lag, its parts, load and busy share
        for name in (
            "ttg_engine_process_lag_seconds",
            "ttg_engine_process_load",
            "ttg_engine_process_busy",
            "ttg_engine_process_receive_lag_seconds",
            "ttg_engine_process_arrival_lag_seconds",
            "ttg_engine_process_queue_wait_seconds",
        ):
            assert all(f'{name}{{engine="{k}"}}' in page for k in ("0", "1")), name

        def timing_missing() -> list[str]:  # each media worker's loop lag and flush delay, from its reports
            _, page = gw.http("/metrics")
            names = ("ttg_media_worker_loop_lag_seconds", "ttg_media_worker_flush_delay_seconds")
            series = [f'{name}{{worker="{k}"}}' for name in names for k in ("0", "1", "2")]
            return [s for s in series if s not in page]

        await until(
            lambda: not timing_missing(), "each media worker's timing", detail=lambda: str(timing_missing())
        )
        await until(  # and each engine's thread reports its time stepping these calls
            lambda: all(gw.metric("ttg_engine_process_busy", engine=k) > 0.0 for k in ("0", "1")),
            "both engines busy stepping",
            timeout_s=20,
        )
        gw.signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.wait, 60) == 0, gw.log_tail()
        await callers
    finally:
        gw.stop(timeout_s=20.0)
    calls = _audited(redis_url)
    assert len(calls) == 4
    for events in calls.values():
        assert any(f["type"] == "final" and f["text"] for f in events), events
        assert events[-1]["reason"] == "shutdown", events[-1]
    # Each engine process reports its own steps when it stops: both encoded calls.
    stepped = [line for line in gw.log().splitlines() if "asr_core.engine: encoder: " in line]
    assert len(stepped) >= 2, stepped
    assert record.read_text().splitlines()[1:] == ["client quit", "daemon exits"]
    assert f"CUDA MPS: control daemon {daemon_pid} stopped, status 0" in gw.log()
    assert not Path(pipe).exists()


async def test_one_of_two_engines_that_dies_is_replaced_while_the_other_engines_calls_go_on(
    tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    """TTG_DAEMON__ENGINES=2 with two media workers: worker i feeds engine i. Killing engine 0 ends the
    calls of worker 0 as errors (BYE, call_end, the text decoded so far kept); worker 1's calls keep
    transcribing; engine 0 comes back with a fresh worker 0, and a call placed then is transcribed."""
    env = {"TTG_DAEMON__SHUTDOWN_GRACE_S": "0", "TTG_DAEMON__ENGINES": "2"}
    gw = Serve(tmp_path / "serve", bundle=tiny_bundle, redis_url=redis_url, mode="media_workers", env=env)
    try:
        await asyncio.to_thread(gw.start)
        engines = {pid: cmd for pid, cmd in _children(gw.pid).items() if "asr_core.host" in cmd}
        assert len(engines) == 2, gw.log_tail()
        victim = next(pid for pid, cmd in engines.items() if "--role engine_0" in cmd)
        callers = _callers(gw, short_speech, tmp_path / "callers", 4)
        await until(_talking(redis_url, 4), "4 calls transcribing", timeout_s=60, detail=gw.log_tail)
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            return "ASR engine 0 replaced by process" in gw.log()

        await until(replaced, "engine 0 replaced", timeout_s=60, detail=gw.log_tail)
        ended = [f for _, f in read_stream(redis_url, STREAM) if f["type"] == "call_end"]
        assert [(f["reason"], f["asr"]) for f in ended] == [("error", "error")] * 2, ended
        assert gw.running
        status, body = gw.readyz()
        assert status == 200, body
        assert gw.metric("ttg_engine_failures_total") == 1
        assert gw.metric("ttg_engines_up") == 2
        assert gw.metric("ttg_media_worker_deaths_total") == 0  # worker 0 was replaced, not lost
        after = {pid: cmd for pid, cmd in _children(gw.pid).items() if "asr_core.host" in cmd}
        assert len(after) == 2 and victim not in after, after

        # Worker 1's two calls are still talking; a new call goes to the fresh worker 0 (it holds no
        # legs) and its engine transcribes it.
        await _one_more_call_then_sigterm(gw, short_speech, tmp_path / "newcomer", callers)
    finally:
        gw.stop(timeout_s=20.0)
    calls = _audited(redis_url)
    assert len(calls) == 5
    ends = sorted((events[-1]["reason"], events[-1]["asr"]) for events in calls.values())
    assert ends.count(("error", "error")) == 2, ends
    assert all(reason in ("shutdown", "bye") for reason, _ in ends if reason != "error"), ends
    for events in calls.values():
        # Every call has a final with text; the two that lost their engine keep what it had decoded
        # (a segment it left open closes with its newest partial, marked unconfirmed).
        assert any(f["type"] == "final" and f["text"] for f in events), events
