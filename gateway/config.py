"""Deployment settings: environment variables `TTG_<SECTION>__<FIELD>` (pydantic-settings).

Read only at the edge (the daemon and the CLI); cores get plain dataclasses built from these.
The seed Rust server's NEMO_* variables are accepted as aliases (a TTG_* variable wins).
`ops/env.example` lists every variable; tests/test_env_example.py keeps it true.
Each section belongs to the package that uses it; add fields with a one-line description.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class ModelSettings(BaseModel):
    dir: str = Field("", description="Model bundle directory; empty = the embedded demo model")
    precision: Literal["auto", "f32", "f16", "bf16"] = Field(
        "auto", description="Encoder precision; auto = f32 on CPU, f16 on a GPU"
    )
    mel_filters: str = Field("", description="Override path of melfilters.f32 (default: in the bundle)")
    encoder_weights: str = Field(
        "", description="Override path of encoder.safetensors (default: in the bundle)"
    )
    encoder: Literal["mlx"] = Field("mlx", description="Encoder backend (only MLX)")


class AsrSettings(BaseModel):
    language: str = Field("en-US", description="Default call language (a prompt-table locale or 'auto')")
    lookahead: int | None = Field(
        None, description="Encoder lookahead in 80 ms frames; empty = bundle default"
    )
    endpoint_blank_ms: int = Field(
        800,
        gt=0,
        description="Fallback to the VAD: no new token for this long (in quiet audio) ends an utterance",
    )
    endpoint_energy_db: float = Field(
        -45.0, le=0, description="Audio below this (dBFS) is quiet for endpointing; 0 = judge by tokens only"
    )
    endpoint_max_blank_ms: int = Field(
        2000, gt=0, description="No new token for this long ends an utterance whatever the audio level"
    )
    max_segment_ms: int = Field(
        30000, gt=0, description="Longest utterance; cut before the next word past it"
    )
    vad: Literal["webrtc", "energy", "off"] = Field(
        "webrtc",
        description="Voice activity per call: a pause ends the utterance at once (webrtc: WebRTC VAD "
        "gated by ENDPOINT_ENERGY_DB; energy: that threshold alone; off: token silence only)",
    )
    vad_hangover_ms: int = Field(
        150, ge=10, description="Non-speech after speech that ends an utterance (VAD); adds to time to final"
    )
    vad_min_speech_ms: int = Field(
        60, ge=10, description="Shortest run of speech frames that counts as speech (clicks do not)"
    )
    vad_webrtc_mode: int = Field(3, ge=0, le=3, description="WebRTC VAD aggressiveness 0-3")
    words: Literal["off", "final", "all"] = Field(
        "final",
        description="Which transcripts carry `words` (times, confidence): final, all (partials too), off",
    )
    partials: bool = Field(True, description="Publish partial transcripts (the open utterance's text so far)")
    partial_interval_ms: int = Field(
        300, ge=0, description="At most one partial per this much audio of a call"
    )


class EncoderSettings(BaseModel):
    max_batch: int = Field(
        0, ge=0, description="Most chunks (calls) in one encoder step; 0 = auto: 512 on a CUDA GPU, else 64"
    )
    max_wait_ms: float = Field(100.0, ge=0, description="Longest a ready chunk waits for a fuller batch")
    wait_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="adaptive: 3x the measured fixed cost of a step, at most max_wait_ms; fixed: max_wait_ms",
    )
    max_queued_chunks: int = Field(
        16, ge=2, description="Chunks a call may queue for the encoder; beyond it the oldest is dropped"
    )
    cpu_threads: int = Field(
        1,
        ge=1,
        description="Threads of the encoder's matmuls on a CPU (OpenBLAS); more shorten one step but spin "
        "on the cores the calls need",
    )


class DecoderSettings(BaseModel):
    workers: int = Field(2, ge=1, description="RNN-T decoder worker threads (one ORT session each)")
    mode: Literal["auto", "workers", "batched", "device"] = Field(
        "auto",
        description="batched: a worker decodes its due calls in one pass; workers: one by one; "
        "device: on the accelerator, after each encoder step; auto: device on a CUDA GPU, else batched",
    )
    max_undecoded_chunks: int = Field(
        2, ge=1, description="Chunks of a call encoded but not yet decoded before its encoding waits"
    )
    device_thread: bool = Field(
        False,
        description="device mode: decode on a thread of its own beside the next encoder step (true), or on "
        "the encoder's thread after each step (false)",
    )


def _sip_list(*items: Any) -> list[Any]:
    """A fresh list default for the Literal-typed list fields of SipSettings."""
    return list(items)


class SipSettings(BaseModel):
    host: str = Field("0.0.0.0", description="SIP bind address (UDP and TCP)")
    port: int = Field(5060, ge=1, le=65535, description="SIP port")
    advertised_host: str = Field("", description="Address put in Contact/SDP; empty = the bind address")
    max_calls: int = Field(
        200,
        ge=0,
        description="Concurrent audio streams admitted (a call counts one per leg: a two-party SIPREC "
        "session two); beyond it INVITEs get 503 + Retry-After",
    )
    allow_cidrs: list[str] = Field(
        default_factory=lambda: ["0.0.0.0/0", "::/0"],
        description="Source networks allowed to call (else 403)",
    )
    transports: list[Literal["udp", "tcp"]] = Field(
        default_factory=lambda: _sip_list("udp", "tcp"), description="SIP transports to listen on (same port)"
    )
    user_agent: str = Field("ttg", description="Server/User-Agent header value")
    siprec: bool = Field(
        True,
        description="Take SIPREC recording sessions (RFC 7866): one leg per recorded stream; "
        "off: Require: siprec gets 420",
    )
    digest_user: str = Field("", description="Digest auth user for INVITEs (RFC 7616); empty = no auth")
    digest_password: str = Field("", description="Digest auth password")
    digest_realm: str = Field("ttg", description="Digest auth realm")
    digest_algorithms: list[Literal["SHA-256", "MD5"]] = Field(
        default_factory=lambda: _sip_list("MD5", "SHA-256"),
        description='Digest challenges in order; MD5 first for MD5-only clients, ["MD5"] for baresip 1.0',
    )
    auth_max_failures: int = Field(
        5, ge=0, description="Failed digest authentications from one source that ban it (0 = never ban)"
    )
    auth_failure_window_s: float = Field(
        60.0, gt=0, description="The failures that ban a source must fall within this many seconds"
    )
    auth_ban_s: float = Field(
        600.0, ge=0, description="How long a banned source's requests outside calls are dropped"
    )
    invite_rate: float = Field(
        0.0, ge=0, description="New INVITEs per second per source IP (token bucket); 0 = no limit"
    )
    invite_burst: int = Field(
        20, ge=1, description="INVITEs a source may send at once before the rate applies"
    )
    retry_after_s: int = Field(5, ge=0, description="Retry-After of 503 answers (capacity, rate, draining)")
    max_engine_lag_ms: int = Field(
        3000, ge=0, description="ASR engine lag (for 2 s) past which new calls get 503 + Retry-After; 0 = off"
    )
    call_limit_lag_ms: int = Field(
        1000,
        ge=0,
        description="Engine lag the adaptive call limit steers by: the streams admitted may grow while the "
        "lag stays under half of it (the more slowly the nearer), hold up to it and are cut back past it, "
        "so a ramp of calls is admitted at the pace the engine absorbs it (503 + Retry-After beyond); "
        "0 = off (max_calls alone)",
    )
    call_limit_load: float = Field(
        0.8,
        ge=0,
        description="ASR encoder utilisation (rows coming in x each row's measured step cost) at which the "
        "adaptive call limit stops growing: it rises with the streams as they come, before the lag does; "
        "under half of it, at first, the limit about doubles a second (slow start); 0 = the lag alone",
    )
    call_limit_start: int = Field(
        32, ge=1, description="Streams the adaptive call limit starts from, and never goes below"
    )
    language_header: str = Field("X-Language", description="INVITE header naming the call's language")
    dnis_languages: dict[str, str] = Field(
        default_factory=dict,
        description='Dialed number -> language, JSON, e.g. {"+4930*": "de-DE"} (* = prefix)',
    )
    metadata_headers: list[str] = Field(
        default_factory=lambda: ["X-*"], description="INVITE headers copied into call_start (globs)"
    )
    answer_delay_ms: int = Field(
        0, ge=0, description="Ring (180) this long before answering; 0 = answer at once"
    )
    t1_ms: int = Field(500, ge=10, description="SIP timer T1 (RTT estimate; retransmission base)")
    max_tcp_connections: int = Field(1024, ge=1, description="Concurrent SIP TCP connections")
    tcp_max_per_source: int = Field(32, ge=1, description="Concurrent SIP TCP connections from one source IP")
    tcp_idle_timeout_s: float = Field(
        300.0, gt=0, description="A SIP TCP connection with nothing received for this long is closed"
    )
    tcp_header_timeout_s: float = Field(
        10.0, gt=0, description="A SIP message begun on TCP must be complete within this (slow senders)"
    )
    udp_recv_buffer_bytes: int = Field(
        4 << 20, ge=0, description="SIP UDP socket receive buffer (bursts; 0 = the OS default)"
    )
    asr_finish_timeout_s: float = Field(
        10.0, gt=0, description="After hang-up, longest wait for the call's final transcript"
    )


class RtpSettings(BaseModel):
    host: str = Field("0.0.0.0", description="RTP bind address")
    port_min: int = Field(20000, ge=1024, le=65534, description="Lowest RTP port (even)")
    port_max: int = Field(30000, ge=1025, le=65535, description="Highest RTP port")
    advertised_host: str = Field(
        "", description="Address in our SDP c=/o=; empty = TTG_SIP__ADVERTISED_HOST, else the RTP bind host"
    )
    codecs: list[Literal["PCMU", "PCMA"]] = Field(
        default_factory=lambda: ["PCMU", "PCMA"],  # type: ignore[arg-type]  # (mypy infers list[str])
        description="Accepted audio codecs (the offer's order wins)",
    )
    max_streams: int = Field(
        2,
        ge=1,
        le=32,
        description="Most audio m= lines of one offer taken as legs: SIPREC (one per recorded stream), "
        "or a plain call with MULTI_LEG_CALLS; the rest are answered with port 0",
    )
    multi_leg_calls: bool = Field(
        False,
        description="A plain INVITE with several m=audio becomes one leg per stream (up to MAX_STREAMS); "
        "off: only the first is taken",
    )
    ptime_ms: int = Field(
        20, ge=10, le=60, description="a=ptime of answers when the offer has none in 10-60 ms"
    )
    playout_delay_ms: int = Field(
        60, ge=0, le=2000, description="How long a sequence gap waits for a reordered packet (then concealed)"
    )
    block_ms: int = Field(80, ge=10, le=1000, description="Size of the 16 kHz audio blocks handed to ASR")
    intake_tick_ms: float = Field(
        0.0, ge=0, le=20,
        description="Read the RTP sockets in batches every this many ms (a selector of their own; arrival "
        "times from the kernel) instead of each on the event loop (0): fewer wake-ups at hundreds of calls "
        "a process, a datagram handled up to this much later",
    )  # fmt: skip
    max_gap_ms: int = Field(
        5000, ge=0, description="Most silence inserted for one RTP timestamp jump (DTX, hold, bad sender)"
    )
    idle_fill_after_ms: int = Field(
        500, ge=0, description="No packets for this long: feed ASR silence in real time (0 = never)"
    )
    inactivity_timeout_s: float = Field(
        30.0, ge=0, description="No RTP/RTCP for this long ends the call (0 = never)"
    )
    hold_timeout_s: float = Field(
        300.0, ge=0, description="The same while the call is on hold (sendonly/inactive/0.0.0.0; 0 = never)"
    )
    relatch_after_ms: int = Field(
        2000,
        ge=0,
        description="Latched RTP source silent this long: follow its stream (same SSRC) to a new address",
    )
    rtcp_reports: bool = Field(
        True,
        description="Send RTCP receiver reports (RFC 3550) to each leg's peer, which some end calls without "
        "(linphone after 30 s with neither RTP nor RTCP; this gateway sends no RTP); only to the latched "
        "host, never to an address only the SDP names",
    )
    port_quarantine_s: float = Field(
        2.0, ge=0, description="A released RTP port pair rests this long before reuse"
    )
    resample_quality: Literal["LQ", "MQ", "HQ", "VHQ"] = Field(
        "HQ", description="soxr quality of the 8 -> 16 kHz upsampler"
    )


class RedisSettings(BaseModel):
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL")
    stream: str = Field("ttg:transcripts", description="The global transcript stream (the contract)")
    maxlen: int = Field(
        1_000_000, ge=1, description="Approximate cap on the global stream's length (XADD MAXLEN ~)"
    )
    calls_stream: str = Field(
        "ttg:calls", description="Calls index stream (call_start/call_end only); empty = none"
    )
    calls_maxlen: int = Field(100_000, ge=1, description="Approximate cap on the calls index stream's length")
    per_call_streams: bool = Field(
        False, description="Also write each call+leg to <stream>:call:<call_id>:<leg> (explicit IDs <seq>-0)"
    )
    per_call_ttl_s: int = Field(
        3600, ge=1, description="A per-call stream expires this long after its last event"
    )
    dedupe_ttl_s: int = Field(
        86_400, ge=60, description="How long Redis remembers a call+leg's last seq (refuses duplicates)"
    )
    socket_timeout_s: float = Field(2.0, gt=0, description="Redis command timeout")
    connect_timeout_s: float = Field(1.0, gt=0, description="Redis connect timeout")
    retries: int = Field(
        2, ge=0, description="Client retries of one command (exponential backoff) before Redis counts as down"
    )
    health_check_interval_s: int = Field(
        5, ge=0, description="PING an idle Redis connection this often (seconds)"
    )


class SinkSettings(BaseModel):
    spool_dir: str = Field("var/spool", description="Where durable events wait while Redis is down")
    spool_max_bytes: int = Field(
        1 << 30, ge=4096, description="Largest spool file; beyond it events are dropped (counted)"
    )
    spool_fsync_interval_s: float = Field(
        0.2, ge=0, description="fdatasync the spool at most this often while writing (0 = after every write)"
    )
    max_buffered: int = Field(
        20_000,
        ge=1,
        description="Events held in memory for Redis before partials are dropped and the rest spooled",
    )
    spill_after_s: float = Field(
        2.0, ge=0, description="Redis down this long: durable events move to the spool"
    )
    batch_max: int = Field(500, ge=1, description="Events per Redis round trip")
    backoff_cap_s: float = Field(5.0, gt=0, description="Longest wait between reconnection attempts")
    flush_timeout_s: float = Field(5.0, ge=0, description="On shutdown, time allowed to send what is left")


class HttpSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Bind address of /metrics, /healthz, /readyz")
    port: int = Field(9108, ge=0, le=65535, description="HTTP port")


class DaemonSettings(BaseModel):
    """`ttg serve` (gateway/daemon.py). A supervisor's stop timeout (systemd TimeoutStopSec, launchd
    ExitTimeOut: 30 s in ops/) must exceed shutdown_grace_s + hangup_timeout_s + TTG_SINK__FLUSH_TIMEOUT_S."""

    shutdown_grace_s: float = Field(
        10.0, ge=0, description="On SIGTERM/SIGINT, how long live calls may go on before the gateway hangs up"
    )
    hangup_timeout_s: float = Field(
        12.0,
        ge=0,
        description="After hanging up at shutdown, longest wait for the calls' finals and call_end events",
    )
    uvloop: bool = Field(True, description="Run the event loop on uvloop when it is installed")
    media_workers: int = Field(
        -1,
        ge=-1,
        description="Media worker processes (RTP + ASR front end; the engine then runs in a process of its "
        "own); 0 = all in one process; -1 = auto",
    )
    engines: int = Field(
        0,
        ge=0,
        description="ASR engine processes, with media workers (at most one per worker): each batches an "
        "equal share of the calls on the same accelerator; more than one where one process's "
        "kernel launches are the limit (a GPU: docs/benchmarks.md); 0 = auto: on a CUDA GPU 4 "
        "(one per 16 GiB of a smaller card), else 1",
    )
    engine_switch_interval_ms: float = Field(
        5.0,  # Python's own; shorter ones did not make the gateway faster (docs/benchmarks.md)
        gt=0,
        le=100,
        description="In each engine process, how soon a thread that waits for the interpreter lock gets it "
        "(Python's switch interval, 5 ms by default): the MLX thread lets go of it dozens of times a step "
        "and waits up to this long for it each time (shorter: docs/benchmarks.md)",
    )
    cuda_mps: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Several engine processes on an NVIDIA GPU run through a CUDA MPS server of the "
        "gateway's own (their kernels side by side instead of time-sliced): auto = with two or more "
        "engines where nvidia-cuda-mps-control is installed and no CUDA_MPS_PIPE_DIRECTORY is set",
    )


class LogSettings(BaseModel):
    level: str = Field("INFO", description="Log level")


# NEMO_* variable -> (section, field): the seed server's names keep working.
NEMO_ALIASES: dict[str, tuple[str, str]] = {
    "NEMO_MODEL_DIR": ("model", "dir"),
    "NEMO_MEL_FILTERS": ("model", "mel_filters"),
    "NEMO_ENCODER": ("model", "encoder"),
    "NEMO_MLX_WEIGHTS": ("model", "encoder_weights"),
    "NEMO_MLX_PRECISION": ("model", "precision"),
    "NEMO_BATCH_MAX": ("encoder", "max_batch"),
    "NEMO_WORKERS": ("decoder", "workers"),
}


class _NemoAliasSource(PydanticBaseSettingsSource):
    """Settings from the NEMO_* aliases; ranked below TTG_* variables."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, dict[str, str]] = {}
        for var, (section, name) in NEMO_ALIASES.items():
            value = os.environ.get(var)
            if value is not None and value != "":
                out.setdefault(section, {})[name] = value
        return out


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TTG_", env_nested_delimiter="__", extra="ignore")

    model: ModelSettings = ModelSettings()
    asr: AsrSettings = AsrSettings()
    encoder: EncoderSettings = EncoderSettings()
    decoder: DecoderSettings = DecoderSettings()
    sip: SipSettings = SipSettings()
    rtp: RtpSettings = RtpSettings()
    redis: RedisSettings = RedisSettings()
    sink: SinkSettings = SinkSettings()
    http: HttpSettings = HttpSettings()
    daemon: DaemonSettings = DaemonSettings()
    log: LogSettings = LogSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # TTG_* beats NEMO_*: pydantic-settings deep-merges sources, earlier ones win.
        return (init_settings, env_settings, _NemoAliasSource(settings_cls), dotenv_settings)


def env_variables() -> list[tuple[str, str, str]]:
    """Every TTG_* variable as (name, default, description), for env.example and the README table."""
    rows: list[tuple[str, str, str]] = []
    for section, finfo in Settings.model_fields.items():
        model_cls = finfo.annotation
        assert isinstance(model_cls, type) and issubclass(model_cls, BaseModel)
        for name, f in model_cls.model_fields.items():
            default = f.get_default(call_default_factory=True)
            if isinstance(default, list):
                text = "[" + ",".join(f'"{x}"' for x in default) + "]"
            elif default is None:
                text = ""
            else:
                text = str(default)
            rows.append((f"TTG_{section.upper()}__{name.upper()}", text, f.description or ""))
    return rows
