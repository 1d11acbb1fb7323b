"""Every gateway metric, in one place (prometheus_client, default registry).

Names follow Prometheus practice: `ttg_` namespace, base units (seconds, bytes), `_total` counters,
bounded label sets only (never a call id). Adapters increment these; pure cores never do (they return
counters in their stats and the adapter adds them). Dashboards in ops/grafana refer only to names
declared here. Tests read values with `REGISTRY.get_sample_value(...)` deltas.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info

# Histogram buckets in seconds, chosen around the 320 ms chunk.
_STEP_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
_LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

BUILD_INFO = Info("ttg_build", "Build information of the gateway")

# --- calls and SIP -------------------------------------------------------------------------------
ACTIVE_CALLS = Gauge("ttg_active_calls", "Calls currently up (answered or being set up)")
CALLS = Counter("ttg_calls_total", "Calls by outcome", ["result"])
SIP_REQUESTS = Counter("ttg_sip_requests_total", "SIP requests received", ["method"])
SIP_RESPONSES = Counter("ttg_sip_responses_total", "SIP responses sent", ["code"])
SIP_ERRORS = Counter("ttg_sip_errors_total", "Malformed or rejected SIP messages", ["reason"])

# --- RTP ------------------------------------------------------------------------------------------
RTP_RECEIVED = Counter("ttg_rtp_packets_received_total", "RTP packets received", ["codec"])
RTP_LOST = Counter("ttg_rtp_packets_lost_total", "RTP packets never received (concealed)")
RTP_LATE = Counter("ttg_rtp_packets_late_total", "RTP packets that arrived after their playout deadline")
RTP_DUPLICATE = Counter("ttg_rtp_packets_duplicate_total", "Duplicate RTP packets dropped")
RTP_INVALID = Counter("ttg_rtp_packets_invalid_total", "Datagrams on RTP ports that were not valid RTP", ["reason"])
RTP_JITTER = Histogram(
    "ttg_rtp_jitter_seconds",
    "Interarrival jitter per call at hang-up (RFC 3550 A.8)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
)
DTMF_EVENTS = Counter("ttg_dtmf_events_total", "RFC 4733 DTMF events received")

# --- ASR engine (fed through asr_core's EngineHooks) ----------------------------------------------
ENCODER_STEP = Histogram("ttg_encoder_step_seconds", "Wall time of one batched encoder step", buckets=_STEP_BUCKETS)
ENCODER_BATCH = Histogram("ttg_encoder_batch_size", "Chunks (calls) per encoder step", buckets=_BATCH_BUCKETS)
ASR_QUEUE_WAIT = Histogram(
    "ttg_asr_queue_wait_seconds", "Time a ready chunk waited before its encoder step", buckets=_STEP_BUCKETS
)
DECODER_STEP = Histogram("ttg_decoder_step_seconds", "Wall time of one RNN-T decode step", buckets=_STEP_BUCKETS)
ASR_DROPPED_CHUNKS = Counter("ttg_asr_chunks_dropped_total", "Audio chunks dropped because a call fell behind")
TRANSCRIPT_LATENCY = Histogram(
    "ttg_transcript_latency_seconds",
    "From the arrival of the audio that completed a chunk to its transcript event",
    ["type"],
    buckets=_LATENCY_BUCKETS,
)

# --- events to Redis -----------------------------------------------------------------------------
EVENTS_PUBLISHED = Counter("ttg_events_published_total", "Events written to Redis", ["type"])
EVENTS_DROPPED = Counter("ttg_events_dropped_total", "Events dropped (never written)", ["type", "reason"])
EVENTS_BUFFERED = Gauge("ttg_events_buffered", "Events waiting in memory or in the spool for Redis")
REDIS_UP = Gauge("ttg_redis_up", "1 when the last Redis round trip succeeded")
