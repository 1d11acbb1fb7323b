"""asr_core: streaming speech recognition with nemotron-3.5-asr-streaming.

16 kHz mono float PCM in, partial and final transcripts out. Knows nothing of SIP, RTP or G.711.
Features, the cache-aware FastConformer encoder in MLX (batched across streams), RNN-T greedy
decoding over the bundle's ONNX graphs, the tokenizer and transcript assembly live here.
"""

from asr_core._process import configure_process
from asr_core.api import (
    AsrEvent,
    StreamEnded,
    StreamOptions,
    TranscriptEvent,
    Word,
)
from asr_core.errors import AsrError, BundleError, StreamClosedError

__all__ = [
    "AsrError",
    "AsrEvent",
    "BundleError",
    "StreamClosedError",
    "StreamEnded",
    "StreamOptions",
    "TranscriptEvent",
    "Word",
    "configure_process",
]
