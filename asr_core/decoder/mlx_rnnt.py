"""The prediction network and joint in MLX (Metal / CUDA / CPU): for the batched decoder on a device.

Same math as the ONNX graphs (weights from `RnntGraphs.weights()`, checked against onnxruntime);
`joiner_argmax_prob` returns only the B winning ids and their softmax probabilities, so the B x V
logits never leave the device. The
greedy loop itself stays on the host (`BatchedGreedyDecoder`), one joiner call per inner iteration.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from numpy.typing import NDArray

from asr_core.decoder.numpy_rnnt import RnntWeights
from asr_core.views import at

F32 = NDArray[np.float32]


class MlxRnnt:
    def __init__(self, weights: RnntWeights, dtype: mx.Dtype = mx.float32) -> None:
        self.dtype = dtype
        self.hidden = weights.hidden
        self.layers = len(weights.lstm)
        self._emb = mx.array(weights.embedding, dtype=dtype)
        self._lstm = [
            (
                mx.array(la.w_ih.T, dtype=dtype),
                mx.array(la.w_hh.T, dtype=dtype),
                mx.array(la.bias, dtype=dtype),
            )
            for la in weights.lstm
        ]
        self._proj = (mx.array(weights.proj_w.T, dtype=dtype), mx.array(weights.proj_b, dtype=dtype))
        self._head = (mx.array(weights.head_w.T, dtype=dtype), mx.array(weights.head_b, dtype=dtype))
        self._argmax_prob = mx.compile(self._joint_argmax_prob)
        self._step = mx.compile(self.predict)

    def zero_state(self, batch: int) -> tuple[F32, F32]:
        shape = (self.layers, batch, self.hidden)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def predict(self, tokens: mx.array, h: mx.array, c: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The prediction network on device arrays: tokens (B,), h/c (L, B, H) -> g (B, J), h', c'."""
        x = self._emb[tokens]
        hs, cs = [], []
        for i, (w_ih, w_hh, b) in enumerate(self._lstm):
            gates = x @ w_ih + at(h, i) @ w_hh + b  # each layer's state as a view, not a gather
            gi, gf, gg, go = mx.split(gates, 4, axis=1)
            c_new = mx.sigmoid(gf) * at(c, i) + mx.sigmoid(gi) * mx.tanh(gg)
            x = mx.sigmoid(go) * mx.tanh(c_new)
            hs.append(x)
            cs.append(c_new)
        return x @ self._proj[0] + self._proj[1], mx.stack(hs), mx.stack(cs)

    def joint(self, f: mx.array, g: mx.array) -> mx.array:
        """The joint on device arrays: f, g (B, J) -> logits (B, V)."""
        return mx.maximum(f + g, 0) @ self._head[0] + self._head[1]

    def _joint_argmax_prob(self, f: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.joint(f, g).astype(mx.float32)
        top = mx.max(logits, axis=1)
        return mx.argmax(logits, axis=1), mx.exp(top - mx.logsumexp(logits, axis=1))

    def decoder_step(self, tokens: NDArray[np.integer], h: F32, c: F32) -> tuple[F32, F32, F32]:
        t = mx.array(np.asarray(tokens, np.int32))
        g, h2, c2 = self._step(t, mx.array(h, dtype=self.dtype), mx.array(c, dtype=self.dtype))
        mx.eval(g, h2, c2)
        return np.array(g, np.float32), np.array(h2, np.float32), np.array(c2, np.float32)

    def joiner(self, f: F32, g: F32) -> F32:
        out = self.joint(mx.array(f, dtype=self.dtype), mx.array(g, dtype=self.dtype))
        return np.array(out, np.float32)

    def joiner_argmax_prob(self, f: F32, g: F32) -> tuple[NDArray[np.int64], F32]:
        ids, probs = self._argmax_prob(mx.array(f, dtype=self.dtype), mx.array(g, dtype=self.dtype))
        return np.array(ids, np.int64), np.array(probs, np.float32)
