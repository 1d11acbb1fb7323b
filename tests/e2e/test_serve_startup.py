"""`ttg serve` refuses what it cannot run with one line on stderr and a non-zero exit, before it binds
anything (a bad bundle, bad settings), and its startup checks say what an operator needs."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asr_core.accelerator import Accelerator
from gateway.config import Settings
from gateway.daemon import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    CallLogPublisher,
    DaemonReadiness,
    StartupError,
    check_settings,
    engine_config,
    redact_url,
    rtp_port_pairs,
    settings_from_args,
)
from gateway.events import CallEvent
from gateway.logs import OneLineFormatter
from tests.e2e.conftest import PROCESS_MODES, REPO, Serve
from tests.fixtures.telephony import MemoryPublisher
from tools.ports import free_port

CPU = Accelerator("cpu")


def run_serve(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, mode: str = "one_process"
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "gateway", "serve",
        "--sip-host", "127.0.0.1", "--sip-port", str(free_port()), "--rtp-host", "127.0.0.1",
        "--http-port", str(free_port()), "--spool-dir", str(tmp_path / "spool"),
        "--redis-url", "redis://127.0.0.1:1/0", *args,
    ]  # fmt: skip
    base = Serve(tmp_path, bundle="", redis_url="", mode=mode).env
    return subprocess.run(
        cmd, cwd=REPO, env=base | (env or {}), capture_output=True, text=True, timeout=120, check=False
    )


# --- a bad bundle -----------------------------------------------------------------------------------


def damaged(bundle: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of the bundle with one file damaged; returns it and the file the error must name."""
    out = tmp_path / f"bundle-{how}"
    shutil.copytree(bundle, out)
    if how == "truncated_encoder":
        target = out / "encoder.safetensors"
        target.write_bytes(target.read_bytes()[:5000])
    elif how == "missing_joiner":
        target = out / "joiner.onnx"
        target.unlink()
    elif how == "bad_config":
        target = out / "nemotron_onnx_config.json"
        target.write_text("{ not json")
    else:  # pragma: no cover
        raise ValueError(how)
    return out, str(target)


@pytest.mark.parametrize("mode", PROCESS_MODES)
@pytest.mark.parametrize("how", ["truncated_encoder", "missing_joiner", "bad_config"])
def test_a_bad_bundle_exits_nonzero_with_one_line_naming_the_file(
    tiny_bundle: Path, tmp_path: Path, how: str, mode: str
) -> None:
    bundle, file = damaged(tiny_bundle, tmp_path, how)
    proc = run_serve(tmp_path, "--model", str(bundle), mode=mode)
    assert proc.returncode == EXIT_CONFIG
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr  # one line, and nothing was bound or started before it
    assert lines[0].startswith("ttg serve: cannot load the model bundle: ") and file in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("mode", PROCESS_MODES)
def test_a_missing_bundle_directory_is_named(tmp_path: Path, mode: str) -> None:
    proc = run_serve(tmp_path, "--model", str(tmp_path / "nowhere"), mode=mode)
    assert proc.returncode == EXIT_CONFIG
    assert proc.stderr.splitlines() == [
        f"ttg serve: cannot load the model bundle: {tmp_path / 'nowhere'}: not a directory"
    ]


