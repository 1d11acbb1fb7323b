"""Train the demo FastConformer-RNNT on the packed espeak-ng corpus, within a wall-clock budget.

    python3 tools/demo_model/train.py --data var/demo/carry --out OUT [--budget-minutes 8] [--resume DIR]
    python3 tools/demo_model/train.py --data var/demo/carry --out /tmp/smoke --smoke      # CPU, seconds

Made to run as a plain script on the lent GPU machine (torch, transformers, numpy, safetensors,
sentencepiece; no network, no project install): besides those it imports only numpy-only modules of the
repository (`tools.demo_model`, the gateway's G.711 tables, the bundle spec). Data is read from
`--data` (train/dev/test .npz, tokenizer.model, melfilters.f32).

Each step: a batch of clips (bucketed by length, some pairs joined into one longer utterance) goes
through a random telephone channel and speed change in the loader workers (numpy), then on the device
8 -> 16 kHz, the exact log-mel, SpecAugment, the encoder with chunked_limited attention at a lookahead
drawn from {3, 0, 6, 13} (3 half the time), the language prompt of the clip (en-US 0, uk-UA 19, or
auto 101 for a fifth of the clips), and the RNN-T loss plus an auxiliary CTC loss on the conformer
output (`--ctc-weight`, a training-only head). Convolutions, linear layers and LSTMs start from PyTorch's
default initialization (`model.init_from_scratch`; transformers' N(0, 0.02) starves the encoder of audio).
AdamW, warm-up then cosine decay over the planned training time (`--schedule-minutes`, counted across
resumed runs).

Out (`--out`, 4 files, 23.9 MiB in all, each part <= 15 MiB): train_log.json (config, losses, timings,
dev/test WER at lookahead 3 with example transcripts, dev loss with and without the audio, the
torchaudio loss check), model.safetensors.part-00..01 (f32 weights with HF names and the progress) and
ctc_head.safetensors.part-00 (0.2 MiB, the auxiliary CTC head, only for resuming).
`--save-optimizer` adds adam.safetensors.part-00..03 (AdamW moments, 49 MiB: more than the device
transfer limit leaves room for). `--resume DIR` reassembles the parts; without the adam parts the moments
restart and the LR ramps up again over 100 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tools.demo_model` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from tools.demo_model import augment, data, frontend
from tools.demo_model.model import (
    LOOKAHEADS,
    PROMPTS,
    DemoConfig,
    build_model,
    encode,
    encode_with_hidden,
    export_state,
    greedy_decode,
    init_from_scratch,
    joint_lattice,
    normalize_stem,
)
from tools.demo_model.rnnt_loss import rnnt_loss

PART_BYTES = 15 * 1024 * 1024
TINY_CONFIG = DemoConfig(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    intermediate_size=64,
    subsampling_channels=8,
    decoder_hidden=32,
    prompt_intermediate=48,
)
# Big enough to learn a handful of clips on a CPU in minutes (diagnostics: does training read the audio?).
SMALL_CONFIG = DemoConfig(
    hidden_size=96,
    num_layers=2,
    num_heads=2,
    intermediate_size=192,
    subsampling_channels=32,
    decoder_hidden=128,
    prompt_intermediate=128,
)
MODEL_SIZES = {"full": DemoConfig(), "small": SMALL_CONFIG, "tiny": TINY_CONFIG}
MODEL_FILE = "model.safetensors"
ADAM_FILE = "adam.safetensors"
CTC_FILE = "ctc_head.safetensors"
CTC_PREFIX = "ctc_head."
REWARM_STEPS = 100  # LR ramp after resuming without AdamW moments
# The wall-clock budget counts from here (after torch's import, a few seconds: keep them in the margin).
STARTED = time.monotonic()


# --- data ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Item:
    clips: tuple[int, ...]  # one clip, or several of one language joined with short pauses
    seconds: float


GAP_S = 0.6  # the most a pause between joined clips takes (TrainBatches draws 0.2-0.6 s)
PAD_S = 0.7  # what the telephone channel adds around an item on average (0.05-0.6 s each side)


def plan_batches(
    split: data.Split,
    rng: random.Random,
    batch_seconds: float,
    single_share: float,
    item_seconds: tuple[float, float],
) -> list[list[Item]]:
    """One epoch: items bucketed by length into batches whose padded audio stays under `batch_seconds`;
    batch order shuffled.

    An item is one clip (a `single_share` of the clips) or a run of clips of one language joined with
    short pauses until it reaches a length drawn from `item_seconds`. Long items are what makes the
    encoder listen: the causal convolutions' zero padding and the attention window's edge tell every
    frame of the first ~4 s how far it is from the start, and in short clips of regular espeak speech that
    position alone predicts the template's words well enough that the conformer learned a clock instead
    of the audio (GPU runs 1 and 2). Past the first seconds of a long item, only the audio tells the words.
    """
    order = list(range(len(split)))
    rng.shuffle(order)
    seconds = [len(c) / 8000 for c in split.clips]
    items: list[Item] = []
    open_items: dict[str, tuple[list[int], float, float]] = {}  # lang -> (clips, seconds, target)
    for i in order:
        lang = split.langs[i]
        if rng.random() < single_share:
            items.append(Item((i,), seconds[i] + PAD_S))
            continue
        clips, length, target = open_items.pop(lang, ([], PAD_S - GAP_S, rng.uniform(*item_seconds)))
        if clips and length + GAP_S + seconds[i] > item_seconds[1]:
            items.append(Item(tuple(clips), length))
            clips, length, target = [], PAD_S - GAP_S, rng.uniform(*item_seconds)
        clips, length = [*clips, i], length + GAP_S + seconds[i]
        if length >= target:
            items.append(Item(tuple(clips), length))
        else:
            open_items[lang] = (clips, length, target)
    items += [Item(tuple(clips), length) for clips, length, _ in open_items.values()]
    items.sort(key=lambda it: it.seconds)
    batches: list[list[Item]] = []
    current: list[Item] = []
    for it in items:
        if current and (len(current) + 1) * it.seconds > batch_seconds:
            batches.append(current)
            current = []
        current.append(it)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def speed_perturb(audio: np.ndarray, factor: float) -> np.ndarray:
    """Play `factor` times faster (tempo and pitch together), by linear interpolation at 8 kHz."""
    n_out = max(int(len(audio) / factor), 1)
    return np.interp(np.arange(n_out) * factor, np.arange(len(audio)), audio).astype(np.float32)


class TrainBatches(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Batch k of the plan -> augmented 8 kHz audio + labels. Deterministic per (seed, k)."""

    def __init__(
        self,
        split: data.Split,
        tokens: list[list[int]],
        plan: list[list[Item]],
        seed: int,
        auto_share: float,
        augment_strength: float,
    ) -> None:
        self.split, self.tokens, self.plan, self.seed = split, tokens, plan, seed
        self.auto_share, self.strength = auto_share, augment_strength

    def __len__(self) -> int:
        return len(self.plan)

    def _babble(self, rng: np.random.Generator, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        for _ in range(3):
            clip = self.split.clips[int(rng.integers(len(self.split)))]
            start = int(rng.integers(0, max(n - len(clip), 1)))
            seg = clip[: n - start]
            out[start : start + len(seg)] += seg
        return out

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, k])
        audios, labels, prompts = [], [], []
        for item in self.plan[k]:
            parts: list[np.ndarray] = []
            label: list[int] = []
            for n, idx in enumerate(item.clips):
                if n:
                    parts.append(np.zeros(int(rng.uniform(0.2, 0.6) * 8000), np.float32))
                parts.append(self.split.clips[idx])
                label += self.tokens[idx]
            audio = np.concatenate(parts)
            if rng.random() < 0.5 * self.strength:
                audio = speed_perturb(audio, float(rng.uniform(0.9, 1.1)))
            audio = augment.telephone_channel(
                audio, rng, 8000, babble=self._babble(rng, 4000), strength=self.strength
            )
            audios.append(audio)
            labels.append(label)
            lang = self.split.langs[item.clips[0]]
            prompts.append(PROMPTS["auto"] if rng.random() < self.auto_share else PROMPTS[lang])
        return collate(audios, labels, prompts)


