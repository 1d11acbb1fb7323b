"""Every gateway metric, in one place (prometheus_client, default registry).

Names follow Prometheus practice: `ttg_` namespace, base units (seconds, bytes), `_total` counters,
bounded label sets only (never a call id). Adapters increment these; pure cores never do (they return
counters in their stats and the adapter adds them). Dashboards in ops/grafana refer only to names
declared here. Tests read values with `REGISTRY.get_sample_value(...)` deltas.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata

from prometheus_client import Counter, Gauge, Histogram, Info

# Histogram buckets in seconds, chosen around the 320 ms chunk.
_STEP_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
_LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

BUILD_INFO = Info("ttg_build", "Build information of the gateway")

# --- calls and SIP -------------------------------------------------------------------------------
ACTIVE_CALLS = Gauge("ttg_active_calls", "Calls currently up (answered or being set up)")
ACTIVE_STREAMS = Gauge(
    "ttg_active_streams",
    "Audio streams (legs) of the calls currently up: what TTG_SIP__MAX_CALLS counts",
)
CALLS = Counter("ttg_calls_total", "Calls by outcome", ["result"])
SIP_REQUESTS = Counter("ttg_sip_requests_total", "SIP requests received", ["method"])
SIP_RESPONSES = Counter("ttg_sip_responses_total", "SIP responses sent", ["code"])
SIP_ERRORS = Counter("ttg_sip_errors_total", "Malformed or rejected SIP messages", ["reason"])
SIP_AUTH_FAILURES = Counter(
    "ttg_sip_auth_failures_total", "INVITEs refused (403) for wrong digest credentials"
)
SIP_AUTH_BANS = Counter("ttg_sip_auth_bans_total", "Sources banned after too many failed authentications")

# --- RTP ------------------------------------------------------------------------------------------
RTP_RECEIVED = Counter("ttg_rtp_packets_received_total", "RTP packets received", ["codec"])
RTP_LOST = Counter("ttg_rtp_packets_lost_total", "RTP packets never received (concealed)")
RTP_LATE = Counter("ttg_rtp_packets_late_total", "RTP packets that arrived after their playout deadline")
RTP_DUPLICATE = Counter("ttg_rtp_packets_duplicate_total", "Duplicate RTP packets dropped")
RTP_INVALID = Counter(
    "ttg_rtp_packets_invalid_total", "Datagrams on RTP ports that were not valid RTP", ["reason"]
)
RTP_JITTER = Histogram(
    "ttg_rtp_jitter_seconds",
    "Interarrival jitter per call at hang-up (RFC 3550 A.8)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
)
DTMF_EVENTS = Counter("ttg_dtmf_events_total", "RFC 4733 DTMF events received")
RTCP_REPORTS_SENT = Counter(
    "ttg_rtcp_reports_sent_total", "RTCP receiver reports sent to the peers (RFC 3550 §6.4.2, BYEs included)"
)
RTCP_SEND_ERRORS = Counter("ttg_rtcp_send_errors_total", "RTCP reports the socket refused to send (dropped)")
RTP_STREAMS = Gauge("ttg_rtp_streams", "RTP streams (port pairs) currently open")
RTP_TIMEOUTS = Counter("ttg_rtp_timeouts_total", "Streams that hit the (hold-aware) RTP inactivity timeout")
RTP_PORTS_EXHAUSTED = Counter(
    "ttg_rtp_ports_exhausted_total", "Streams refused because no RTP port pair was free or bindable"
)

# --- ASR engine (fed through asr_core's EngineHooks) ----------------------------------------------
ENCODER_STEP = Histogram(
    "ttg_encoder_step_seconds", "Wall time of one batched encoder step", buckets=_STEP_BUCKETS
)
ENCODER_BATCH = Histogram("ttg_encoder_batch_size", "Chunks (calls) per encoder step", buckets=_BATCH_BUCKETS)
ASR_QUEUE_WAIT = Histogram(
    "ttg_asr_queue_wait_seconds", "Time a ready chunk waited before its encoder step", buckets=_STEP_BUCKETS
)
DECODER_STEP = Histogram(
    "ttg_decoder_step_seconds", "Wall time of one RNN-T decode step", buckets=_STEP_BUCKETS
)
ENGINE_LAG = Gauge(
    "ttg_engine_lag_seconds",
    "Longest time over the last 1-2 s from a chunk's audio arriving to its decoding (the engine's delay)",
)
ENGINE_OVERLOADED = Gauge(
    "ttg_engine_overloaded", "1 while new calls are refused because the engine is too far behind"
)
ENGINE_LOAD = Gauge(
    "ttg_engine_load",
    "ASR encoder utilisation by the rows coming in (rows/s x each row's fitted step cost; the most loaded "
    "engine): near 1 the step time grows without bound",
)
CALL_LIMIT = Gauge(
    "ttg_call_limit",
    "Streams the adaptive call limit admits now (opens while the engine keeps up; max_calls when off)",
)
MEDIA_WORKERS = Gauge("ttg_media_workers", "Media worker processes running (0 in single-process mode)")
MEDIA_WORKER_LOOP_LAG = Gauge(
    "ttg_media_worker_loop_lag_seconds",
    "How late each media worker's event loop ran a timer, the most over its last report (about a second): "
    "a long loop turn delays every packet and chunk of its calls (single-process mode: the gateway's own "
    "loop, which carries the media path, as worker 0)",
    ["worker"],
)
MEDIA_WORKER_FLUSH_DELAY = Gauge(
    "ttg_media_worker_flush_delay_seconds",
    "The longest a chunk each media worker completed waited to be published to its engine's channel, over "
    "its last report (about a second): the media worker's part of the engine's receive lag (0 in "
    "single-process mode: no channel)",
    ["worker"],
)
ENGINE_STREAMS = Gauge(
    "ttg_engine_streams",
    "Audio streams each ASR engine process holds (its latest status; 0 while it is replaced): new legs go "
    "to the engine with the fewest",
    ["engine"],
)
ENGINE_PROCESS_LAG = Gauge(
    "ttg_engine_process_lag_seconds",
    "Each ASR engine process's own lag (its latest status; ttg_engine_lag_seconds is the largest of them)",
    ["engine"],
)
ENGINE_PROCESS_LOAD = Gauge(
    "ttg_engine_process_load",
    "Each ASR engine process's own load (its latest status; ttg_engine_load is the largest of them)",
    ["engine"],
)
ENGINE_PROCESS_RECEIVE_LAG = Gauge(
    "ttg_engine_process_receive_lag_seconds",
    "The first part of each ASR engine process's lag: the longest time from a chunk's audio to its arrival "
    "in the engine's queue (its front end and the channel from its media worker), over the same span",
    ["engine"],
)
ENGINE_PROCESS_ARRIVAL_LAG = Gauge(
    "ttg_engine_process_arrival_lag_seconds",
    "The part of each ASR engine process's receive lag before it read the chunk: the longest time from a "
    "chunk's completion in its media worker to the engine process reading it from the channel, over the "
    "same span (0 in single-process mode: no channel)",
    ["engine"],
)
ENGINE_PROCESS_QUEUE_WAIT = Gauge(
    "ttg_engine_process_queue_wait_seconds",
    "The second part of each ASR engine process's lag: the longest a chunk waited in its queue for an "
    "encoder step, over the same span (the rest is the step, the decoding and the transcript's assembly)",
    ["engine"],
)
ENGINE_PROCESS_BUSY = Gauge(
    "ttg_engine_process_busy",
    "Share of the last second or two each ASR engine process's MLX thread spent stepping, fixed costs and "
    "its decoding included (its latest status): near 1 it has no time left, whatever its load says",
    ["engine"],
)
ENGINES_UP = Gauge(
    "ttg_engines_up",
    "ASR engine processes taking calls (0 in single-process mode; fewer while one is replaced)",
)
ENGINE_FAILURES = Counter(
    "ttg_engine_failures_total",
    "ASR engine processes that failed (their calls ended as errors); with several, each is replaced",
)
CUDA_MPS = Gauge("ttg_cuda_mps", "1 when the engine processes run through the gateway's own CUDA MPS server")
MEDIA_WORKER_DEATHS = Counter(
    "ttg_media_worker_deaths_total", "Media worker processes that died (their calls ended as errors)"
)
ASR_DROPPED_CHUNKS = Counter(
    "ttg_asr_chunks_dropped_total", "Audio chunks dropped because a call fell behind"
)
TRANSCRIPT_LATENCY = Histogram(
    "ttg_transcript_latency_seconds",
    "From the arrival of the audio that completed a chunk to its transcript event",
    ["type"],
    buckets=_LATENCY_BUCKETS,
)
TIME_TO_FINAL = Histogram(
    "ttg_time_to_final_seconds",
    "From the caller's last speech sample (the VAD's speech end) to the final transcript it closed",
    buckets=_LATENCY_BUCKETS,
)

# --- events to Redis -----------------------------------------------------------------------------
EVENTS_PUBLISHED = Counter("ttg_events_published_total", "Events written to Redis", ["type"])
EVENTS_DROPPED = Counter("ttg_events_dropped_total", "Events dropped (never written)", ["type", "reason"])
EVENTS_BUFFERED = Gauge("ttg_events_buffered", "Events waiting in memory or in the spool for Redis")
REDIS_UP = Gauge("ttg_redis_up", "1 when the last Redis round trip succeeded")
EVENTS_DUPLICATES = Counter(
    "ttg_events_duplicates_total",
    "Events Redis already had when sent again (a retry after a lost reply, a replay); not stored twice",
    ["type"],
)
EVENTS_SPOOLED = Counter(
    "ttg_events_spooled_total", "Events written to the on-disk spool for Redis", ["type"]
)
SPOOL_CORRUPT = Counter(
    "ttg_spool_corrupt_records_total",
    "Damaged spool records skipped at startup (torn by a crash, bad checksum)",
)
REDIS_REQUEST = Histogram(
    "ttg_redis_request_seconds",
    "Round trip of one Redis request of the sink (a batch or a PING)",
    buckets=_STEP_BUCKETS,
)

# --- known label values: every series exists (at 0) from startup, so rates and alerts have data ----
# Adapters use these values; add a value here before using a new one.
EVENT_TYPES = ("call_start", "partial", "final", "dtmf", "call_end")
DROP_REASONS = ("buffer_full", "redis_down", "shutdown", "spool_full", "rejected", "invalid")
CALL_RESULTS = (
    "admitted",
    "rejected_capacity",
    "rejected_overload",
    "rejected_limit",
    "rejected_draining",
    "rejected_rate",
    "rejected_forbidden",
    "rejected_codec",
    "rejected_auth",
    "cancelled",
    "failed",
)
SIP_METHODS = ("INVITE", "ACK", "BYE", "CANCEL", "OPTIONS", "INFO", "UPDATE", "PRACK", "REGISTER", "other")
SIP_CODES = ("100", "180", "200", "400", "403", "404", "405", "408", "481", "486", "487", "488", "500", "503")
SIP_ERROR_REASONS = (
    "malformed",
    "truncated",
    "too_large",
    "version",
    "binary",
    # gateway.sip: requests from outside allow_cidrs, responses matching no transaction of ours,
    # TCP streams that could not be framed, the connection cap, failed sends, bugs caught per message,
    # requests refused (503) because the transaction table is full
    "forbidden_source",
    "stray_response",
    "framing",
    "tcp_limit",
    "send_failed",
    "internal",
    "overload",
    # requests dropped from a source banned for password guessing; TCP connections closed idle, with
    # a message not completed in time, or refused over the per-source cap
    "banned",
    "tcp_idle",
    "tcp_incomplete",
    "tcp_source_limit",
)
CODECS = ("PCMU", "PCMA")
# gateway.rtp: parse failures (packet.py), then the receiver's own drops (rtp/media.py).
RTP_INVALID_REASONS = (
    "too_short",
    "bad_version",
    "truncated",
    "bad_padding",
    "bad_rtcp",
    "unknown_pt",
    "wrong_source",
    "seq_jump",
    "stray_ssrc",
    "bad_dtmf",
)
TRANSCRIPT_TYPES = ("partial", "final")


def init_metrics(
    model: str = "",
    extra_labels: Iterable[tuple[Counter | Histogram, Sequence[str]]] = (),
    device: str = "",
) -> None:
    """Create every known labelled series and set ttg_build_info. Call once at startup."""
    for ev_type in EVENT_TYPES:
        EVENTS_PUBLISHED.labels(ev_type)
        EVENTS_DUPLICATES.labels(ev_type)
        EVENTS_SPOOLED.labels(ev_type)
        for reason in DROP_REASONS:
            EVENTS_DROPPED.labels(ev_type, reason)
    for result in CALL_RESULTS:
        CALLS.labels(result)
    for method in SIP_METHODS:
        SIP_REQUESTS.labels(method)
    for code in SIP_CODES:
        SIP_RESPONSES.labels(code)
    for reason in SIP_ERROR_REASONS:
        SIP_ERRORS.labels(reason)
    for codec in CODECS:
        RTP_RECEIVED.labels(codec)
    for reason in RTP_INVALID_REASONS:
        RTP_INVALID.labels(reason)
    for kind in TRANSCRIPT_TYPES:
        TRANSCRIPT_LATENCY.labels(kind)
    set_engine_status("0", {})  # every process model has engine 0; the others appear as they report
    for metric, values in extra_labels:
        for value in values:
            metric.labels(value)
    set_build_info(model, device)


def set_build_info(model: str = "", device: str = "") -> None:
    """`device`: where the engines run (cuda, metal or cpu: asr_core.accelerator)."""
    from gateway import __version__

    def version_of(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return ""

    BUILD_INFO.info(
        {
            "version": __version__,
            "python": platform.python_version(),
            "mlx": version_of("mlx"),
            "onnxruntime": version_of("onnxruntime"),
            "model": model,
            "device": device,
        }
    )


class PrometheusEngineHooks:
    """asr_core.hooks.EngineHooks that feeds the engine histograms (called on engine threads;
    prometheus_client is thread-safe and each call is a few hundred ns)."""

    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        ENCODER_STEP.observe(seconds)
        ENCODER_BATCH.observe(batch_size)
        for wait in queue_waits_s:
            ASR_QUEUE_WAIT.observe(wait)

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        DECODER_STEP.observe(seconds)

    def chunk_dropped(self, stream_id: str) -> None:
        ASR_DROPPED_CHUNKS.inc()  # no stream label: call ids are unbounded

    def transcript(self, kind: str, latency_s: float) -> None:
        TRANSCRIPT_LATENCY.labels(kind).observe(latency_s)

    def time_to_final(self, seconds: float) -> None:
        TIME_TO_FINAL.observe(seconds)


class PrometheusSinkHooks:
    """gateway.sink.core.SinkHooks that feeds the event metrics."""

    def published(self, type: str, duplicate: bool) -> None:
        EVENTS_PUBLISHED.labels(type).inc()
        if duplicate:
            EVENTS_DUPLICATES.labels(type).inc()

    def dropped(self, type: str, reason: str, n: int = 1) -> None:
        if n:
            EVENTS_DROPPED.labels(type, reason).inc(n)

    def spooled(self, type: str) -> None:
        EVENTS_SPOOLED.labels(type).inc()

    def redis_up(self, up: bool) -> None:
        REDIS_UP.set(1 if up else 0)

    def spool_corrupt(self, n: int) -> None:
        SPOOL_CORRUPT.inc(n)

    def request(self, seconds: float) -> None:
        REDIS_REQUEST.observe(seconds)

    def bind_buffered(self, fn: Callable[[], float]) -> None:
        EVENTS_BUFFERED.set_function(fn)


def set_media_worker_timing(worker: str, loop_lag_s: float, flush_delay_s: float) -> None:
    """One media worker's latest report of its event loop's lateness and its chunks' wait to be published
    (zeros once it is gone)."""
    MEDIA_WORKER_LOOP_LAG.labels(worker).set(loop_lag_s)
    MEDIA_WORKER_FLUSH_DELAY.labels(worker).set(flush_delay_s)


def set_engine_status(engine: str, status: Mapping[str, float]) -> None:
    """One engine process's latest status record on its labelled gauges (zeros for an empty one): the
    largest lag and load of the engines drive admission, these show which engine they came from."""
    ENGINE_STREAMS.labels(engine).set(status.get("active_streams", 0))
    ENGINE_PROCESS_LAG.labels(engine).set(status.get("lag_s", 0.0))
    ENGINE_PROCESS_LOAD.labels(engine).set(status.get("load", 0.0))
    ENGINE_PROCESS_BUSY.labels(engine).set(status.get("busy", 0.0))
    ENGINE_PROCESS_RECEIVE_LAG.labels(engine).set(status.get("receive_lag_s", 0.0))
    ENGINE_PROCESS_ARRIVAL_LAG.labels(engine).set(status.get("arrival_lag_s", 0.0))
    ENGINE_PROCESS_QUEUE_WAIT.labels(engine).set(status.get("queue_wait_s", 0.0))
