"""RNN-T greedy decoding (model_spec.md §6.2; NeMo `greedy_batch`, HF `ParakeetRNNTGenerationMixin`).

    reset:  h = c = 0; g, h, c = decoder(blank, h, c)          (prime with blank, commit)
    frame:  up to max_symbols times: k = argmax joiner(f, g)
            k == blank -> next frame (state untouched); else emit k and g, h, c = decoder(k, h, c)
            after max_symbols emissions on one frame the frame advances anyway

The predictor state (g, h, c) and the frame counter live in a `DecoderState` per stream and carry
across chunks; nothing resets between chunks.

`GreedyDecoder` decodes one stream's chunk at a time. `BatchedGreedyDecoder` advances many streams in
one pass, label-looping over the batch: each inner iteration runs the joiner once over every stream
that still has frames (each at its own frame pointer), then the prediction network once over the
streams that emitted. Every stream sees exactly the per-stream sequence of operations, so the tokens
are identical; only the batching of rows into matrix products differs.

Each emission carries the joint's softmax probability of its token (the confidence of words),
computed only for the rows that emit: 1 / sum(exp(logits - max)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]


class RnntNet(Protocol):
    """What greedy decoding needs: `RnntGraphs` (onnxruntime) or `NumpyRnnt`."""

    def zero_state(self, batch: int) -> tuple[F32, F32]: ...

    def decoder_step(self, tokens: NDArray[np.integer], h: F32, c: F32) -> tuple[F32, F32, F32]: ...

    def joiner(self, f: F32, g: F32) -> F32: ...


@dataclass(frozen=True, slots=True)
class Emission:
    token: int
    frame: int  # encoder frame index on the stream's timeline (x 80 ms = time)
    prob: float = 1.0  # softmax probability of `token` in the joint's output


def _winner_probs(logits: F32) -> F32:
    """Softmax probability of each row's largest logit."""
    z = logits - logits.max(axis=1, keepdims=True)
    return (1.0 / np.exp(z, dtype=np.float64).sum(axis=1)).astype(np.float32)


@dataclass(slots=True)
class DecoderState:
    """One stream's predictor state: last decoder output g (J,), LSTM h/c (L, H), frames consumed."""

    g: F32
    h: F32
    c: F32
    frames: int = 0


class _Greedy:
    def __init__(self, net: RnntNet, blank_id: int, max_symbols: int = 10) -> None:
        if max_symbols < 1:
            raise ValueError("max_symbols must be >= 1")
        self.net = net
        self.blank_id = blank_id
        self.max_symbols = max_symbols

    def new_states(self, n: int) -> list[DecoderState]:
        """Fresh streams, primed with blank (one batched decoder call)."""
        h0, c0 = self.net.zero_state(n)
        g, h, c = self.net.decoder_step(np.full(n, self.blank_id, np.int64), h0, c0)
        return [DecoderState(g[i].copy(), h[:, i].copy(), c[:, i].copy()) for i in range(n)]

    def new_state(self) -> DecoderState:
        return self.new_states(1)[0]

    def _argmax(self, f: F32, g: F32) -> tuple[NDArray[np.int64], F32]:
        """Winning ids of the joint, and what `_probs` needs for their probabilities: the logits, or
        (a net with `joiner_argmax_prob`, MLX, keeping the logits on its device) the probabilities."""
        fast = getattr(self.net, "joiner_argmax_prob", None)
        if fast is not None:
            ids, probs = fast(f, g)
            return ids, probs
        logits = self.net.joiner(f, g)
        return logits.argmax(axis=1), logits

    @staticmethod
    def _probs(scores: F32, rows: NDArray[np.bool_]) -> F32:
        """Probabilities of the winning ids of `rows` from `_argmax`'s second result."""
        return scores[rows] if scores.ndim == 1 else _winner_probs(scores[rows])


class GreedyDecoder(_Greedy):
    """Per-stream greedy decoding; owns its net (one worker thread)."""

    def decode(self, state: DecoderState, frames: F32) -> list[Emission]:
        """Decode a chunk's encoder frames (T, J), advancing `state`; returns the emitted tokens."""
        out: list[Emission] = []
        g, h, c = state.g[None], state.h[:, None], state.c[:, None]
        blank, net = self.blank_id, self.net
        for t in range(frames.shape[0]):
            f = frames[t : t + 1]
            for _ in range(self.max_symbols):
                ids, scores = self._argmax(f, g)
                k = int(ids[0])
                if k == blank:
                    break
                out.append(Emission(k, state.frames + t, float(self._probs(scores, ids != blank)[0])))
                g, h, c = net.decoder_step(np.array([k], np.int64), h, c)
        state.g, state.h, state.c = g[0], h[:, 0], c[:, 0]
        state.frames += frames.shape[0]
        return out


class BatchedGreedyDecoder(_Greedy):
    """All due streams in one label-looping pass; tokens identical to `GreedyDecoder`."""

    def decode(self, states: Sequence[DecoderState], frames_list: Sequence[F32]) -> list[list[Emission]]:
        n = len(states)
        if n != len(frames_list):
            raise ValueError("one frames array per state")
        out: list[list[Emission]] = [[] for _ in range(n)]
        if n == 0:
            return out
        lengths = np.array([f.shape[0] for f in frames_list], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        frames = np.concatenate([f for f in frames_list if f.shape[0]]) if lengths.sum() else None
        g = np.stack([s.g for s in states])
        h = np.stack([s.h for s in states], axis=1)
        c = np.stack([s.c for s in states], axis=1)
        base = np.array([s.frames for s in states], np.int64)
        t = np.zeros(n, np.int64)  # frame pointer within this call
        symbols = np.zeros(n, np.int64)  # emissions on the current frame
        active = np.flatnonzero(lengths > 0)
        blank, net, max_symbols = self.blank_id, self.net, self.max_symbols
        while active.size:
            assert frames is not None
            k, scores = self._argmax(frames[offsets[active] + t[active]], g[active])
            emit = k != blank
            done = active[~emit]
            t[done] += 1
            symbols[done] = 0
            rows = active[emit]
            if rows.size:
                toks = k[emit]
                probs = self._probs(scores, emit)
                for r, tok, p in zip(rows.tolist(), toks.tolist(), probs.tolist(), strict=True):
                    out[r].append(Emission(tok, int(base[r] + t[r]), p))
                g_new, h_new, c_new = net.decoder_step(toks, h[:, rows], c[:, rows])
                g[rows], h[:, rows], c[:, rows] = g_new, h_new, c_new
                symbols[rows] += 1
                forced = rows[symbols[rows] >= max_symbols]
                t[forced] += 1
                symbols[forced] = 0
            active = active[t[active] < lengths[active]]
        for i, s in enumerate(states):
            s.g, s.h, s.c = g[i].copy(), h[:, i].copy(), c[:, i].copy()
            s.frames += int(lengths[i])
        return out
