"""Deterministic random weights for a bundle, and the calibration that makes them decode sensibly.

Every tensor is drawn from its own generator seeded by (seed, crc32(name)), so a tensor's values do not
depend on which other tensors exist or the order they are made in; the same seed gives the same bytes.

Scales are chosen so that every part of the network matters numerically (parity tests must be able to
see a wrong transpose, a missing bias or a swapped gate): linear/conv weights ~ N(0, 1/fan_in),
LayerNorm weights 1 + 0.1·N and biases 0.1·N (model_spec.md §10: "perturb LayerNorm and bias_u/v"),
bias_u/v 0.2·N, LSTM like torch (uniform ±1/sqrt(H)), the embedding's blank row zero (NeMo blank_as_pad).

Random weights do not decode like an ASR model: the joint picks one token at nearly every step, or,
with a guessed blank bias, none at all, or runs to max_symbols on every frame once it starts.
`calibrate` adjusts the drawn weights (see its steps) and finds the blank bias by decoding a
speech-like probe signal through the model's own encoder, so that greedy decoding emits about 3.5
tokens/s on it, in bursts on the frames the audio triggers. Rates on other audio vary around that
(a random model has no notion of words).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from asr_core.decoder.numpy_rnnt import NumpyRnnt, RnntWeights
from asr_core.features import FeatureConfig, log_mel
from tools.bundle.filters import slaney_mel_filters
from tools.bundle.numpy_encoder import encoder_forward, joiner_frames
from tools.bundle.probe import probe_audio
from tools.bundle.prompts import AUTO_PROMPT_ID
from tools.bundle.spec import FEATURES, ModelSpec
from tools.bundle.writer import BundleWeights

F32 = NDArray[np.float32]
DEFAULT_TOKENS_PER_SECOND = 3.5
PROBE_SECONDS = 8.0
FRAME_STD = 0.5  # spread of the joiner's encoder-frame input after calibration


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def init_kind(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """(distribution, loc, scale) of a tensor by its HF name: "normal", "uniform" (±scale) or "zeros"."""
    leaf = name.rsplit(".", 1)[-1]
    if ".norm" in name and leaf in ("weight", "bias"):
        return ("normal", 1.0, 0.1) if leaf == "weight" else ("normal", 0.0, 0.1)
    if leaf in ("bias_u", "bias_v"):
        return ("normal", 0.0, 0.2)
    if name.startswith("decoder.lstm."):
        hidden = shape[-1] if leaf.startswith("weight") else shape[0] // 4
        return ("uniform", 0.0, 1.0 / np.sqrt(hidden))
    if name == "decoder.embedding.weight":
        return ("normal", 0.0, 1.0)
    if name == "joint.head.bias":
        return ("zeros", 0.0, 0.0)
    if leaf == "bias":
        return ("normal", 0.0, 0.05)
    return ("normal", 0.0, 1.0 / np.sqrt(int(np.prod(shape[1:]))))


def random_tensor(seed: int, name: str, shape: tuple[int, ...]) -> F32:
    kind, loc, scale = init_kind(name, shape)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    rng = tensor_rng(seed, name)
    if kind == "uniform":
        return rng.uniform(-scale, scale, size=shape).astype(np.float32)
    out = rng.standard_normal(size=shape, dtype=np.float32)
    out *= np.float32(scale)
    out += np.float32(loc)
    return out


def random_encoder_tensors(spec: ModelSpec, seed: int) -> Iterator[tuple[str, F32]]:
    for name, shape in spec.encoder_shapes().items():
        yield name, random_tensor(seed, name, shape)


def random_rnnt_weights(spec: ModelSpec, seed: int) -> dict[str, F32]:
    out = {name: random_tensor(seed, name, shape) for name, shape in spec.rnnt_shapes().items()}
    out["decoder.embedding.weight"][spec.blank_id] = 0.0  # NeMo's blank_as_pad
    return out


def probe_frames(spec: ModelSpec, encoder: Mapping[str, F32], seconds: float = PROBE_SECONDS) -> F32:
    """Joiner inputs (T, J) of the speech-like probe signal through this model's encoder (auto prompt)."""
    filters = slaney_mel_filters(
        FEATURES["sampling_rate"], FEATURES["n_fft"], spec.n_mels, 0.0, FEATURES["fmax"]
    )
    mel = log_mel(probe_audio(seconds), filters, FeatureConfig(n_mels=spec.n_mels))
    hidden = encoder_forward(encoder, mel, spec.num_heads, lookahead=3)
    return joiner_frames(encoder, hidden, AUTO_PROMPT_ID, spec.num_prompts)


