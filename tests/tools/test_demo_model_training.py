"""Training pieces: the RNN-T loss, greedy decoding, the whole training script (smoke) and the export
of what it trains into a bundle that decodes exactly like the HF model it came from."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tools.demo_model import data, frontend, train
from tools.demo_model.model import (
    DemoConfig,
    build_model,
    encode,
    export_state,
    greedy_decode,
    init_from_scratch,
    joint_lattice,
    normalize_stem,
)
from tools.demo_model.rnnt_loss import rnnt_loss, rnnt_loss_reference

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.reference  # torch + transformers


def test_rnnt_loss_and_its_gradient_equal_the_textbook_recursion() -> None:
    torch.manual_seed(0)
    b, t, u, v = 4, 9, 5, 7
    logits = torch.randn(b, t, u + 1, v, requires_grad=True)
    targets = torch.randint(0, v - 1, (b, u))
    t_len, u_len = torch.tensor([9, 6, 3, 1]), torch.tensor([5, 2, 0, 0])
    ours = rnnt_loss(logits, targets, t_len, u_len, blank=v - 1, reduction="none")
    ref = rnnt_loss_reference(logits, targets, t_len, u_len, blank=v - 1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-6, rtol=1e-5)


def test_rnnt_loss_of_a_certain_alignment_is_zero() -> None:
    # Logits that put all mass on one path (emit "2" at frame 0, then blanks) -> P(y|x) = 1.
    v, blank = 4, 3
    logits = torch.full((1, 3, 2, v), -1e4)
    logits[0, 0, 0, 2] = 0.0  # frame 0, nothing emitted yet: emit 2
    logits[0, :, 1, blank] = 0.0  # after the label: blank on every frame
    loss = rnnt_loss(
        logits, torch.tensor([[2]]), torch.tensor([3]), torch.tensor([1]), blank, reduction="none"
    )
    assert float(loss) == pytest.approx(0.0, abs=1e-4)


def test_greedy_decoding_of_a_padded_batch_equals_one_utterance_at_a_time() -> None:
    torch.manual_seed(1)
    model = build_model(train.TINY_CONFIG, 12, training=False)
    with torch.no_grad():
        model.joint.head.bias[11] = -1.0  # emit something now and then
    mel = torch.randn(3, 64, 128)
    frames = torch.tensor([64, 41, 17])
    for i, n in enumerate(frames.tolist()):
        mel[i, n:] = 0.0
    prompts = torch.tensor([0, 19, 101])
    with torch.no_grad():
        enc = encode(model, mel, frames, prompts, 3)
        batch = greedy_decode(model, enc, frontend.encoder_frames(frames), blank=11)
        for i, n in enumerate(frames.tolist()):
            one = encode(model, mel[i : i + 1, :n], frames[i : i + 1], prompts[i : i + 1], 3)
            assert (
                greedy_decode(model, one, frontend.encoder_frames(frames[i : i + 1]), blank=11)[0] == batch[i]
            )
    assert any(batch)


def _first_layernorm_input_and_output(model: Any, mel: torch.Tensor) -> tuple[torch.Tensor, ...]:
    seen: list[torch.Tensor] = []
    norm = model.encoder.layers[0].norm_feed_forward1
    handle = norm.register_forward_hook(lambda m, i, o: seen.extend([i[0], o]))
    with torch.no_grad():
        encode(model, mel, torch.tensor([mel.shape[1]] * mel.shape[0]), torch.tensor([0] * mel.shape[0]), 3)
    handle.remove()
    return seen[0], seen[1]


def test_history_noise_changes_what_the_prediction_network_reads_and_nothing_else() -> None:
    """--history-noise: the lattice under noisy history differs only through the prediction network's
    input; the start column (blank only) and noise 0 are the plain lattice, and a noisy draw never feeds
    the blank id (which would read as a start symbol)."""
    torch.manual_seed(2)
    model = build_model(train.TINY_CONFIG, 12, training=False).eval()
    enc = torch.randn(2, 7, train.TINY_CONFIG.hidden_size)
    targets = torch.randint(0, 11, (2, 40))
    seen: list[torch.Tensor] = []
    hook = model.decoder.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    with torch.no_grad():
        plain = joint_lattice(model, enc, targets, blank=11)
        quiet = joint_lattice(model, enc, targets, 11, 0.0, torch.Generator().manual_seed(0))
        assert torch.equal(quiet, plain)
        noisy = joint_lattice(model, enc, targets, 11, 0.5, torch.Generator().manual_seed(0))
    hook.remove()
    read = seen[-1][:, 1:]
    assert torch.equal(seen[0][:, 1:], targets) and (seen[-1][:, 0] == 11).all()
    share = float((read != targets).float().mean())
    assert 0.3 < share < 0.55 and not (read == 11).any()  # ~half replaced (a few by the same piece)
    torch.testing.assert_close(noisy[:, :, 0], plain[:, :, 0])  # before any label: identical
    assert not torch.allclose(noisy, plain)


def test_the_recipe_chains_its_stages_each_resuming_the_last_with_the_shards_it_names(tmp_path: Path) -> None:
    from tools.demo_model import recipe

    for k in (1, 2, 10):
        (tmp_path / f"shard{k}").mkdir()
        (tmp_path / f"shard{k}" / "train.npz").touch()
    commands = recipe.train_commands(tmp_path, 7, [])
    assert len(commands) == len(recipe.SHIPPED_STAGES) == 6

    def value(cmd: list[str], flag: str) -> str | None:
        return cmd[cmd.index(flag) + 1] if flag in cmd else None

    def shards(cmd: list[str]) -> list[str]:
        if "--extra-train" not in cmd:
            return []
        rest = cmd[cmd.index("--extra-train") + 1 :]
        return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]

    def shard(k: int) -> str:
        return str(tmp_path / f"shard{k}" / "train.npz")

    assert value(commands[0], "--resume") is None
    for before, after in itertools.pairwise(commands):
        assert value(after, "--resume") == value(before, "--out")
    # Session 1: the carry's train.npz plus one more template shard per call.
    assert [shards(c) for c in commands[:3]] == [[], [shard(1)], [shard(1), shard(2)]]
    assert not any("--only-extra-train" in c or "--test" in c for c in commands[:3])
    # Session 2: the varied shards alone, scored on the novel dev set (never the held-out clips).
    assert shards(commands[3]) == [shard(k) for k in range(4, 12)]
    assert shards(commands[4]) == shards(commands[5]) == [shard(k) for k in range(4, 20)]
    for cmd in commands[3:]:
        assert "--only-extra-train" in cmd and value(cmd, "--test") == str(tmp_path / "dev1" / "dev.npz")
    assert {value(c, "--model-size") for c in commands} == {"full"}
    assert {value(c, "--lr") for c in commands} == {"1e-3"}
    assert value(commands[-1], "--out") == str(recipe.last_stage_folder(tmp_path, []))
    (custom,) = recipe.train_commands(tmp_path, 7, ["--max-steps", "5"])
    assert custom[-2:] == ["--max-steps", "5"] and value(custom, "--resume") is None
    assert shards(custom) == [shard(1), shard(2), shard(10)]  # every shard, in number order
    assert "--only-extra-train" not in custom


def test_a_model_initialized_for_training_hands_the_audio_to_the_conformer_above_layernorm_eps() -> None:
    """Regression (GPU run 1: an audio-blind model, WER 1.0 at loss 0.65). With transformers' N(0, 0.02)
    init the three subsampling stages shrink the log-mel ~10^6-fold, below the first LayerNorm's eps, and
    training converges on a language model of the labels. From scratch, the audio must reach the
    conformer at a scale the LayerNorm normalizes (its output ~unit variance, varying with the audio)."""
    torch.manual_seed(0)
    # Log-mel statistics of our telephone speech: mean about -12, spread about 3.5, no normalization.
    mel = -12.0 + 3.5 * torch.randn(2, 200, 128)
    model = init_from_scratch(build_model(DemoConfig(), 256, training=False)).eval()
    x, y = _first_layernorm_input_and_output(model, mel)
    eps = model.encoder.layers[0].norm_feed_forward1.eps
    assert float(x.std(dim=-1).min()) > 10 * eps**0.5  # the LayerNorm sees the audio, not its eps
    assert float(y.std(dim=-1).mean()) > 0.5  # and normalizes it
    _, y_other = _first_layernorm_input_and_output(model, mel.flip(1))
    assert float((y - y_other).abs().mean()) > 0.1  # different audio, different conformer input


def test_at_initialization_the_encoder_output_depends_on_the_audio() -> None:
    """Regression (GPU runs 1-5: encoders that ignored the audio). With PyTorch's default init of the
    five-convolution subsampling stack, the encoder output at init was >99.7% the same for every clip;
    He init over normalized features (`init_from_scratch` + `normalize_stem(reinit=True)`) keeps a
    real share of it audio-dependent."""
    torch.manual_seed(0)
    mel = -10.8 + 4.7 * torch.randn(8, 200, 128)
    model = init_from_scratch(build_model(DemoConfig(), 256, training=False))
    normalize_stem(model, -10.8, 4.7, reinit=True)
    with torch.no_grad():
        out = encode(model.eval(), mel, torch.tensor([200] * 8), torch.tensor([0] * 8), 3)
    across_clips = float(out.var(dim=0).mean())  # same frame, different audio
    static = float(out.mean(dim=0).var())  # the pattern every clip shares
    assert across_clips > 0.1 * (across_clips + static)


def test_the_normalized_stem_trains_other_parameters_but_computes_the_bundles_convolution() -> None:
    torch.manual_seed(1)
    model = init_from_scratch(build_model(DemoConfig(), 256, training=False)).eval()
    mel = -11.0 + 4.0 * torch.randn(2, 120, 128)
    frames, prompts = torch.tensor([120, 90]), torch.tensor([0, 19])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = encode(model, mel, frames, prompts, 3)
        normalize_stem(model, -10.8, 4.7)  # on loaded weights: the same function
        assert float((encode(model, mel, frames, prompts, 3) - ref).abs().max()) < 1e-4
    assert any(".parametrizations." in n for n, _ in model.named_parameters())
    exported = export_state(model)
    assert set(exported) == set(before)  # HF names only
    assert max(float((exported[k] - before[k]).abs().max()) for k in before) < 1e-5


def test_rnnt_loss_waits_for_the_ctc_head_start_then_ramps_in() -> None:
    assert [train.rnnt_weight(s, 4) for s in (0, 3, 4, 5, 7, 8, 100)] == [0, 0, 0.25, 0.5, 1, 1, 1]
    assert train.rnnt_weight(0, 0) == 1.0


def test_the_head_trains_at_its_own_learning_rate_and_every_parameter_is_in_one_group() -> None:
    model = init_from_scratch(build_model(DemoConfig(hidden_size=32, num_layers=1, num_heads=2), 64))
    normalize_stem(model, -10.8, 4.7, reinit=True)
    named = train._named_parameters(model, torch.nn.Linear(32, 64))
    groups = train.param_groups(named, 1e-3, 4.0)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for _, p in named) and len(set(ids)) == len(ids)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    heads = {n.split(".")[0] for n, p in named if scale[id(p)] == 4.0}
    assert heads == {"prompt_projector", "encoder_projector", "joint", "ctc_head"}
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert all((id(p) in decayed) == (p.ndim >= 2 and "embedding" not in n) for n, p in named)


def test_word_error_rate_of_the_training_log_counts_edits() -> None:
    rates = train.error_rates(["a b c d", "x y"], ["a c d e", "x y"])
    assert rates["wer"] == pytest.approx(2 / 6, abs=1e-4)


def test_batches_keep_padded_audio_under_the_budget_and_cover_every_clip() -> None:
    from tools.demo_model.data import Split

    clips = [np.zeros(int(8000 * s), np.float32) for s in np.linspace(0.5, 6.0, 200)]
    split = Split(clips, ["x"] * 200, ["en-US", "uk-UA"] * 100, [str(i) for i in range(200)])
    import random

    plan = train.plan_batches(split, random.Random(0), 60.0, 0.3, (6.0, 16.0))
    used = sorted(i for batch in plan for item in batch for i in item.clips)
    assert used == list(range(200))
    items = [item for batch in plan for item in batch]
    assert 0.15 < sum(len(it.clips) == 1 for it in items) / 200 < 0.6  # the single clips, plus leftovers
    for batch in plan:
        assert len(batch) * max(it.seconds for it in batch) <= 60.0 or len(batch) == 1
        for item in batch:
            assert len({split.langs[i] for i in item.clips}) == 1  # joined clips never mix languages
            assert len(item.clips) == 1 or item.seconds <= 16.0


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real corpus (espeak-ng), vocabulary and filters: what travels to the GPU machine."""
    from tools.bundle.filters import slaney_mel_filters, write_filters
    from tools.demo_model import corpus, vocab

    out = tmp_path_factory.mktemp("demo")
    sizes = corpus.CorpusSizes(train=24, dev=4, test=4, test_carried=4, train_shards=2)
    corpus.build(out, sizes, seed=3, workers=1)
    # A development set of sentences off the templates (recipe: dev1/dev.npz, the second session's --test).
    corpus.build_shard(
        out, replace(sizes, **{**corpus.NOVEL_DEV_MIX, "dev": 4}), seed=3, workers=1, shard=1, split="dev"
    )
    texts = [u.text for u in corpus.plan("train", 400, 0.15, seed=3)]
    (out / "vocab.txt").write_text("\n".join(texts) + "\n")
    vocab.train_sentencepiece(out / "vocab.txt", out / "carry" / "tokenizer.model", 95)
    write_filters(out / "carry" / "melfilters.f32", slaney_mel_filters(16000, 512, 128, 0.0, 8000.0))
    return out