def collate(audios: list[np.ndarray], labels: list[list[int]], prompts: list[int]) -> dict[str, torch.Tensor]:
    n = max(len(a) for a in audios)
    u = max(max((len(x) for x in labels), default=1), 1)
    audio = np.zeros((len(audios), n), np.float32)
    target = np.zeros((len(audios), u), np.int64)
    for i, (a, y) in enumerate(zip(audios, labels, strict=True)):
        audio[i, : len(a)] = a
        target[i, : len(y)] = y
    return {
        "audio": torch.from_numpy(audio),
        "audio_len": torch.tensor([len(a) for a in audios]),
        "targets": torch.from_numpy(target),
        "target_len": torch.tensor([len(y) for y in labels]),
        "prompts": torch.tensor(prompts),
    }


# --- evaluation ----------------------------------------------------------------------------------


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def error_rates(refs: list[str], hyps: list[str]) -> dict[str, float]:
    words = sum(len(r.split()) for r in refs)
    chars = sum(len(r) for r in refs)
    wer = sum(edit_distance(r.split(), h.split()) for r, h in zip(refs, hyps, strict=True)) / max(words, 1)
    cer = sum(edit_distance(list(r), list(h)) for r, h in zip(refs, hyps, strict=True)) / max(chars, 1)
    return {"wer": round(wer, 4), "cer": round(cer, 4), "utterances": len(refs), "words": words}


