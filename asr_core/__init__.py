"""asr_core: streaming speech recognition with nemotron-3.5-asr-streaming.

16 kHz mono float PCM in, partial and final transcripts out. Knows nothing of SIP, RTP or G.711.
Features, the cache-aware FastConformer encoder in MLX (batched across streams), RNN-T greedy
decoding over the bundle's ONNX graphs, the tokenizer and transcript assembly live here.
"""

from asr_core._blas import limit_numpy_blas_threads, preload_openblas

# Must run before anything imports mlx.core: on Linux, route MLX's CPU matmuls to OpenBLAS
# (mlx-cpu's bundled reference BLAS runs at ~5 GFLOP/s; OpenBLAS at ~250 on the dev machine).
preload_openblas()
limit_numpy_blas_threads()

from asr_core.api import (  # noqa: E402
    AsrEvent,
    StreamEnded,
    StreamOptions,
    TranscriptEvent,
    Word,
)
from asr_core.errors import AsrError, BundleError, StreamClosedError  # noqa: E402

__all__ = [
    "AsrError",
    "AsrEvent",
    "BundleError",
    "StreamClosedError",
    "StreamEnded",
    "StreamOptions",
    "TranscriptEvent",
    "Word",
]