def test_training_script_runs_checkpoints_and_resumes(carry: Path, tmp_path: Path) -> None:
    script = REPO / "tools" / "demo_model" / "train.py"
    first, second, third = tmp_path / "run1", tmp_path / "run2", tmp_path / "run3"
    base = [
        sys.executable,
        str(script),
        "--data",
        str(carry / "carry"),
        "--smoke",
        "--tiny-model",
        "--max-steps",
        "2",
    ]

    def run(*args: str) -> None:
        subprocess.run([*base, *args], check=True, cwd=tmp_path, capture_output=True, timeout=240)

    run("--out", str(first))
    log = json.loads((first / "train_log.json").read_text())
    assert log["progress"]["step"] == 2 and len(log["steps"]) == 2
    assert all(np.isfinite(s["loss"]) for s in log["steps"])
    dev = log["evals"][-1]["dev"]
    assert dev["all"]["utterances"] == 4 and len(dev["examples"]) == 4
    assert np.isfinite(dev["loss"]) and np.isfinite(dev["loss_zero_audio"])
    assert all(np.isfinite(s["ctc"]) for s in log["steps"])  # the auxiliary CTC loss is on by default
    # By default only what the device machine must hand back: the weights (parts <= 15 MiB), the small
    # training-only CTC head and the log.
    parts = sorted(p.name for p in first.glob("*.safetensors.part-*"))
    assert sorted(log["checkpoint_parts"]) == parts
    assert {p.split(".")[0] for p in parts} == {"model", "ctc_head"}
    assert all((first / p).stat().st_size <= 15 * 2**20 for p in parts)
    assert sorted(p.name for p in first.iterdir()) == sorted([*parts, "train_log.json"])
    # Resume from the weights alone, saving the AdamW moments this time (a fresh AdamW: 1 step taken).
    run("--max-steps", "3", "--out", str(second), "--resume", str(first), "--save-optimizer")
    log2 = json.loads((second / "train_log.json").read_text())
    assert (
        log2["resumed_from"]["step"] == 2 and log2["progress"]["step"] == 3 and log2["progress"]["runs"] == 2
    )
    state, progress, moments, adam_steps = train.read_checkpoint(second)
    assert set(adam_steps.values()) == {1.0} and progress["step"] == 3
    assert any(k.startswith("exp_avg_sq.") for k in moments) and "joint.head.weight" in state
    assert "exp_avg.ctc_head.weight" in moments and set(train.read_ctc_head(second) or {}) == {
        "weight",
        "bias",
    }
    # An exact resume with the moments, on the first set plus a second shard (the next GPU call's carry);
    # without --save-optimizer the new run hands back no adam parts.
    shard = carry / "shard1" / "train.npz"
    run("--max-steps", "4", "--out", str(third), "--resume", str(second), "--extra-train", str(shard))
    log3 = json.loads((third / "train_log.json").read_text())
    assert log3["progress"]["step"] == 4
    assert log3["data"]["train_utts"] == 48 and log3["data"]["train_sets"][1] == str(shard)
    assert not list(third.glob("adam.*"))
    # The second session's form: the shards alone (the carry brings dev, tokenizer and filters), and
    # another set scored beside dev in place of the carried held-out clips.
    novel = carry / "dev1" / "dev.npz"
    fourth = tmp_path / "run4"
    alone = ("--max-steps", "5", "--out", str(fourth), "--resume", str(third), "--only-extra-train")
    refused = subprocess.run([*base, *alone], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert refused.returncode != 0 and "--only-extra-train needs --extra-train" in refused.stderr
    run(*alone, "--extra-train", str(shard), "--test", str(novel))
    log4 = json.loads((fourth / "train_log.json").read_text())
    assert log4["data"]["train_sets"] == [str(shard)] and log4["data"]["train_utts"] == 24
    novel_refs = {ex["ref"] for ex in log4["evals"][-1]["test"]["examples"]}
    assert novel_refs <= set(data.load_split(novel).texts) and len(novel_refs) == 4


def test_exported_bundle_decodes_exactly_like_the_hf_model_it_came_from(carry: Path, tmp_path: Path) -> None:
    """checkpoint -> HF folder -> bundle (f32): the engine's offline and streaming decodes of held-out
    clips give the words the HF model itself decodes (torch greedy on its own encoder output)."""
    import sentencepiece as spm

    from asr_core.features import log_mel
    from asr_core.model import AsrModel
    from tools.demo_model import package
    from tools.demo_model.text import normalize
    from tools.eval import load_manifest, run_offline, stream_finals
    from tools.transcribe import read_audio

    sp = spm.SentencePieceProcessor(model_file=str(carry / "carry" / "tokenizer.model"))
    vocab = sp.get_piece_size() + 1
    torch.manual_seed(5)
    model = build_model(train.TINY_CONFIG, vocab, training=False).eval()
    entries = [e for e in load_manifest(carry / "test") if e.extra["condition"] == "test"][:3]
    audios = [read_audio(e.audio) for e in entries]
    filters = np.fromfile(carry / "carry" / "melfilters.f32", "<f4").reshape(128, 257)
    mels = [torch.from_numpy(log_mel(a, filters))[None] for a in audios]
    with torch.no_grad():
        # Distinct logits (no near-ties), and a blank bias that lets about a third of the frames emit.
        model.joint.head.weight.mul_(30.0)
        enc = encode(model, mels[0], torch.tensor([mels[0].shape[1]]), torch.tensor([0]), 3)[0]
        start = model.decoder(torch.tensor([[vocab - 1]]))[0]
        logits = model.joint(decoder_hidden_states=start, encoder_hidden_states=enc)
        margin = logits[:, : vocab - 1].max(dim=1).values - logits[:, vocab - 1]
        model.joint.head.bias[vocab - 1] += float(torch.quantile(margin, 0.67))
    train.save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), {"step": 0})
    package.write_hf_folder(tmp_path, tmp_path / "hf", vocab, cfg=train.TINY_CONFIG)
    summary = package.write_bundle_from_hf(
        tmp_path / "hf", carry / "carry" / "tokenizer.model", tmp_path / "bundle", "f32"
    )
    assert summary["encoder_tensors"] == len(train.TINY_CONFIG.spec(vocab).encoder_shapes())
    assert (tmp_path / "bundle" / "melfilters.f32").read_bytes() == (
        carry / "carry" / "melfilters.f32"
    ).read_bytes()
    cfg = json.loads((tmp_path / "bundle" / "nemotron_onnx_config.json").read_text())
    assert cfg["vocab_size"] == vocab and cfg["blank_token_id"] == vocab - 1
    assert cfg["prompt_dictionary"]["uk-UA"] == 19 and cfg["default_prompt_id"] == 101

    want = []
    for e, mel in zip(entries, mels, strict=True):
        frames = torch.tensor([mel.shape[1]])
        with torch.no_grad():
            enc = encode(model, mel, frames, torch.tensor([19 if e.lang == "uk-UA" else 0]), 3)
            ids = greedy_decode(model, enc, frontend.encoder_frames(frames), vocab - 1)[0]
        want.append(normalize(sp.decode(ids)))
    assert any(want), "the random model should emit something for the comparison to mean anything"
    offline = run_offline(tmp_path / "bundle", "f32", entries, audios, None, 3)
    assert [normalize(h) for h in offline] == want
    streaming = stream_finals(AsrModel.load(tmp_path / "bundle", "f32"), entries, audios, None, 3)
    assert [normalize(" ".join(h)) for h in streaming] == want