class Frontend:
    def __init__(self, filters: np.ndarray, device: torch.device | str) -> None:
        self.up = frontend.Upsampler(device)
        self.mel = frontend.LogMel(filters, device)

    def __call__(self, audio: torch.Tensor, audio_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mel(self.up(audio), 2 * audio_len)


LossFn = Any  # (logits, targets, logit_lengths, target_lengths, blank) -> per-utterance NLL


def ours_loss(
    logits: torch.Tensor, targets: torch.Tensor, enc_len: torch.Tensor, target_len: torch.Tensor, blank: int
) -> torch.Tensor:
    return rnnt_loss(logits.float(), targets, enc_len, target_len, blank, reduction="none")


@dataclass(frozen=True, slots=True)
class BatchLoss:
    rnnt: torch.Tensor  # (B,) RNN-T NLL per utterance
    target_len: torch.Tensor  # (B,)
    ctc: torch.Tensor | None = None  # (B,) CTC NLL of the auxiliary head, when one is given


def batch_nll(
    model: Any,
    fe: Frontend,
    batch: dict[str, torch.Tensor],
    lookahead: int,
    blank: int,
    device: torch.device,
    loss_fn: LossFn = ours_loss,
    spec_gen: torch.Generator | None = None,
    amp: Any = None,
    ctc_head: torch.nn.Module | None = None,
    history_noise: float = 0.0,
) -> BatchLoss:
    """8 kHz batch -> per-utterance losses: the training step's forward (SpecAugment when `spec_gen` is
    given, the auxiliary CTC loss when `ctc_head` is, noisy prediction-network history when
    `history_noise` > 0: `model.joint_lattice`), also used for the dev loss."""
    mel, frames = fe(batch["audio"].to(device, non_blocking=True), batch["audio_len"].to(device))
    if spec_gen is not None:
        mel = frontend.spec_augment(mel, frames, spec_gen)
    targets = batch["targets"].to(device)
    target_len = batch["target_len"].to(device)
    enc_len = frontend.encoder_frames(frames)
    with amp if amp is not None else torch.autocast(device.type, enabled=False):
        enc, hidden = encode_with_hidden(model, mel, frames, batch["prompts"].to(device), lookahead)
        logits = joint_lattice(model, enc, targets, blank, history_noise, spec_gen)
        ctc_logits = ctc_head(hidden) if ctc_head is not None else None
    ctc = None
    if ctc_logits is not None:
        log_probs = torch.log_softmax(ctc_logits.float(), dim=-1).transpose(0, 1)  # (T', B, V)
        ctc = torch.nn.functional.ctc_loss(
            log_probs, targets, enc_len, target_len, blank=blank, reduction="none", zero_infinity=True
        )
    return BatchLoss(loss_fn(logits, targets, enc_len, target_len, blank), target_len, ctc)


@torch.no_grad()
def evaluate(
    model: Any,
    fe: Frontend,
    split: data.Split,
    sp: Any,
    blank: int,
    device: torch.device,
    lookahead: int,
    batch: int = 64,
    limit: int | None = None,
    loss: bool = False,
    zero_audio_loss: bool = False,
) -> dict[str, Any]:
    """Greedy WER/CER on a split (as stored: the test split is already a G.711 call), prompts forced.

    With `loss`, also the RNN-T loss per label token of the split ("loss"), and with `zero_audio_loss`
    the same loss with every clip silenced ("loss_zero_audio"): a model that reads the audio scores far
    better on the real clips; one that only learned the label language model scores the same on both."""
    model.eval()
    n = len(split) if limit is None else min(limit, len(split))
    hyps: list[str] = []
    nll_sum = {"loss": 0.0, "loss_zero_audio": 0.0}
    token_sum = 0
    for s in range(0, n, batch):
        idx = list(range(s, min(s + batch, n)))
        labels = [sp.encode(split.texts[i]) for i in idx] if loss else [[0] for _ in idx]
        b = collate([split.clips[i] for i in idx], labels, [PROMPTS[split.langs[i]] for i in idx])
        mel, frames = fe(b["audio"].to(device), b["audio_len"].to(device))
        enc = encode(model, mel, frames, b["prompts"].to(device), lookahead)
        for ids in greedy_decode(model, enc.float(), frontend.encoder_frames(frames), blank):
            hyps.append(sp.decode(ids))
        if loss:
            real = batch_nll(model, fe, b, lookahead, blank, device)
            nll_sum["loss"] += float(real.rnnt.sum())
            token_sum += int(real.target_len.sum())
            if zero_audio_loss:
                silent = dict(b, audio=torch.zeros_like(b["audio"]))
                nll_sum["loss_zero_audio"] += float(
                    batch_nll(model, fe, silent, lookahead, blank, device).rnnt.sum()
                )
    refs = split.texts[:n]
    out: dict[str, Any] = {"all": error_rates(refs, hyps)}
    if loss:
        out["loss"] = round(nll_sum["loss"] / max(token_sum, 1), 4)
        if zero_audio_loss:
            out["loss_zero_audio"] = round(nll_sum["loss_zero_audio"] / max(token_sum, 1), 4)
    for lang in sorted(set(split.langs[:n])):
        sel = [i for i in range(n) if split.langs[i] == lang]
        out[lang] = error_rates([refs[i] for i in sel], [hyps[i] for i in sel])
    out["examples"] = [{"ref": refs[i], "hyp": hyps[i]} for i in range(min(4, n))]
    model.train()
    return out


# --- checkpoint ----------------------------------------------------------------------------------


def _write_parts(out: Path, name: str, blob: bytes) -> list[str]:
    """`blob` as `name.part-NN` files of at most PART_BYTES (atomic renames; stale parts removed)."""
    parts = []
    for n, start in enumerate(range(0, len(blob), PART_BYTES)):
        part = f"{name}.part-{n:02d}"
        tmp = out / f".{part}.tmp"
        tmp.write_bytes(blob[start : start + PART_BYTES])
        os.replace(tmp, out / part)
        parts.append(part)
    for stale in out.glob(f"{name}.part-*"):
        if stale.name not in parts:
            stale.unlink()
    return parts


def _read_parts(folder: Path, name: str) -> bytes | None:
    if (folder / name).exists():
        return (folder / name).read_bytes()
    parts = sorted(folder.glob(f"{name}.part-*"))
    return b"".join(p.read_bytes() for p in parts) if parts else None


def _metadata(blob: bytes) -> dict[str, str]:
    header_len = int.from_bytes(blob[:8], "little")
    meta: dict[str, str] = json.loads(blob[8 : 8 + header_len]).get("__metadata__", {})
    return meta


def _named_parameters(model: Any, ctc_head: torch.nn.Module | None) -> list[tuple[str, torch.nn.Parameter]]:
    named = list(model.named_parameters())
    if ctc_head is not None:
        named += [(f"{CTC_PREFIX}{k}", p) for k, p in ctc_head.named_parameters()]
    return named


def is_head(name: str) -> bool:
    """Parameters between the conformer and the joint's output: the prompt, the encoder projector, the
    joint and the auxiliary CTC head (not the encoder, not the prediction network)."""
    return not name.startswith(("encoder.", "decoder."))


def param_groups(
    named: list[tuple[str, torch.nn.Parameter]], weight_decay: float, head_lr_scale: float
) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices but not on biases, norms and embeddings; `lr_scale` (the
    training loop multiplies the scheduled LR by it) `head_lr_scale` for the head (`is_head`).
    Why: the full model's conformer collapses at LR 2e-3, and at 5e-4 its joint learns to use the
    encoder output more slowly than the prediction network learns the label language model; LR 1e-3 with
    the head at 2x trained best (docs/demo-model.md, Training point 4, run 7)."""
    groups = []
    for head in (False, True):
        for decay in (True, False):
            params = [
                p for n, p in named if is_head(n) == head and (p.ndim >= 2 and "embedding" not in n) == decay
            ]
            if params:
                groups.append(
                    {
                        "params": params,
                        "weight_decay": weight_decay if decay else 0.0,
                        "lr_scale": head_lr_scale if head else 1.0,
                    }
                )
    return groups


def save_checkpoint(
    out: Path,
    model: Any,
    opt: torch.optim.Optimizer | None,
    progress: dict[str, Any],
    ctc_head: torch.nn.Module | None = None,
) -> list[str]:
    """model.safetensors (f32, HF names, progress in the metadata) and, with `opt`, adam.safetensors
    (AdamW moments), each cut into parts. Two files so that a resumed run can carry the weights without
    the moments. Without `opt`, adam parts left by an earlier save in `out` are removed. The training-only
    CTC head goes to its own small ctc_head.safetensors (the model file keeps exactly the HF names)."""
    from safetensors.torch import save

    weights = {k: v.detach().float().contiguous().cpu() for k, v in export_state(model).items()}
    moments: dict[str, torch.Tensor] = {}
    steps = {}
    names = {id(p): k for k, p in _named_parameters(model, ctc_head)}
    state = opt.state if opt is not None else {}
    for group in opt.param_groups if opt is not None else []:
        for p in group["params"]:
            st = state.get(p)
            if st:
                k = names[id(p)]
                moments[f"exp_avg.{k}"] = st["exp_avg"].float().contiguous().cpu()
                moments[f"exp_avg_sq.{k}"] = st["exp_avg_sq"].float().contiguous().cpu()
                steps[k] = float(st["step"])
    parts = _write_parts(out, MODEL_FILE, save(weights, metadata={"progress": json.dumps(progress)}))
    if ctc_head is not None:
        head = {k: v.detach().float().contiguous().cpu() for k, v in ctc_head.state_dict().items()}
        parts += _write_parts(out, CTC_FILE, save(head))
    if moments:
        parts += _write_parts(out, ADAM_FILE, save(moments, metadata={"steps": json.dumps(steps)}))
    else:
        for stale in out.glob(f"{ADAM_FILE}.part-*"):
            stale.unlink()
    return parts


def read_ctc_head(folder: Path) -> dict[str, torch.Tensor] | None:
    """The auxiliary CTC head's weights saved with a checkpoint, if any."""
    from safetensors.torch import load

    blob = _read_parts(folder, CTC_FILE)
    return None if blob is None else load(blob)


def read_checkpoint(
    folder: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor], dict[str, float]]:
    """(model state dict, progress, AdamW moments or {}, AdamW step counts) from `folder`."""
    from safetensors.torch import load

    blob = _read_parts(folder, MODEL_FILE)
    if blob is None:
        raise FileNotFoundError(f"no {MODEL_FILE} or {MODEL_FILE}.part-NN in {folder}")
    progress = json.loads(_metadata(blob).get("progress", "{}"))
    adam = _read_parts(folder, ADAM_FILE)
    if adam is None:
        return load(blob), progress, {}, {}
    return load(blob), progress, load(adam), json.loads(_metadata(adam).get("steps", "{}"))


