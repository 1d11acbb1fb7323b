"""RNN-T greedy decoding over the bundle's decoder.onnx / joiner.onnx.

`RnntGraphs` wraps the two graphs (onnxruntime, I/O checked); `GreedyDecoder` decodes one stream at a
time, `BatchedGreedyDecoder` all due streams in one pass (identical tokens); `DecoderState` is one
stream's predictor state and `Emission` one emitted token with its encoder frame. `RnntGraphs.weights()`
gives the graphs' weights as arrays for `NumpyRnnt` or `asr_core.decoder.mlx_rnnt.MlxRnnt` (MLX).
"""

from asr_core.decoder.extract import ExtractError, extract_rnnt_weights
from asr_core.decoder.graphs import RnntGraphs, RnntShape
from asr_core.decoder.greedy import BatchedGreedyDecoder, DecoderState, Emission, GreedyDecoder, RnntNet
from asr_core.decoder.numpy_rnnt import NumpyRnnt, RnntWeights

__all__ = [
    "BatchedGreedyDecoder",
    "DecoderState",
    "Emission",
    "ExtractError",
    "GreedyDecoder",
    "NumpyRnnt",
    "RnntGraphs",
    "RnntNet",
    "RnntShape",
    "RnntWeights",
    "extract_rnnt_weights",
]