@dataclass(frozen=True, slots=True)
class Calibration:
    blank_shift: float
    tokens_per_second: float  # what greedy decoding of the probe emits after calibration
    distinct_tokens: int
    max_tokens_per_frame: int


class _ProbeDecoder:
    """Greedy decoding of fixed frames for many blank shifts at once.

    Blank wins at (frame t, history H) iff margin_H[t] < shift, where margin = best non-blank logit
    minus the blank logit (both without the shift). So each predictor history H (a node of a token
    trie) needs one joiner pass over all frames, shared by every shift whose decoding reaches H.
    """

    def __init__(self, spec: ModelSpec, frames: F32, rnnt: Mapping[str, F32]) -> None:
        self.spec, self.frames = spec, frames
        self.net = NumpyRnnt(RnntWeights.from_torch_names(rnnt, spec.decoder_layers))
        h, c = self.net.zero_state(1)
        self._state = [self.net.decoder_step(np.array([spec.blank_id]), h, c)]  # per node: g, h, c
        self._children: list[dict[int, int]] = [{}]
        self._scans: list[dict[int, tuple[float, int]] | None] = [None]

    def _child(self, node: int, token: int) -> int:
        child = self._children[node].get(token)
        if child is None:
            _, h, c = self._state[node]
            self._state.append(self.net.decoder_step(np.array([token]), h, c))
            self._children.append({})
            self._scans.append(None)
            child = self._children[node][token] = len(self._state) - 1
        return child

    def _scan(self, node: int, t: int) -> tuple[float, int]:
        """(margin, best non-blank) at frame t; joiner passes run over blocks of 8 frames on demand."""
        scan = self._scans[node]
        if scan is None:
            scan = self._scans[node] = {}
        if t not in scan:
            block = slice(t, min(len(self.frames), t + 8))
            f = self.frames[block]
            logits = self.net.joiner(f, np.broadcast_to(self._state[node][0], f.shape)).astype(np.float64)
            blank = logits[:, self.spec.blank_id].copy()
            logits[:, self.spec.blank_id] = -np.inf
            best = logits.argmax(axis=1)
            margin = logits[np.arange(len(best)), best] - blank
            for i, (m, k) in enumerate(zip(margin.tolist(), best.tolist(), strict=True)):
                scan.setdefault(t + i, (m, k))
        return scan[t]

    def decode(self, shift: float) -> list[tuple[int, int]]:
        node = 0
        out: list[tuple[int, int]] = []
        for t in range(len(self.frames)):
            for _ in range(self.spec.max_symbols_per_step):
                margin, best = self._scan(node, t)
                if margin < shift:
                    break
                node = self._child(node, best)
                out.append((t, best))
        return out


def _scale_affine(w: F32, b: F32, outputs: F32, std: float) -> tuple[F32, F32, F32]:
    """Re-center and re-scale an affine layer (W, b) so that its `outputs` get mean 0 and `std`."""
    mean = outputs.mean(axis=0)
    k = np.float32(std / max(1e-9, float((outputs - mean).std())))
    return (
        (w * k).astype(np.float32),
        ((b - mean) * k).astype(np.float32),
        ((outputs - mean) * k).astype(np.float32),
    )