def mel_stats(split: data.Split, filters: np.ndarray, clips: int = 200) -> tuple[float, float]:
    """Mean and standard deviation of the log-mel of the first `clips` clips (G.711, no channel)."""
    fe = Frontend(filters, "cpu")
    values = []
    for audio in split.clips[:clips]:
        b = collate([audio], [[0]], [0])
        mel, frames = fe(b["audio"], b["audio_len"])
        values.append(mel[0, : int(frames[0])].flatten())
    v = torch.cat(values)
    return round(float(v.mean()), 3), round(float(v.std()), 3)


def _first(split: data.Split, n: int) -> data.Split:
    return data.Split(split.clips[:n], split.texts[:n], split.langs[:n], split.uids[:n])


# --- training ------------------------------------------------------------------------------------


def check_torchaudio(device: torch.device, blank: int, vocab: int) -> dict[str, Any]:
    """Compare our loss with torchaudio's on a random case (when torchaudio has rnnt_loss).

    Every target length is >= 1: torchaudio's CUDA kernel never writes the cost of an utterance with an
    empty target (ComputeBetasCosts returns at once for u = U - 2 < 0), so the loss it reports there is
    whatever the output buffer held (run 1: -2.76, a negative NLL; ours gave 30.56 = -sum of the 5 blank
    log-probabilities, as the textbook recursion). Training labels are never empty; that case is logged
    under "empty_target" for the record."""
    try:
        from torchaudio.functional import rnnt_loss as ta_loss
    except Exception as exc:  # ImportError, or a torchaudio without the op
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:200]}
    g = torch.Generator().manual_seed(0)
    b, t, u = 4, 23, 9
    logits = torch.randn(b, t, u + 1, vocab, generator=g).to(device)
    targets = torch.randint(0, vocab - 1, (b, u), generator=g).to(device)
    tl = torch.tensor([23, 20, 11, 5], device=device)
    ul = torch.tensor([9, 7, 3, 1], device=device)
    ours = rnnt_loss(logits, targets, tl, ul, blank, reduction="none")
    try:
        theirs = ta_loss(logits, targets.int(), tl.int(), ul.int(), blank=blank, reduction="none")
    except Exception as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:200]}
    diff = float((ours - theirs).abs().max())
    out: dict[str, Any] = {
        "available": True,
        "max_abs_diff": diff,
        "ours": ours.tolist(),
        "torchaudio": theirs.tolist(),
        "agree": diff < 1e-3 * max(1.0, float(theirs.abs().max())),
    }
    # The empty-target case, for the record (5 frames, no label: NLL = -sum of 5 blank log-probs).
    one, frames, empty = logits[3:4, :5, :1].contiguous(), tl[3:4].clamp(max=5), torch.zeros_like(ul[3:4])
    try:
        ta_empty = float(ta_loss(one, targets[3:4, :0].int(), frames.int(), empty.int(), blank=blank)[()])
    except Exception as exc:
        ta_empty = f"{type(exc).__name__}: {exc}"[:200]  # type: ignore[assignment]
    ours_empty = float(rnnt_loss(one, targets[3:4, :0], frames, empty, blank, reduction="none")[0])
    out["empty_target"] = {"ours": ours_empty, "torchaudio": ta_empty}
    return out


