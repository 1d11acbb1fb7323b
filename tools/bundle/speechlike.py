"""Random weights shaped so that greedy decoding behaves like a speech model's on telephone speech:
a few tokens per second while someone speaks, none in pauses (`ttg make-bundle --calibrate speech`).

What a benchmark needs from a model is its decoding *load* and its *endpointing*: how many joiner and
predictor rows each frame costs, how many label-looping iterations a batch runs, when finals come.
Drawn weights give neither: a frame that emits runs to max_symbols, and a full-size random encoder's
output hardly depends on the audio (24 layers of diffuse attention average the frames' detail away,
so neither loudness nor speech/silence can be read off it linearly on voices it was not fitted on;
docs/benchmarks.md has the measurements). So this calibration builds, out of the drawn tensors, a
model whose computation is the real one (same tensors, same shapes, same graphs) and whose numbers
do four things:

1. **A loudness channel through the encoder.** Channel 0 of the subsampling stack computes
   relu(mean log-mel of a 2x3 patch - LOUDNESS_FLOOR) (taps placed so that neither the zero padding
   before a stream's start nor the one after its end is ever read); the subsampling's linear layer
   writes its mean over frequency into residual channel 0, which no attention/feed-forward/conv
   branch writes to; the prompt projector passes it to output dimension 0. Every other tensor keeps
   its drawn values, except that each residual branch's output is scaled by BRANCH_SCALE, so the
   encoder output follows the audio frame by frame instead of being one slowly drifting vector.
2. **A speech gate in the joint.** Two joint units carry clip((z0 - lo) / (hi - lo), 0, 1), with lo
   above every silence frame of the calibration speech; the blank logit falls by GATE_BLANK where
   the gate is open. In a pause the blank wins by GATE_BLANK: no token, so finals come at pauses.
3. **Emission at acoustic changes, one or two tokens at a time.** Speech frames of the encoder
   output are whitened and reduced to their slowest-changing directions (frame to frame), where K
   random directions serve as "classes". (Over all directions consecutive frames are nearly
   independent, so the best class would change on almost every frame and only a high margin could
   thin that out; the rate would then swing with each voice's spread. Along the slow directions a
   frame moves on at a syllable-like pace.) Joint units say, for each class, how much the frame
   matches it; the prediction network remembers the class of the last token (a designed slice of
   the LSTM: those units forget everything and take the token's class from the embedding), and the
   joint compares the frame's best *new* class with the remembered one. A token is emitted when
   the frame has moved to another class by more than the blank margin; right after it the frame's
   best class is the remembered one, so blank wins and the frame advances. PREFIX_SHARE of the
   pieces leave the memory empty instead, and may only follow a remembered piece (they lose
   PREFIX_HOLD while the memory is empty), so some emitting frames carry two tokens, as word pieces
   do; never max_symbols runs.
4. **Varied token identities.** A token's logit also gets a random mix of noise units driven by the
   frame and by the rest of the LSTM state (its history), so which of its class's ~V/K tokens wins
   varies; special pieces (`<unk>`, language tags, byte pieces, a bare `▁`) never win, so text grows.

The blank margin is then found by bisection: greedy decoding (the real algorithm, numpy net) of the
calibration speech's encoder frames emits `tokens_per_second` per second of speech.

The encoder frames come from the real pipeline: espeak-ng speech through the telephone channel
(tools/bundle/speech.py), asr_core's streaming log-mel and chunker, and the MLX streaming encoder at
lookahead 3 (one batched step per chunk, one row per voice). This is NOT a speech model: the tokens
mean nothing and the speech gate is an energy detector (line noise louder than about -50 dBFS
opens it). It makes decode load and endpointing behave like a real model's; docs/benchmarks.md has the
measurements.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from asr_core._blas import openblas_threads
from asr_core.decoder.greedy import BatchedGreedyDecoder
from asr_core.decoder.numpy_rnnt import NumpyRnnt, RnntWeights
from tools.bundle.prompts import PROMPT_DICTIONARY
from tools.bundle.spec import FEATURES, SUPPORTED_LOOKAHEADS, ModelSpec
from tools.bundle.speech import CALIBRATION_SET, SpeechSet, SpeechStream, frame_labels, render
from tools.bundle.tokens import WORD, generated_vocabulary

F32 = NDArray[np.float32]
F64 = NDArray[np.float64]

LOUDNESS_FLOOR = -10.0  # natural-log mel power: a -52 dBFS line-noise patch stays below, speech is above
LOUDNESS_GAIN = 6.0  # residual channel 0 = gain x mean loudness (speech ~1.5 before the gain)
BRANCH_SCALE = 0.2  # residual branch outputs x this: the encoder output keeps its frames' detail
PASS_BIAS = 100.0  # keeps the prompt projector's pass-through unit in relu's linear range
CLASS_DIMS = 16  # the slowest directions of speech that the classes live in
PCA_DIMS = 64  # ... chosen among the top principal components
GATE_BLANK = 60.0  # blank's advantage with the gate shut
NOT_EMITTED = -1.0e4  # bias of pieces that must never win (no text)
FORGET = 20.0  # LSTM gate saturation for the designed units (sigmoid(20) = 1 - 2e-9)
CODE = float(np.tanh(1.0))  # the designed LSTM units' output: +-tanh(1)
WALL = 1000.0  # how far the predictor pushes a class unit below zero
PREFIX_SHARE = 0.15  # tokens that leave the class memory empty: the frame may emit again after them
PREFIX_HOLD = 4.0
SPEECH_MARGIN_FRAMES = 2  # frames this close to a sentence boundary are neither speech nor pause
LOOKAHEAD = SUPPORTED_LOOKAHEADS[0]


@dataclass(frozen=True, slots=True)
class JointLayout:
    """Which joint units (of J) and LSTM units (of H) do what."""

    classes: int  # K
    joint: int  # J

    @property
    def gate(self) -> tuple[int, int]:
        return 0, 1

    @property
    def remembers(self) -> int:  # 1 while the predictor holds a class, else 0
        return 2

    def new(self, c: int) -> int:  # frame matches class c, which is not the last token's
        return 3 + c

    def old(self, c: int) -> int:  # frame matches class c, which is the last token's
        return 3 + self.classes + c

    @property
    def noise(self) -> slice:
        return slice(3 + 2 * self.classes, self.joint)

    @classmethod
    def of(cls, spec: ModelSpec) -> JointLayout:
        return cls(classes=min(128, spec.decoder_hidden // 4), joint=spec.decoder_hidden)


@dataclass(frozen=True, slots=True)
class Decoded:
    """Greedy decoding of the calibration frames, counted."""

    tokens: int
    speech_tokens: int  # at frames within a sentence (or near its edges)
    pause_tokens: int  # at frames of a pause, SPEECH_MARGIN_FRAMES or more from any sentence
    speech_seconds: float
    distinct: int
    max_per_frame: int
    multi_frames: float  # fraction of emitting frames with more than one token
    per_stream: tuple[float, ...]  # tokens per second of speech, by stream

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.speech_seconds


@dataclass(frozen=True, slots=True)
class SpeechCalibration:
    blank_margin: float
    decoded: Decoded
    gate: tuple[float, float]  # lo, hi on encoder output dimension 0
    pause_max: float  # largest dimension-0 value of a pause frame
    speech_open: float  # fraction of sentence frames with the gate fully open
    audio_seconds: float
    encoder_seconds: float  # wall time of the streaming encoder pass
    search_seconds: float  # wall time of the blank margin's bisection
    precision: str

    def metadata(self) -> dict[str, str]:
        d = self.decoded
        return {
            "calibration": "speech",
            "calibration_speech_tokens_per_second": f"{d.tokens_per_second:.2f}",
            "calibration_pause_tokens": str(d.pause_tokens),
            "calibration_distinct_tokens": str(d.distinct),
            "calibration_precision": self.precision,
        }

    def report(self) -> dict[str, object]:
        d = self.decoded
        return {
            "method": "speech",
            "precision": self.precision,
            "audio_s": round(self.audio_seconds, 1),
            "speech_s": round(d.speech_seconds, 1),
            "encoder_pass_s": round(self.encoder_seconds, 1),
            "margin_search_s": round(self.search_seconds, 1),
            "tokens_per_speech_second": round(d.tokens_per_second, 2),
            "by_voice": [round(r, 2) for r in d.per_stream],
            "tokens_in_pauses": d.pause_tokens,
            "distinct_tokens": d.distinct,
            "max_tokens_per_frame": d.max_per_frame,
            "emitting_frames_with_2_or_more": round(d.multi_frames, 3),
            "gate_lo_hi": [round(v, 3) for v in self.gate],
            "pause_max": round(self.pause_max, 3),
            "speech_frames_gate_open": round(self.speech_open, 3),
            "blank_margin": round(self.blank_margin, 4),
        }


# -- 1. the encoder ------------------------------------------------------------------------------


def _branch_outputs(spec: ModelSpec) -> list[str]:
    names = []
    for n in range(spec.num_layers):
        p = f"encoder.layers.{n}"
        names += [
            f"{p}.feed_forward1.linear2.weight",
            f"{p}.feed_forward2.linear2.weight",
            f"{p}.self_attn.o_proj.weight",
            f"{p}.conv.pointwise_conv2.weight",
        ]
    return names


def shape_encoder(spec: ModelSpec, enc: dict[str, F32]) -> None:
    """Step 1 of the module docstring, in place (new arrays; the drawn ones are not modified).

    Causal stride-2 convolutions read rows/bins 2i-2, 2i-1, 2i of their input (padding 2 before, 1
    after). The zero padding is "loud" to conv_in (log-mel is negative) but silent after it (relu
    outputs are >= 0), so channel 0 of conv_in reads only rows 2i-2, 2i-1 (never the padding after
    the end; the one before the start only at output row 0) and each later stage reads row 2i-1 and
    bin 2i-1 only (never its input's row 0 or bin 0).
    """

    def edit(name: str) -> F32:
        enc[name] = np.array(enc[name], dtype=np.float32, copy=True)
        return enc[name]

    w, b = edit("encoder.subsampling.conv_in.weight"), edit("encoder.subsampling.conv_in.bias")
    w[0] = 0.0
    w[0, 0, :2, :] = 1.0 / 6.0
    b[0] = -LOUDNESS_FLOOR
    i = 0
    while f"encoder.subsampling.layers.{i}.depthwise_conv.weight" in enc:
        p = f"encoder.subsampling.layers.{i}"
        dw, dwb = edit(f"{p}.depthwise_conv.weight"), edit(f"{p}.depthwise_conv.bias")
        dw[0], dwb[0] = 0.0, 0.0
        dw[0, 0, 1, 1] = 1.0
        pw, pwb = edit(f"{p}.pointwise_conv.weight"), edit(f"{p}.pointwise_conv.bias")
        pw[0], pwb[0] = 0.0, 0.0
        pw[0, 0] = 1.0
        i += 1
    lin, linb = edit("encoder.subsampling.linear.weight"), edit("encoder.subsampling.linear.bias")
    f_out = spec.subsampled_freq  # flattened (channel, frequency): channel 0 is columns [0, f_out)
    lin[0], linb[0] = 0.0, 0.0
    lin[0, 1:f_out] = LOUDNESS_GAIN / (f_out - 1)  # bin 0 only ever reads padding
    for name in _branch_outputs(spec):
        v = edit(name)
        v *= np.float32(BRANCH_SCALE)
        v[0] = 0.0
    l1, l1b = edit("prompt_projector.linear_1.weight"), edit("prompt_projector.linear_1.bias")
    l1[0], l1[1:, 0] = 0.0, 0.0
    l1[0, 0], l1b[0] = 1.0, PASS_BIAS
    l2, l2b = edit("prompt_projector.linear_2.weight"), edit("prompt_projector.linear_2.bias")
    l2[0], l2[1:, 0] = 0.0, 0.0
    l2[0, 0], l2b[0] = 1.0, -PASS_BIAS


def encoder_outputs(
    spec: ModelSpec, enc: Mapping[str, F32], streams: Sequence[SpeechStream], precision: str = "f32"
) -> list[F32]:
    """Each stream through asr_core's streaming log-mel + chunker and the MLX streaming encoder (one
    batched step per chunk, lookahead 3, the stream's prompt), with encoder_projector replaced by the
    identity: the prompt-fused encoder output (T, D) that encoder_projector will see."""
    import mlx.core as mx

    from asr_core.bundle import convert_encoder_weights
    from asr_core.chunker import MelChunker
    from asr_core.encoder import ChunkInput, StreamingEncoder
    from asr_core.encoder.streaming import PRECISIONS
    from asr_core.features import FeatureConfig, MelFrames, StreamingLogMel
    from tools.bundle.filters import slaney_mel_filters

    d = spec.hidden_size
    cfg = spec.encoder_config(output_size=d)
    arrays = dict(enc)
    arrays["encoder_projector.weight"] = np.eye(d, dtype=np.float32)
    arrays["encoder_projector.bias"] = np.zeros(d, np.float32)
    encoder = StreamingEncoder(convert_encoder_weights(arrays, cfg, PRECISIONS[precision]), cfg, precision)
    del arrays
    filters = slaney_mel_filters(
        FEATURES["sampling_rate"], FEATURES["n_fft"], spec.n_mels, 0.0, FEATURES["fmax"]
    )
    mel_frames = MelFrames(filters, FeatureConfig.from_dict(dict(FEATURES, n_mels=spec.n_mels)))
    chunks: list[list[tuple[F32, bool]]] = []
    for s in streams:
        mel = StreamingLogMel(mel_frames)
        chunker = MelChunker(LOOKAHEAD, spec.subsampling_factor)
        todo = [(c, False) for c in chunker.push(mel.push(s.pcm))]
        todo += [(c, False) for c in chunker.push(mel.finish())]
        last = chunker.finish()
        if last is not None:
            todo.append((last, True))
        chunks.append(todo)
    slots = [encoder.alloc(PROMPT_DICTIONARY[s.prompt], LOOKAHEAD) for s in streams]
    out: list[list[F32]] = [[] for _ in streams]
    for i in range(max(len(c) for c in chunks)):
        due = [k for k in range(len(streams)) if i < len(chunks[k])]
        rows = [ChunkInput(slots[k], chunks[k][i][0], chunks[k][i][1]) for k in due]
        for k, frames in zip(due, encoder.step(rows), strict=True):
            out[k].append(frames)
    mx.clear_cache()
    return [np.concatenate(o).astype(np.float32) for o in out]


# -- 2.-4. the joint and the prediction network ----------------------------------------------------


def _pieces_never_emitted(spec: ModelSpec) -> NDArray[np.bool_]:
    pieces = generated_vocabulary(spec.vocab_size)
    out = np.array([(p.startswith("<") and p.endswith(">")) or p == WORD for p in pieces])
    out[spec.blank_id] = False
    return out


def _token_classes(spec: ModelSpec, layout: JointLayout, rng: np.random.Generator) -> NDArray[np.int64]:
    """Class of every non-blank piece (-1: never emitted, and blank), each class the same size +-1."""
    silent = _pieces_never_emitted(spec)
    ids = np.flatnonzero(~silent[: spec.blank_id])
    classes = np.full(spec.vocab_size, -1, np.int64)
    classes[rng.permutation(ids)] = np.arange(len(ids)) % layout.classes
    return classes


@dataclass(frozen=True, slots=True)
class _FrameSpace:
    """The space the classes live in: w (P, D), mean (D,); x = w (z - mean) has unit variance per
    dimension over speech frames. Dimension 0 (the loudness channel) is left out."""

    w: F64
    mean: F64

    @classmethod
    def fit(cls, runs: Sequence[F64], dims: int) -> _FrameSpace:
        """The `dims` slowest directions of speech (`runs`: each stream's speech frames in order,
        None-free): whitened over the top principal components, the directions along which
        consecutive frames differ least."""
        frames = np.concatenate(runs)
        frames[:, 0] = 0.0
        mean = frames.mean(axis=0)
        _, s, vt = np.linalg.svd(frames - mean, full_matrices=False)
        k = min(PCA_DIMS, int(np.sum(s > 1e-3 * s[0])))
        whiten = vt[:k] / (s[:k, None] / np.sqrt(len(frames)))
        steps = np.concatenate([np.diff(r[:, 1:], axis=0) for r in runs]) @ whiten[:, 1:].T
        _, vecs = np.linalg.eigh(steps.T @ steps)  # ascending: slowest first
        return cls(w=vecs[:, :dims].T @ whiten, mean=mean)


def design_joint(
    spec: ModelSpec,
    enc: dict[str, F32],
    rnnt: dict[str, F32],
    space: _FrameSpace,
    gate: tuple[float, float],
    speech: F64,
    seed: int,
) -> None:
    """Steps 2-4 of the module docstring: encoder_projector, the LSTM's designed slice, the decoder
    projector and the joint head, in place; `speech` are encoder outputs of speech frames (for the
    noise units' mean). The blank margin is 0 here (see `calibrate_speech`)."""
    layout = JointLayout.of(spec)
    rng = np.random.default_rng([seed, 0x7E11])
    k_cls, h, j, d, v = (
        layout.classes,
        spec.decoder_hidden,
        spec.decoder_hidden,
        spec.hidden_size,
        spec.vocab_size,
    )
    n_noise = j - layout.noise.start
    p = space.w.shape[0]

    # encoder_projector: f = W z + b.
    w = np.zeros((j, d), np.float64)
    b = np.zeros(j, np.float64)
    lo, hi = gate
    for unit, step in zip(layout.gate, (0.0, 1.0), strict=True):
        w[unit, 0] = 1.0 / (hi - lo)
        b[unit] = -lo / (hi - lo) - step
    b[layout.remembers] = 1.0
    directions = rng.standard_normal((k_cls, p))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    affinity = directions @ space.w  # (K, D): class affinities ~ N(0, 1) over speech frames
    for c in range(k_cls):
        for unit in (layout.new(c), layout.old(c)):
            w[unit] = affinity[c]
            b[unit] = -affinity[c] @ space.mean
    noise_dirs = rng.standard_normal((n_noise, p)) / np.sqrt(p)
    w[layout.noise] = noise_dirs @ space.w
    b[layout.noise] = -(noise_dirs @ space.w) @ space.mean
    enc["encoder_projector.weight"] = w.astype(np.float32)
    enc["encoder_projector.bias"] = b.astype(np.float32)

    # Prediction network: LSTM units [0, K) of every layer hold the last token's class as +-CODE
    # (forget everything, take the input); the other units keep their drawn weights (history).
    classes = _token_classes(spec, layout, rng)
    emb = np.array(rnnt["decoder.embedding.weight"], np.float32, copy=True)
    emb[:, :k_cls] = 0.0
    has_class = classes >= 0
    remembered = has_class & (rng.random(v) >= PREFIX_SHARE)
    emb[np.flatnonzero(remembered), classes[remembered]] = 1.0
    emb[spec.blank_id] = 0.0  # blank_as_pad: the primed state has no class (all -CODE)
    rnnt["decoder.embedding.weight"] = emb
    for layer in range(spec.decoder_layers):
        w_ih = np.array(rnnt[f"decoder.lstm.weight_ih_l{layer}"], np.float32, copy=True)
        w_hh = np.array(rnnt[f"decoder.lstm.weight_hh_l{layer}"], np.float32, copy=True)
        b_ih = np.array(rnnt[f"decoder.lstm.bias_ih_l{layer}"], np.float32, copy=True)
        b_hh = np.array(rnnt[f"decoder.lstm.bias_hh_l{layer}"], np.float32, copy=True)
        for gate_index, gate_bias in enumerate((FORGET, -FORGET, 0.0, FORGET)):  # i, f, g, o
            rows = slice(gate_index * h, gate_index * h + k_cls)
            w_ih[rows], w_hh[rows], b_hh[rows] = 0.0, 0.0, 0.0
            b_ih[rows] = gate_bias
        cand = np.arange(k_cls) + 2 * h  # the cell candidate rows of the designed units
        if layer == 0:  # input: the embedding's one-hot class (0/1) -> tanh(+-10)
            w_ih[cand, np.arange(k_cls)] = 20.0
            b_ih[cand] = -10.0
        else:  # input: the layer below's +-CODE -> tanh(+-10)
            w_ih[cand, np.arange(k_cls)] = 10.0 / CODE
        rnnt[f"decoder.lstm.weight_ih_l{layer}"], rnnt[f"decoder.lstm.weight_hh_l{layer}"] = w_ih, w_hh
        rnnt[f"decoder.lstm.bias_ih_l{layer}"], rnnt[f"decoder.lstm.bias_hh_l{layer}"] = b_ih, b_hh

    # decoder_projector: g = P h + q. Class units: -WALL where the class is (new) / is not (old)
    # the last token's; noise units: a random mix of the whole top LSTM state.
    pw = np.zeros((j, h), np.float64)
    pb = np.zeros(j, np.float64)
    for c in range(k_cls):
        pw[layout.new(c), c], pb[layout.new(c)] = -WALL / (2 * CODE), -WALL / 2
        pw[layout.old(c), c], pb[layout.old(c)] = WALL / (2 * CODE), -WALL / 2
    # one unit +CODE, the rest -CODE: 0; all -CODE: -2 (the frame side is a constant 1)
    pw[layout.remembers, :k_cls], pb[layout.remembers] = 1.0 / CODE, k_cls - 2.0
    pw[layout.noise] = rng.standard_normal((n_noise, h)) / np.sqrt(h)
    rnnt["decoder.decoder_projector.weight"] = pw.astype(np.float32)
    rnnt["decoder.decoder_projector.bias"] = pb.astype(np.float32)

    # Joint head: a token's logit = its class's "new" unit + a zero-mean noise mix; blank = the
    # last class's "old" unit + GATE_BLANK while the gate is shut (+ the margin, set later).
    head = np.zeros((v, j), np.float64)
    bias = np.zeros(v, np.float64)
    emit = np.flatnonzero(has_class)
    head[emit, [layout.new(int(c)) for c in classes[emit]]] = 1.0
    # A token that leaves the memory empty may follow a remembered one on a frame, never start one:
    # with the memory empty it loses PREFIX_HOLD, so the frame's next token is a remembered one.
    prefix = np.flatnonzero(has_class & ~remembered)
    head[prefix, layout.remembers], bias[prefix] = PREFIX_HOLD, -PREFIX_HOLD
    noise = rng.standard_normal((len(emit), n_noise)) * (0.5 / np.sqrt(n_noise))
    head[emit, layout.noise] = noise - noise.mean(axis=0)
    # Remove each token's mean noise (relu units have a positive mean): no piece wins by default.
    bias[emit] -= head[emit, layout.noise] @ _noise_mean(spec, rnnt, speech @ w.T + b, layout, rng)
    bias[np.flatnonzero(~has_class)] = NOT_EMITTED
    blank = spec.blank_id
    head[blank, [layout.old(c) for c in range(k_cls)]] = 1.0
    head[blank, layout.gate[0]], head[blank, layout.gate[1]] = -GATE_BLANK, GATE_BLANK
    bias[blank] = GATE_BLANK
    rnnt["joint.head.weight"] = head.astype(np.float32)
    rnnt["joint.head.bias"] = bias.astype(np.float32)


def _noise_mean(
    spec: ModelSpec, rnnt: Mapping[str, F32], frames: F64, layout: JointLayout, rng: np.random.Generator
) -> F64:
    """Mean of relu(f + g) on the noise units over speech frames and predictor states along a random
    token history (the new prediction network, its head not needed yet)."""
    net = NumpyRnnt(RnntWeights.from_torch_names(rnnt, spec.decoder_layers))
    h, c = net.zero_state(1)
    tokens = [spec.blank_id, *rng.integers(0, spec.blank_id, 63).tolist()]
    gs = []
    for token in tokens:
        g, h, c = net.decoder_step(np.array([token]), h, c)
        gs.append(g[0])
    f = frames[rng.permutation(len(frames))[:512], layout.noise]
    g_noise = np.asarray(gs, np.float64)[:, layout.noise]
    return np.maximum(f[:, None, :] + g_noise[None, :, :], 0.0).mean(axis=(0, 1))


# -- decoding the calibration frames ---------------------------------------------------------------


class _BlankShifted:
    """A numpy net whose blank logit is raised by `shift` (the margin being searched)."""

    def __init__(self, net: NumpyRnnt, blank: int, shift: float) -> None:
        self.net, self.blank, self.shift = net, blank, np.float32(shift)
        self.zero_state, self.decoder_step = net.zero_state, net.decoder_step

    def joiner(self, f: F32, g: F32) -> F32:
        logits = self.net.joiner(f, g)
        logits[:, self.blank] += self.shift
        return logits


def decode_frames(
    spec: ModelSpec,
    net: NumpyRnnt,
    frames: Sequence[F32],
    labels: Sequence[NDArray[np.int8]],
    speech_seconds: Sequence[float],
    shift: float,
) -> Decoded:
    """Greedy decoding (label-looping over all streams at once) with the blank raised by `shift`."""
    dec = BatchedGreedyDecoder(
        _BlankShifted(net, spec.blank_id, shift), spec.blank_id, spec.max_symbols_per_step
    )
    emitted = dec.decode(dec.new_states(len(frames)), list(frames))
    pause = 0
    per_frame: dict[tuple[int, int], int] = {}
    for s, (ems, lab) in enumerate(zip(emitted, labels, strict=True)):
        for e in ems:
            pause += int(lab[min(e.frame, len(lab) - 1)] == 0)
            per_frame[(s, e.frame)] = per_frame.get((s, e.frame), 0) + 1
    counts = list(per_frame.values())
    tokens = sum(counts)
    return Decoded(
        tokens=tokens,
        speech_tokens=tokens - pause,
        pause_tokens=pause,
        speech_seconds=sum(speech_seconds),
        distinct=len({e.token for ems in emitted for e in ems}),
        max_per_frame=max(counts, default=0),
        multi_frames=(sum(c > 1 for c in counts) / len(counts)) if counts else 0.0,
        per_stream=tuple(len(ems) / sec for ems, sec in zip(emitted, speech_seconds, strict=True)),
    )


def calibrate_speech(
    spec: ModelSpec,
    enc: dict[str, F32],
    rnnt: dict[str, F32],
    seed: int,
    tokens_per_second: float,
    precision: str = "f32",
    speech: SpeechSet = CALIBRATION_SET,
) -> SpeechCalibration:
    """All of the module docstring, in place on the drawn tensors. Same arguments, same bytes on a
    machine: the encoder pass runs OpenBLAS on one thread, whose sums do not depend on how many cores
    the machine has or what the process set before."""
    shape_encoder(spec, enc)
    streams = render(speech)
    t0 = time.monotonic()
    with openblas_threads(1):
        zs = encoder_outputs(spec, enc, streams, precision)
        encoder_seconds = time.monotonic() - t0
        cal = fit_joint(spec, enc, rnnt, streams, zs, seed, tokens_per_second)
    return dataclasses.replace(cal, encoder_seconds=encoder_seconds, precision=precision)


def _open_runs(zs: Sequence[F32], labels: Sequence[NDArray[np.int8]], level: float) -> list[F64]:
    """Runs of consecutive speech frames with the gate fully open, as float64 arrays."""
    runs = []
    for z, lab in zip(zs, labels, strict=True):
        ok = np.concatenate([[False], (lab == 1) & (z[:, 0] >= level), [False]])
        edges = np.flatnonzero(np.diff(ok.astype(np.int8)))
        runs += [z[a:b].astype(np.float64) for a, b in zip(edges[::2], edges[1::2], strict=True) if b - a > 1]
    return runs


def frames_of(enc: Mapping[str, F32], zs: Sequence[F32]) -> list[F32]:
    """Joiner inputs: encoder outputs (before encoder_projector) through encoder_projector."""
    w = enc["encoder_projector.weight"].astype(np.float64)
    b = enc["encoder_projector.bias"].astype(np.float64)
    return [(z.astype(np.float64) @ w.T + b).astype(np.float32) for z in zs]


def fit_joint(
    spec: ModelSpec,
    enc: dict[str, F32],
    rnnt: dict[str, F32],
    streams: Sequence[SpeechStream],
    zs: Sequence[F32],
    seed: int,
    tokens_per_second: float,
) -> SpeechCalibration:
    """Steps 2-4 and the margin, from the shaped encoder's outputs `zs` of `streams`."""
    labels = [frame_labels(s.spans, len(z), SPEECH_MARGIN_FRAMES) for s, z in zip(streams, zs, strict=True)]
    z_all = np.concatenate(zs).astype(np.float64)
    lab_all = np.concatenate(labels)
    loud = z_all[:, 0]
    pause_max = float(loud[lab_all == 0].max())
    speech_mid = float(np.median(loud[lab_all == 1]))
    if not speech_mid > pause_max:
        raise RuntimeError(
            f"calibration speech is not louder than its pauses in the encoder output "
            f"(median {speech_mid:.3f}, pause max {pause_max:.3f})"
        )
    span = speech_mid - pause_max
    gate = (pause_max + 0.15 * span, pause_max + 0.65 * span)
    open_speech = (lab_all == 1) & (loud >= gate[1])
    space = _FrameSpace.fit(_open_runs(zs, labels, gate[1]), CLASS_DIMS)
    design_joint(spec, enc, rnnt, space, gate, z_all[open_speech], seed)

    frames = frames_of(enc, zs)
    net = NumpyRnnt(RnntWeights.from_torch_names(rnnt, spec.decoder_layers))
    speech_seconds = [s.speech_seconds for s in streams]

    def run(shift: float) -> Decoded:
        return decode_frames(spec, net, frames, labels, speech_seconds, shift)

    # Fewer tokens as the margin grows (not strictly: a token changes the history), so bisect and
    # keep the margin whose rate came closest.
    t0 = time.monotonic()
    lo, hi = 0.0, 4.0
    best: tuple[float, Decoded] | None = None
    for _ in range(16):
        mid = 0.5 * (lo + hi)
        got = run(mid)
        if best is None or abs(got.tokens_per_second - tokens_per_second) < abs(
            best[1].tokens_per_second - tokens_per_second
        ):
            best = (mid, got)
        if got.tokens_per_second > tokens_per_second:
            lo = mid
        else:
            hi = mid
    assert best is not None
    margin = float(np.float32(best[0]))
    head_b = rnnt["joint.head.bias"].copy()
    head_b[spec.blank_id] += np.float32(margin)
    rnnt["joint.head.bias"] = head_b
    return SpeechCalibration(
        blank_margin=margin,
        decoded=best[1],
        gate=gate,
        pause_max=pause_max,
        speech_open=float(np.mean(loud[lab_all == 1] >= gate[1])),
        audio_seconds=sum(s.seconds for s in streams),
        encoder_seconds=0.0,
        search_seconds=time.monotonic() - t0,
        precision="",
    )
