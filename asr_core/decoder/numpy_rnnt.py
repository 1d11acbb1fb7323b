"""The RNN-T prediction network and joint in numpy: the same math as decoder.onnx / joiner.onnx.

Used where an ORT session is not the right tool: checking generated graphs, calibrating random weights,
and decoding through graphs whose batch dimension is fixed to 1 (weights extracted from them).

Math (model_spec.md §6): g = decoder_projector(LSTM_L(embedding[token])); logits = head(relu(f + g)).
LSTM gate order here is PyTorch's (i, f, g, o); ONNX's LSTM op uses (i, o, f, c).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class LstmLayer:
    w_ih: F32  # (4H, in), gates i, f, g, o
    w_hh: F32  # (4H, H)
    bias: F32  # (4H,) = b_ih + b_hh


@dataclass(frozen=True, slots=True)
class RnntWeights:
    embedding: F32  # (V, H)
    lstm: tuple[LstmLayer, ...]
    proj_w: F32  # (J, H) decoder_projector, PyTorch (out, in)
    proj_b: F32  # (J,)
    head_w: F32  # (V, J)
    head_b: F32  # (V,)

    @classmethod
    def from_torch_names(cls, t: Mapping[str, F32], num_layers: int) -> RnntWeights:
        """From HF names (decoder.embedding.weight, decoder.lstm.weight_ih_l0, ..., joint.head.bias)."""
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
        layers = tuple(
            LstmLayer(
                f32(t[f"decoder.lstm.weight_ih_l{i}"]),
                f32(t[f"decoder.lstm.weight_hh_l{i}"]),
                f32(
                    np.asarray(t[f"decoder.lstm.bias_ih_l{i}"]) + np.asarray(t[f"decoder.lstm.bias_hh_l{i}"])
                ),
            )
            for i in range(num_layers)
        )
        return cls(
            f32(t["decoder.embedding.weight"]),
            layers,
            f32(t["decoder.decoder_projector.weight"]),
            f32(t["decoder.decoder_projector.bias"]),
            f32(t["joint.head.weight"]),
            f32(t["joint.head.bias"]),
        )

    @property
    def hidden(self) -> int:
        return int(self.embedding.shape[1])

    @property
    def vocab(self) -> int:
        return int(self.head_w.shape[0])


def _sigmoid(x: F32) -> F32:
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # overflow-free logistic


class NumpyRnnt:
    def __init__(self, weights: RnntWeights) -> None:
        self.w = weights
        self._lstm_t = [
            (np.ascontiguousarray(la.w_ih.T), np.ascontiguousarray(la.w_hh.T)) for la in weights.lstm
        ]
        self._proj_t = np.ascontiguousarray(weights.proj_w.T)
        self._head_t = np.ascontiguousarray(weights.head_w.T)

    def zero_state(self, batch: int) -> tuple[F32, F32]:
        shape = (len(self.w.lstm), batch, self.w.hidden)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def decoder_step(self, tokens: NDArray[np.integer], h: F32, c: F32) -> tuple[F32, F32, F32]:
        """tokens (B,), h/c (L, B, H) -> decoder_out (B, J), h', c'."""
        x = self.w.embedding[np.asarray(tokens, dtype=np.int64)]
        h_out, c_out = np.empty_like(h), np.empty_like(c)
        for i, (layer, (w_ih_t, w_hh_t)) in enumerate(zip(self.w.lstm, self._lstm_t, strict=True)):
            gates = x @ w_ih_t + h[i] @ w_hh_t + layer.bias
            gi, gf, gg, go = np.split(gates, 4, axis=1)
            c_out[i] = _sigmoid(gf) * c[i] + _sigmoid(gi) * np.tanh(gg)
            h_out[i] = _sigmoid(go) * np.tanh(c_out[i])
            x = h_out[i]
        return (x @ self._proj_t + self.w.proj_b).astype(np.float32), h_out, c_out

    def joiner(self, f: F32, g: F32) -> F32:
        """f, g (B, J) -> logits (B, V)."""
        return (np.maximum(f + g, 0.0) @ self._head_t + self.w.head_b).astype(np.float32)
