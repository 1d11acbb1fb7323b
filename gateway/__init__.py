"""gateway: the SIP trunk endpoint, RTP media, per-call sessions, the Redis sink, HTTP and the daemon.

Imports asr_core; asr_core never imports gateway.
"""

__version__ = "0.1.0"