def rnnt_weight(step: int, ctc_only_steps: int) -> float:
    """Weight of the RNN-T loss at `step`: 0 while the encoder learns alone from CTC, then a linear ramp.

    CTC can only be lowered by reading the audio; RNN-T can also be lowered by the prediction network
    learning the label language model, and from scratch on templated sentences that is the easier way
    down (GPU runs 1 and 2 ended with an encoder that ignored the audio). Giving the encoder a head start
    means the joint meets an encoder that already carries the words."""
    if step < ctc_only_steps:
        return 0.0
    return min(1.0, (step - ctc_only_steps + 1) / max(ctc_only_steps, 1))


def lr_at(progress: float, peak: float, warmup: float) -> float:
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    x = min((progress - warmup) / max(1 - warmup, 1e-6), 1.0)
    return peak * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * x)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data",
        type=Path,
        required=True,
        help="folder with train/dev/test.npz, tokenizer.model, melfilters.f32",
    )
    p.add_argument(
        "--extra-train",
        type=Path,
        nargs="*",
        default=[],
        help="further training sets (corpus shards: shard<k>/train.npz), joined to --data's train.npz",
    )
    p.add_argument(
        "--only-extra-train",
        action="store_true",
        help="train on the --extra-train sets alone (--data then brings dev, test, tokenizer and filters)",
    )
    p.add_argument(
        "--test",
        type=Path,
        default=None,
        help="set scored beside dev at each evaluation (default: --data's test.npz, the carried "
        "held-out clips)",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--resume", type=Path, default=None, help="folder with a previous run's model (and adam) parts"
    )
    p.add_argument("--budget-minutes", type=float, default=8.0, help="wall clock for this run incl. start-up")
    p.add_argument(
        "--schedule-minutes",
        type=float,
        default=None,
        help="training time the LR schedule spans, across resumed runs (default: this run's)",
    )
    p.add_argument("--batch-seconds", type=float, default=480.0, help="padded audio seconds per batch")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=float, default=0.08, help="warm-up share of the schedule")
    p.add_argument(
        "--head-lr-scale",
        type=float,
        default=1.0,
        help="LR multiplier for the prompt, encoder projector, joint and CTC head (encoder, prediction "
        "network: --lr)",
    )
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument(
        "--single-share",
        type=float,
        default=0.15,
        help="share of clips trained alone; the others are joined into long items (--item-seconds)",
    )
    p.add_argument(
        "--item-seconds",
        default="6,16",
        help="MIN,MAX seconds of joined items (beyond the ~4 s in which the encoder can tell the start)",
    )
    p.add_argument(
        "--auto-share", type=float, default=0.2, help="share of clips trained with the auto prompt"
    )
    p.add_argument(
        "--ctc-weight",
        type=float,
        default=0.5,
        help="weight of the auxiliary CTC loss on the conformer output (0: RNN-T only)",
    )
    p.add_argument(
        "--ctc-only-steps",
        type=int,
        default=300,
        help="steps at the start trained on the CTC loss alone (RNN-T then ramps in over as many again)",
    )
    p.add_argument(
        "--curriculum-steps",
        type=int,
        default=600,
        help="steps (rounded up to an epoch) on single clips, line silence + G.711 only, no SpecAugment",
    )
    p.add_argument(
        "--no-normalize-stem",
        dest="normalize_stem",
        action="store_false",
        help="train conv_in on raw log-mel (default: as if on normalized log-mel, model.normalize_stem)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on CUDA (default: f32)")
    p.add_argument("--augment", type=float, default=1.0, help="telephone-channel strength 0..1")
    p.add_argument(
        "--history-noise",
        type=float,
        default=0.0,
        help="share of the labels the prediction network reads, replaced by random pieces (joint_lattice)",
    )
    p.add_argument("--lookahead-weights", default="3:0.5,0:0.15,6:0.2,13:0.15")
    p.add_argument("--workers", type=int, default=min(12, max((os.cpu_count() or 2) - 2, 0)))
    p.add_argument(
        "--loss",
        choices=("ours", "torchaudio", "auto"),
        default="ours",
        help="RNN-T loss: ours (tested against the textbook recursion), torchaudio's op, or auto "
        "(torchaudio when it agrees with ours on the start-up check)",
    )
    p.add_argument(
        "--save-optimizer",
        action="store_true",
        help="also save the AdamW moments (adam.safetensors.part-*, 49 MiB) for an exact resume",
    )
    p.add_argument("--save-every-minutes", type=float, default=2.0)
    p.add_argument("--eval-every-minutes", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--smoke", action="store_true", help="tiny subset, a few steps, CPU-sized: checks the whole script"
    )
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N training clips")
    p.add_argument("--dev-limit", type=int, default=None, help="evaluate on the first N dev (and test) clips")
    p.add_argument(
        "--model-size",
        choices=tuple(MODEL_SIZES),
        default="full",
        help="full: the shipped demo model; small: CPU diagnostics; tiny: tests of the script only",
    )
    p.add_argument("--tiny-model", action="store_true", help="same as --model-size tiny")
    p.add_argument(
        "--reserve-seconds",
        type=float,
        default=None,
        help="end of the budget kept for the final checkpoint + evaluation (default 25 s, smoke 5 s)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.max_steps = args.max_steps or 3
        args.batch_seconds = min(args.batch_seconds, 40.0)
        args.workers = 0
        args.budget_minutes = min(args.budget_minutes, 5.0)
    import sentencepiece as spm

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    sp = spm.SentencePieceProcessor(model_file=str(args.data / "tokenizer.model"))
    vocab = sp.get_piece_size() + 1
    blank = vocab - 1
    filters = np.fromfile(args.data / "melfilters.f32", dtype="<f4").reshape(128, 257)

    train_sets = [*([] if args.only_extra_train else [args.data / "train.npz"]), *args.extra_train]
    if not train_sets:
        raise SystemExit("--only-extra-train needs --extra-train")
    train = data.join_splits([data.load_split(p) for p in train_sets])
    dev = data.load_split(args.data / "dev.npz")
    if args.test is not None and not args.test.exists():
        raise SystemExit(f"--test: no such file {args.test}")
    test_path = args.test or args.data / "test.npz"
    test = data.load_split(test_path) if test_path.exists() else None
    if args.smoke:
        train, dev = _first(train, 48), _first(dev, 8)
        test = None if test is None else _first(test, 8)
    if args.train_limit is not None:
        train = _first(train, args.train_limit)
    if args.dev_limit is not None:
        dev = _first(dev, args.dev_limit)
        test = None if test is None else _first(test, args.dev_limit)
    tokens = [sp.encode(t) for t in train.texts]
    if not all(tokens):
        raise SystemExit("every training clip needs a non-empty label")

    cfg = MODEL_SIZES["tiny" if args.tiny_model else args.model_size]
    model = init_from_scratch(build_model(cfg, vocab, training=True)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # Auxiliary CTC on the conformer output (training only, as NeMo's hybrid RNNT-CTC models): it makes
    # the encoder carry the words from the first steps, before the prediction network has learned the
    # label language model that otherwise lets RNN-T training ignore the audio.
    ctc_head = torch.nn.Linear(cfg.hidden_size, vocab).to(device) if args.ctc_weight > 0 else None
    progress: dict[str, Any] = {"step": 0, "trained_seconds": 0.0, "runs": 0, "batches_seen": 0}
    moments: dict[str, torch.Tensor] = {}
    adam_steps: dict[str, float] = {}
    if args.resume is not None:
        state, progress, moments, adam_steps = read_checkpoint(args.resume)
        model.load_state_dict(state)
        head_state = read_ctc_head(args.resume)
        if ctc_head is not None and head_state is not None:
            ctc_head.load_state_dict(head_state)
    stem_stats = mel_stats(train, filters) if args.normalize_stem else None
    if stem_stats is not None:  # after loading: the parametrization starts from the loaded conv_in
        normalize_stem(model, *stem_stats, reinit=args.resume is None)
    named = _named_parameters(model, ctc_head)
    opt = torch.optim.AdamW(
        param_groups(named, args.weight_decay, args.head_lr_scale), lr=args.lr, betas=(0.9, 0.98), eps=1e-9
    )
    for k, p in named:
        if f"exp_avg.{k}" in moments:
            opt.state[p] = {
                "step": torch.tensor(adam_steps.get(k, 0.0)),
                "exp_avg": moments[f"exp_avg.{k}"].to(device),
                "exp_avg_sq": moments[f"exp_avg_sq.{k}"].to(device),
            }
    rewarm = REWARM_STEPS if args.resume is not None and not moments else 0
    budget_s = args.budget_minutes * 60
    # final checkpoint + evaluation: ~5 s on the H200 (run 1), longer on a CPU
    reserve_s = args.reserve_seconds if args.reserve_seconds is not None else (5.0 if args.smoke else 25.0)
    run_train_s = max(budget_s - reserve_s - (time.monotonic() - STARTED), 1.0)
    schedule_s = (
        args.schedule_minutes * 60 if args.schedule_minutes else progress["trained_seconds"] + run_train_s
    )

    ta = check_torchaudio(device, blank, vocab)
    use_ta = args.loss == "torchaudio" or (args.loss == "auto" and ta.get("agree", False))
    loss_fn: LossFn = ours_loss
    if use_ta:
        from torchaudio.functional import rnnt_loss as ta_loss

        def loss_fn(
            logits: torch.Tensor,
            targets: torch.Tensor,
            enc_len: torch.Tensor,
            target_len: torch.Tensor,
            blank: int,
        ) -> torch.Tensor:
            return ta_loss(
                logits.float(), targets.int(), enc_len.int(), target_len.int(), blank=blank, reduction="none"
            )

    lo_s, hi_s = (float(x) for x in args.item_seconds.split(","))
    item_seconds = (lo_s, hi_s)
    weights = [tuple(x.split(":")) for x in args.lookahead_weights.split(",")]
    la_values = [int(a) for a, _ in weights]
    la_probs = [float(b) for _, b in weights]
    if not set(la_values) <= set(LOOKAHEADS):
        raise SystemExit(f"lookaheads must be among {LOOKAHEADS}")
    la_rng = random.Random(args.seed + 7 + progress["runs"])
    spec_gen = torch.Generator().manual_seed(args.seed + progress["runs"])
    fe = Frontend(filters, device)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and args.bf16
        else torch.autocast(device.type, enabled=False)
    )

    log: dict[str, Any] = {
        "config": cfg.to_dict(),
        "vocab_size": vocab,
        "params": n_params,
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "torchaudio_check": ta,
        "loss": "torchaudio" if use_ta else "ours",
        "data": {
            "train_utts": len(train),
            "train_sets": [str(p) for p in train_sets],
            "train_hours": round(train.seconds() / 3600, 3),
            "dev_utts": len(dev),
            "test_utts": len(test) if test else 0,
        },
        "resumed_from": dict(progress) if args.resume else None,
        "stem_normalization": None if stem_stats is None else {"mean": stem_stats[0], "std": stem_stats[1]},
        "schedule_seconds": schedule_s,
        "steps": [],
        "evals": [],
    }
    import transformers

    log["transformers"] = transformers.__version__
    log["hf_config"] = cfg.hf_config(vocab, training=False)

    def write_log() -> None:
        tmp = args.out / ".train_log.json.tmp"
        tmp.write_text(json.dumps(log, indent=1, ensure_ascii=False) + "\n")
        os.replace(tmp, args.out / "train_log.json")

    def run_eval(tag: str, trained_seconds: float) -> None:
        t0 = time.monotonic()
        entry: dict[str, Any] = {
            "tag": tag,
            "step": progress["step"],
            "trained_seconds": round(trained_seconds, 1),
        }
        # Dev loss with the audio and with silence instead: the gap shows the encoder is being listened to.
        entry["dev"] = evaluate(model, fe, dev, sp, blank, device, 3, loss=True, zero_audio_loss=True)
        if test is not None:
            entry["test"] = evaluate(model, fe, test, sp, blank, device, 3)
        entry["seconds"] = round(time.monotonic() - t0, 1)
        log["evals"].append(entry)
        d = entry["dev"]
        print(
            f"[eval {tag}] step {progress['step']} dev {d['all']} dev loss {d['loss']} "
            f"(audio zeroed: {d['loss_zero_audio']})"
            + (f" test {entry['test']['all']}" if test is not None else ""),
            flush=True,
        )
        for split_name in ("dev", "test") if test is not None else ("dev",):
            for ex in entry[split_name]["examples"]:
                print(f"  {split_name} ref: {ex['ref']}\n  {split_name} hyp: {ex['hyp'][:160]}", flush=True)
        write_log()

    model.train()
    epoch_rng = random.Random(args.seed * 1000 + progress["runs"])
    run_start = time.monotonic()
    last_save = last_eval = run_start
    done = False
    epoch = 0
    loss_window: list[float] = []
    ctc_window: list[float] = []
    print(
        f"params {n_params:,}  vocab {vocab}  train {len(train)} utts / {train.seconds() / 3600:.2f} h  "
        f"device {log['device']}  loss {log['loss']}  budget {budget_s:.0f}s",
        flush=True,
    )
    first_step = progress["step"]
    while not done:
        # Curriculum: short single clips in a clean channel first (CTC learns to align on them), then the
        # long joined items, the full telephone channel and SpecAugment.
        easy = progress["step"] < args.curriculum_steps
        plan = plan_batches(
            train, epoch_rng, args.batch_seconds, 1.0 if easy else args.single_share, item_seconds
        )
        ds = TrainBatches(
            train,
            tokens,
            plan,
            args.seed * 100_003 + progress["batches_seen"],
            args.auto_share,
            0.0 if easy else args.augment,
        )
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=None,
            shuffle=False,
            num_workers=args.workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=4 if args.workers else None,
        )
        for batch in loader:
            t_step = time.monotonic()
            elapsed_run = t_step - run_start
            frac = (progress["trained_seconds"] + elapsed_run) / schedule_s
            lr = lr_at(frac, args.lr, args.warmup)
            if rewarm:
                lr *= min(1.0, (progress["step"] - first_step + 1) / rewarm)
            for group in opt.param_groups:
                group["lr"] = lr * group["lr_scale"]
            r = la_rng.choices(la_values, la_probs)[0]
            spec = None if easy else spec_gen
            losses = batch_nll(
                model, fe, batch, r, blank, device, loss_fn, spec, amp, ctc_head, args.history_noise
            )
            tokens_in_batch = losses.target_len.sum().clamp(min=1)
            loss = losses.rnnt.sum() / tokens_in_batch  # what is logged: RNN-T NLL per label token
            total = loss
            if losses.ctc is not None:
                ctc_loss = losses.ctc.sum() / tokens_in_batch
                total = rnnt_weight(progress["step"], args.ctc_only_steps) * loss + args.ctc_weight * ctc_loss
                ctc_window.append(float(ctc_loss.detach()))
            opt.zero_grad(set_to_none=True)
            total.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0))
            if math.isfinite(float(loss.detach())) and math.isfinite(grad_norm):
                opt.step()
            progress["step"] += 1
            progress["batches_seen"] += 1
            loss_window.append(float(loss.detach()))
            now = time.monotonic()
            if progress["step"] % 25 == 0 or progress["step"] <= 10 or args.smoke:
                entry = {
                    "step": progress["step"],
                    "t": round(now - STARTED, 1),
                    "loss": round(sum(loss_window) / len(loss_window), 4),
                    "ctc": round(sum(ctc_window) / len(ctc_window), 4) if ctc_window else None,
                    "lr": round(lr, 7),
                    "rnnt_weight": round(rnnt_weight(progress["step"] - 1, args.ctc_only_steps), 3),
                    "lookahead": r,
                    "batch": int(batch["audio"].shape[0]),
                    "grad_norm": round(grad_norm, 3),
                    "step_s": round(now - t_step, 3),
                    "epoch": epoch,
                }
                log["steps"].append(entry)
                loss_window, ctc_window = [], []
                print(json.dumps(entry), flush=True)
            out_of_time = now - STARTED > budget_s - reserve_s
            if args.max_steps is not None and progress["step"] >= args.max_steps:
                out_of_time = True
            if out_of_time:
                done = True
                break
            if now - last_eval > args.eval_every_minutes * 60:
                run_eval(f"t{now - STARTED:.0f}s", progress["trained_seconds"] + now - run_start)
                last_eval = time.monotonic()
            if now - last_save > args.save_every_minutes * 60:
                snap = dict(progress, trained_seconds=progress["trained_seconds"] + now - run_start)
                save_checkpoint(args.out, model, opt if args.save_optimizer else None, snap, ctc_head)
                last_save = time.monotonic()
        epoch += 1
    progress["trained_seconds"] += time.monotonic() - run_start
    progress["runs"] += 1
    t0 = time.monotonic()
    log["checkpoint_parts"] = save_checkpoint(
        args.out, model, opt if args.save_optimizer else None, progress, ctc_head
    )
    log["checkpoint_seconds"] = round(time.monotonic() - t0, 1)
    log["progress"] = progress
    run_eval("final", progress["trained_seconds"])
    log["wall_seconds"] = round(time.monotonic() - STARTED, 1)
    write_log()
    print(
        f"done: {progress['step']} steps, {progress['trained_seconds']:.0f}s trained, "
        f"wall {log['wall_seconds']}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