def test_a_device_that_cannot_be_probed_stops_the_daemon_with_the_reason(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """With media workers the first process never loads MLX: a child interpreter tells it which device
    the engines get (what the auto settings follow). An MLX that does not load there stops `ttg serve`
    with one line and status 1 before any engine starts."""
    broken = tmp_path / "site" / "mlx"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("this MLX is broken")\n')
    env = {"PYTHONPATH": os.pathsep.join([str(broken.parent), str(REPO)])}
    proc = run_serve(tmp_path, "--model", str(tiny_bundle), env=env, mode="media_workers")
    assert proc.returncode == EXIT_FAILURE
    assert proc.stderr.splitlines() == [
        "ttg serve: the accelerator probe failed: ImportError: this MLX is broken"
    ]


def test_bad_settings_exit_with_one_line_naming_the_variable(tmp_path: Path) -> None:
    proc = run_serve(tmp_path, env={"TTG_SIP__MAX_CALLS": "many"})
    assert proc.returncode == EXIT_CONFIG
    (line,) = proc.stderr.splitlines()
    assert line.startswith("ttg serve: bad setting TTG_SIP__MAX_CALLS: ") and "'many'" in line

    proc = run_serve(tmp_path, "--rtp-ports", "20000-20019", "--max-calls", "50")
    assert proc.returncode == EXIT_CONFIG
    (line,) = proc.stderr.splitlines()
    assert "hold 10 RTP/RTCP pairs" in line and "TTG_SIP__MAX_CALLS=50" in line


# --- startup checks (pure) ---------------------------------------------------------------------------


def loopback(**sections: dict[str, object]) -> Settings:
    base: dict[str, Any] = {"sip": {"host": "127.0.0.1"}, "rtp": {"host": "127.0.0.1"}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return Settings(**base)


def test_rtp_pairs_count_even_rtp_ports_with_their_rtcp_neighbour() -> None:
    assert rtp_port_pairs(20000, 30000) == 5000
    assert rtp_port_pairs(20001, 20004) == 1  # 20002/20003; 20004 has no RTCP port in range
    assert rtp_port_pairs(20000, 20001) == 1


def test_the_rtp_range_must_cover_max_calls_which_counts_streams() -> None:
    assert check_settings(loopback(sip={"max_calls": 10}, rtp={"port_min": 20000, "port_max": 20029})) == []
    # Exactly enough: fine until released pairs rest in quarantine while new calls come in.
    (f,) = check_settings(loopback(sip={"max_calls": 10}, rtp={"port_min": 20000, "port_max": 20019}))
    assert f.level == logging.WARNING and "rest 2 s" in f.message
    (f,) = check_settings(loopback(sip={"max_calls": 10}, rtp={"port_min": 20000, "port_max": 20017}))
    assert f.level == logging.ERROR and "hold 9 RTP/RTCP pairs" in f.message
    # MAX_CALLS counts streams (a two-leg SIPREC call takes two), so MAX_STREAMS needs no more ports.
    assert (
        check_settings(
            loopback(sip={"max_calls": 10}, rtp={"port_min": 20000, "port_max": 20029, "max_streams": 3})
        )
        == []
    )


def test_binding_the_wildcard_without_an_advertised_address_warns_about_one_way_audio() -> None:
    (f,) = check_settings(Settings(sip={"host": "0.0.0.0"}))
    assert f.level == logging.WARNING and "TTG_SIP__ADVERTISED_HOST" in f.message
    assert check_settings(Settings(sip={"host": "0.0.0.0", "advertised_host": "203.0.113.7"})) == []
    (f,) = check_settings(loopback(sip={"advertised_host": "0.0.0.0"}))
    assert f.level == logging.ERROR and "wildcard" in f.message


def test_metrics_bound_beyond_loopback_and_half_configured_auth_are_reported() -> None:
    (f,) = check_settings(loopback(http={"host": "0.0.0.0"}))
    assert f.level == logging.WARNING and "not loopback" in f.message
    (f,) = check_settings(loopback(sip={"digest_user": "pbx"}))
    assert f.level == logging.ERROR and "DIGEST_PASSWORD" in f.message
    (f,) = check_settings(loopback(log={"level": "chatty"}))
    assert f.level == logging.ERROR


def test_engine_config_comes_from_the_deployment_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from asr_core.config import EngineConfig

    defaults = engine_config(Settings(), on=CPU)
    # The pools are sized for the call limit, or an engine process's share of it.
    assert defaults.streams == Settings().sip.max_calls == 200
    assert engine_config(Settings(), 3 / 12, on=CPU).streams == 50
    # On a CPU the settings' defaults are the engine's own defaults (two places, one set of numbers).
    assert (defaults.scheduler, defaults.decoder, defaults.endpoint, defaults.vad) == (
        EngineConfig().scheduler,
        EngineConfig().decoder,
        EngineConfig().endpoint,
        EngineConfig().vad,
    )
    monkeypatch.setenv("TTG_DECODER__MODE", "workers")
    monkeypatch.setenv("NEMO_WORKERS", "5")
    monkeypatch.setenv("NEMO_BATCH_MAX", "128")
    monkeypatch.setenv("TTG_ENCODER__MAX_QUEUED_CHUNKS", "8")
    monkeypatch.setenv("TTG_DECODER__MAX_UNDECODED_CHUNKS", "3")
    monkeypatch.setenv("TTG_DECODER__DEVICE_THREAD", "true")
    monkeypatch.setenv("TTG_ASR__ENDPOINT_BLANK_MS", "600")
    monkeypatch.setenv("TTG_ASR__ENDPOINT_MAX_BLANK_MS", "1500")
    monkeypatch.setenv("TTG_ASR__PARTIALS", "false")
    monkeypatch.setenv("TTG_ASR__LANGUAGE", "uk-UA")
    monkeypatch.setenv("TTG_ASR__LOOKAHEAD", "6")
    monkeypatch.setenv("TTG_ASR__VAD", "energy")
    monkeypatch.setenv("TTG_ASR__VAD_HANGOVER_MS", "200")
    monkeypatch.setenv("TTG_ASR__VAD_MIN_SPEECH_MS", "80")
    monkeypatch.setenv("TTG_ASR__VAD_WEBRTC_MODE", "1")
    monkeypatch.setenv("TTG_ASR__ENDPOINT_ENERGY_DB", "-50")
    monkeypatch.setenv("TTG_ASR__WORDS", "all")
    monkeypatch.setenv("TTG_ENCODER__CPU_THREADS", "3")
    assert defaults.cpu_threads == 1  # a deployment runs the CPU encoder's matmuls on one thread
    cfg = engine_config(Settings(), on=CPU)
    assert cfg.cpu_threads == 3
    assert (cfg.decoder.mode, cfg.decoder.workers) == ("workers", 5)
    assert (cfg.scheduler.max_batch, cfg.scheduler.max_queued_chunks) == (128, 8)
    assert cfg.scheduler.max_undecoded_chunks == 3
    assert cfg.decoder.device_thread is True
    assert (cfg.endpoint.blank_ms, cfg.endpoint.max_blank_ms, cfg.endpoint.partials) == (600, 1500, False)
    assert (cfg.default_language, cfg.default_lookahead) == ("uk-UA", 6)
    assert (cfg.vad.kind, cfg.vad.hangover_ms, cfg.vad.min_speech_ms, cfg.vad.webrtc_mode) == (
        "energy",
        200,
        80,
        1,
    )
    # The VAD's energy gate is the assembler's quiet-audio threshold...
    assert (cfg.endpoint.energy_db, cfg.vad.energy_db) == (-50.0, -50.0)
    assert cfg.endpoint.words == "all"
    # ...unless that is 0 dBFS (judge by tokens only): then the gate keeps the VAD's default.
    monkeypatch.setenv("TTG_ASR__ENDPOINT_ENERGY_DB", "0")
    cfg = engine_config(Settings(), on=CPU)
    assert (cfg.endpoint.energy_db, cfg.vad.energy_db) == (0.0, EngineConfig().vad.energy_db)


def test_on_a_cuda_card_the_auto_settings_decode_on_the_device_in_large_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h200 = Accelerator("cuda", 134 << 30)
    cfg = engine_config(Settings(), 1 / 4, on=h200)
    assert (cfg.decoder.mode, cfg.scheduler.max_batch) == ("device", 512)
    # What is set stays as set, whatever the device.
    monkeypatch.setenv("TTG_DECODER__MODE", "batched")
    monkeypatch.setenv("TTG_ENCODER__MAX_BATCH", "128")
    cfg = engine_config(Settings(), 1 / 4, on=h200)
    assert (cfg.decoder.mode, cfg.scheduler.max_batch) == ("batched", 128)


def test_flags_override_the_environment_which_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from gateway.daemon import add_arguments

    monkeypatch.setenv("TTG_SIP__MAX_CALLS", "7")
    monkeypatch.setenv("TTG_SIP__PORT", "5080")
    monkeypatch.setenv("NEMO_WORKERS", "3")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = settings_from_args(parser.parse_args(["--sip-port", "5070", "--rtp-ports", "30000-30999"]))
    assert (s.sip.port, s.sip.max_calls, s.decoder.workers) == (5070, 7, 3)
    assert (s.rtp.port_min, s.rtp.port_max) == (30000, 30999)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rtp-ports", "30000"])
    monkeypatch.setenv("TTG_SIP__PORT", "sixty")
    with pytest.raises(StartupError, match="TTG_SIP__PORT"):
        settings_from_args(parser.parse_args([]))


def test_a_redis_password_never_reaches_the_log() -> None:
    assert redact_url("redis://:s3cret@cache:6380/2") == "redis://:***@cache:6380/2"
    assert redact_url("rediss://app:s3cret@cache/0") == "rediss://app:***@cache/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_readiness_reports_an_engine_failure_first() -> None:
    r = DaemonReadiness(model_loaded=True)
    assert r.ready
    r.engine_failed = True
    r.draining = True
    assert r.reasons() == ["ASR engine failed", "draining"] and not r.ready


def test_one_line_per_call_start_and_end_with_its_counters(caplog: pytest.LogCaptureFixture) -> None:
    inner = MemoryPublisher()
    pub = CallLogPublisher(inner)
    start = CallEvent(
        "call_start", "c1", "sip-1", lang="en-US",
        extra={"ani": "+15550100", "dnis": "1000", "source": "10.0.0.9:5060", "transport": "udp",
               "codec": "PCMU", "language_source": "header"},
    )  # fmt: skip
    events = [
        start,
        CallEvent("partial", "c1", "sip-1", segment_id=0, text="hel"),
        CallEvent("final", "c1", "sip-1", segment_id=0, text="hello"),
        CallEvent("final", "c1", "sip-1", segment_id=1, text="bye"),
        CallEvent(
            "call_end", "c1", "sip-1",
            extra={"reason": "bye", "duration_ms": "5230", "audio_ms": "5200", "asr": "finished",
                   "rtp_packets": "260", "rtp_lost": "2", "rtp_jitter_ms": "0.80"},
        ),
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="gateway.daemon"):
        for ev in events:
            pub.publish(ev)
    assert inner.events == events  # every event goes on unchanged
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.daemon"]
    assert len(lines) == 2
    assert lines[0].startswith("call c1 started: from +15550100 to 1000 via 10.0.0.9:5060/udp")
    assert "lang en-US (header), codec PCMU" in lines[0]
    assert lines[1].startswith("call c1 ended: bye after 5.2 s, audio 5200 ms, 2 finals, 1 partials")
    assert "rtp 260 packets, lost 2" in lines[1] and "jitter 0.80 ms" in lines[1]


def test_log_records_are_one_line_even_with_a_traceback() -> None:
    fmt = OneLineFormatter("%(levelname)s %(name)s: %(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed\nbadly", None, sys.exc_info())
    text = fmt.format(record)
    assert (
        "\n" not in text
        and text.startswith("ERROR x: failed | badly | Traceback")
        and "ValueError: boom" in text
    )


@pytest.mark.parametrize("mode", PROCESS_MODES)
def test_a_sip_port_in_use_is_a_clear_error_after_the_model_loads(
    tiny_bundle: Path, tmp_path: Path, mode: str
) -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        proc = run_serve(tmp_path, "--model", str(tiny_bundle), "--sip-port", str(port), mode=mode)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot listen for SIP on 127.0.0.1:{port}" in errors[0], proc.stderr
    assert "stopped in" in proc.stderr.splitlines()[-1]  # what had started was stopped again


def test_ttg_model_dir_may_name_an_mlx_layout(tiny_bundle: Path, tmp_path: Path) -> None:
    """TTG_MODEL__DIR at a quantized mlx-audio-layout bundle: the daemon loads it (and then stops at
    the SIP port that is taken, so the test needs no call)."""
    import socket

    from tools.bundle.mlx_export import export_mlx

    export_mlx(tiny_bundle, tmp_path / "q8", "q8")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        proc = run_serve(tmp_path, "--sip-port", str(port), env={"TTG_MODEL__DIR": str(tmp_path / "q8")})
    assert proc.returncode == 1 and f"cannot listen for SIP on 127.0.0.1:{port}" in proc.stderr
    assert "mlx-audio layout" in proc.stderr and "24 quantized modules" in proc.stderr, proc.stderr


def test_mel_filter_and_encoder_overrides_replace_the_bundles_files(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    from gateway.daemon import ModelChoice, load_model

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (bundle / "melfilters.f32").rename(elsewhere / "mel.f32")
    (bundle / "encoder.safetensors").rename(elsewhere / "enc.safetensors")
    choice = ModelChoice(bundle, "b")
    with pytest.raises(StartupError, match=r"(melfilters\.f32|encoder\.safetensors): missing file"):
        load_model(Settings(), choice)
    # NEMO_MEL_FILTERS / NEMO_MLX_WEIGHTS (TTG_MODEL__MEL_FILTERS / TTG_MODEL__ENCODER_WEIGHTS)
    overrides = {
        "mel_filters": str(elsewhere / "mel.f32"),
        "encoder_weights": str(elsewhere / "enc.safetensors"),
    }
    model = load_model(Settings(model=overrides), choice)
    assert model.lookaheads
    with pytest.raises(StartupError, match=r"TTG_MODEL__MEL_FILTERS=.*: no such file"):
        load_model(Settings(model={**overrides, "mel_filters": str(tmp_path / "none.f32")}), choice)
    (elsewhere / "enc.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}")
    with pytest.raises(StartupError) as e:
        load_model(Settings(model=overrides), choice)
    assert str(elsewhere / "enc.safetensors") in str(e.value)  # the real file, not the temporary view