def calibrate(
    spec: ModelSpec,
    encoder: dict[str, F32],
    rnnt: dict[str, F32],
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND,
) -> Calibration:
    """Adjust random weights in place so greedy decoding behaves like an ASR model's (see module doc).

    1. encoder_projector re-centered and scaled on the probe frames (mean 0, std FRAME_STD): a random
       encoder adds a large frame-independent offset that would drown what the audio changes;
    2. joint.head rows made zero-mean: relu(f + g) >= 0, so otherwise the row with the largest sum
       wins nearly every step and the output is one token repeated;
    3. the blank bias shifted so that decoding the probe emits `tokens_per_second`.

    The decision to emit then follows the audio (pauses decode to blank: endpointing tests rely on
    it). A random LSTM barely reacts to the token it is fed, so a frame that emits usually emits
    max_symbols tokens. Scaling the predictor up gives single emissions but ties them less to the
    audio (tokens in pauses), so it is not done; the decoder benchmark builds its own joiner inputs.
    """
    raw = probe_frames(spec, encoder)
    w, b, frames = _scale_affine(
        encoder["encoder_projector.weight"], encoder["encoder_projector.bias"], raw, FRAME_STD
    )
    encoder["encoder_projector.weight"], encoder["encoder_projector.bias"] = w, b

    head = rnnt["joint.head.weight"]
    rnnt["joint.head.weight"] = (head - head.mean(axis=1, keepdims=True)).astype(np.float32)

    probe = _ProbeDecoder(spec, frames, rnnt)
    target = tokens_per_second * PROBE_SECONDS
    # Random decoders are bistable (once emitting they tend to keep emitting), so the count is not
    # monotonic in the shift: scan a grid, then narrow down around the grid point nearest the target.
    grid = np.linspace(-5.0, 15.0, 41)
    counts = [len(probe.decode(float(s))) for s in grid]
    best = int(np.argmin([abs(n - target) for n in counts]))
    lo, hi = float(grid[max(0, best - 1)]), float(grid[min(len(grid) - 1, best + 1)])
    shift, count = float(grid[best]), counts[best]
    for _ in range(12):
        for s in (0.5 * (lo + shift), 0.5 * (shift + hi)):
            n = len(probe.decode(s))
            if abs(n - target) < abs(count - target):
                shift, count = s, n
        lo, hi = 0.5 * (lo + shift), 0.5 * (shift + hi)
    shift = float(np.float32(shift))
    rnnt["joint.head.bias"] = rnnt["joint.head.bias"].copy()
    rnnt["joint.head.bias"][spec.blank_id] += np.float32(shift)
    emitted = probe.decode(shift)
    per_frame = np.bincount([t for t, _ in emitted], minlength=1)
    return Calibration(
        blank_shift=shift,
        tokens_per_second=len(emitted) / PROBE_SECONDS,
        distinct_tokens=len({k for _, k in emitted}),
        max_tokens_per_frame=int(per_frame.max()),
    )


def random_bundle_weights(
    spec: ModelSpec,
    seed: int,
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND,
    calibration: str = "probe",
    precision: str = "f32",
) -> tuple[BundleWeights, dict[str, object]]:
    """Drawn weights, calibrated with the probe signal (`calibrate`) or on telephone speech
    (tools/bundle/speechlike.py, `precision` for its encoder pass); also the calibration's report."""
    # All encoder tensors at once: the calibration runs the encoder (2.4 GB in f32 at full size).
    encoder = dict(random_encoder_tensors(spec, seed))
    rnnt = random_rnnt_weights(spec, seed)
    metadata = {"weights": "random", "seed": str(seed)}
    if calibration == "speech":
        from tools.bundle.speechlike import calibrate_speech

        speech = calibrate_speech(spec, encoder, rnnt, seed, tokens_per_second, precision)
        metadata |= speech.metadata()
        report = speech.report()
    elif calibration == "probe":
        cal = calibrate(spec, encoder, rnnt, tokens_per_second)
        metadata["probe_tokens_per_second"] = f"{cal.tokens_per_second:.2f}"
        report = {"method": "probe", "probe_tokens_per_second": round(cal.tokens_per_second, 2)}
    else:
        raise ValueError(f"calibration must be 'probe' or 'speech', not {calibration!r}")
    weights = BundleWeights(encoder=lambda: iter(encoder.items()), rnnt=rnnt, metadata=metadata)
    return weights, report