def test_listen_reports_how_much_of_the_audio_survives_each_module() -> None:
    """tools.demo_model.listen: a fresh model (He init, normalized stem) carries the audio to its output;
    the same model with its subsampling output zeroed carries none of it past the subsampling."""
    from tools.demo_model.listen import audio_dependence

    torch.manual_seed(3)
    model = init_from_scratch(build_model(train.TINY_CONFIG, 12, training=False))
    normalize_stem(model, -10.8, 4.7, reinit=True)
    model.eval()
    mel = -10.8 + 4.7 * torch.randn(4, 120, 128)
    silent = torch.full_like(mel, -16.6)
    frames, prompts = torch.tensor([120] * 4), torch.tensor([0, 19, 0, 101])
    rows = {r.module: r for r in audio_dependence(model, mel, silent, frames, prompts)}
    order = list(rows)
    assert order[0] == "subsampling" and order[-1] == "encoder output"
    assert "block0.self_attn" in rows and rows["encoder output"].difference > 0.05
    with torch.no_grad():
        model.encoder.subsampling.linear.weight.zero_()
        model.encoder.subsampling.linear.bias.fill_(0.3)
    deaf = {r.module: r for r in audio_dependence(model, mel, silent, frames, prompts)}
    assert deaf["subsampling"].difference == 0.0 and deaf["encoder output"].difference < 1e-6
