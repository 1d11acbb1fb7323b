"""The MLX layouts as users get them: bundles made by mlx-audio's own converter (the mlx-community BF16
conversion, its 8-bit build, a mixed 6/8-bit build from its quantizer), `ttg export --quantize`, and
the speech-swift layout written as its Swift loader reads it, all loaded by ttg and computing what
mlx-audio's own model computes on the same mel: encoder frames within float rounding, greedy tokens
identical (a calibrated model that emits tokens on speech-like audio)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from asr_core.bundle import MLX_AUDIO_LAYOUT, SWIFT_LAYOUT, Bundle, load_bundle
from asr_core.decoder import GreedyDecoder
from asr_core.encoder import ChunkInput, StreamingEncoder, chunk_frames, first_chunk_frames
from asr_core.features import log_mel
from asr_core.quant import QuantizedLinear
from gateway.cli import main as ttg
from tests.fixtures import peers
from tests.fixtures.mlx_audio import MlxSources, load_arrays, mlx_audio_convert, mlx_audio_quantize
from tools.bundle.mlx_export import mixed68_protected
from tools.bundle.probe import probe_audio
from tools.bundle.prompts import PROMPT_DICTIONARY
from tools.bundle.tokens import generated_vocabulary

pytestmark = pytest.mark.reference  # the .nemo needs torch

TOL = 1e-4  # encoder frames of |x| up to ~5, float32 compute on both sides
CASES = [(3, "en-US"), (13, "auto"), (0, "uk-UA")]


@pytest.fixture(scope="module", autouse=True)
def _mlx_audio() -> None:
    """mlx-audio, the public converter and model these tests compare with (the reference extra)."""
    peers.module("mlx_audio")


@pytest.fixture(scope="module")
def builds(mlx_sources: MlxSources, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("mlx-builds")
    bf16 = mlx_audio_convert(mlx_sources.nemo, out / "bf16")
    q8 = mlx_audio_convert(mlx_sources.nemo, out / "q8", bits=8)
    protected = mixed68_protected(load_bundle(bf16).config)
    mlx_audio_quantize(bf16, out / "mixed68", lambda path: 8 if path in protected else 6)
    return {"bf16": bf16, "q8": q8, "mixed68": out / "mixed68"}


def theirs(path: Path) -> Any:
    """mlx-audio's own model of the bundle, computing in float32 like ttg on the CPU. Left in its
    stored dtype it runs parts in bf16 (its embedding returns bf16 rows, so the LSTM input product
    rounds to bf16): ~1e-3 noise that flips the near-tied choices a random model makes. In float32
    both sides compute the same stored values (bf16 and the scales widen exactly)."""
    from mlx_audio.stt import load

    model = load(path, strict=True)
    model.set_dtype(mx.float32)
    return model


def their_frames(model: Any, mel: np.ndarray, lookahead: int, language: str) -> tuple[Any, np.ndarray]:
    """mlx-audio's offline encoder + prompt (what its joint takes) and the joiner frames (joint.enc)."""
    x, _ = model.encoder(mx.array(mel)[None], att_context_size=[56, lookahead])
    prompted = model.apply_prompt(x, language)
    return prompted, np.array(model.joint.enc(prompted)[0].astype(mx.float32))


def their_tokens(model: Any, prompted: Any) -> list[int]:
    from mlx_audio.stt.models.nemotron_asr.rnnt import GreedyDecoderState

    return [t.id for t in GreedyDecoderState(model).decode(prompted, 0)]


def our_tokens(bundle: Bundle, model: Any, frames: np.ndarray) -> list[int]:
    """Our greedy tokens, without the pieces mlx-audio leaves out of its hypothesis (tags, <unk>)."""
    from mlx_audio.stt.models.nemotron_asr.tokenizer import is_special_token

    cfg = bundle.config
    dec = GreedyDecoder(bundle.rnnt_graphs(), cfg.blank_token_id, cfg.max_symbols_per_step)
    ids = [e.token for e in dec.decode(dec.new_state(), frames)]
    return [t for t in ids if not is_special_token(t, model.vocabulary)]


def stream(enc: StreamingEncoder, mel: np.ndarray, lookahead: int, prompt: int) -> np.ndarray:
    slot, out, start, size = enc.alloc(prompt, lookahead), [], 0, first_chunk_frames(lookahead)
    while start < len(mel):
        stop = min(len(mel), start + size)
        out.append(enc.step([ChunkInput(slot, mel[start:stop], stop == len(mel))])[0])
        start, size = stop, chunk_frames(lookahead)
    enc.release(slot)
    return np.concatenate(out)


def compare(path: Path, *, seeds: tuple[int, ...] = (5,), tokens: bool = True) -> tuple[Bundle, int]:
    """ttg's load of `path` vs mlx-audio's: frames (offline, and our streaming) and greedy tokens."""
    bundle, model = load_bundle(path, "f32"), theirs(path)
    # Packed codes through mx.quantized_matmul (what a GPU runs), and dequantized once (the CPU's default).
    enc = StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", compile=False, unpack=False)
    unpacked = StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", compile=False)
    emitted = 0
    for seed in seeds:
        mel = log_mel(probe_audio(8.0, seed=seed), bundle.mel_filters, bundle.config.features)
        for lookahead, language in CASES:
            prompt = bundle.config.prompt_id(language)
            prompted, want = their_frames(model, mel, lookahead, language)
            ours = enc.forward_offline(mel, lookahead, prompt)
            np.testing.assert_allclose(ours, want, atol=TOL, rtol=0, err_msg=f"{path.name} r={lookahead}")
            np.testing.assert_allclose(stream(enc, mel, lookahead, prompt), ours, atol=TOL, rtol=0)
            np.testing.assert_allclose(
                unpacked.forward_offline(mel, lookahead, prompt), ours, atol=TOL, rtol=0
            )
            if tokens:
                got = our_tokens(bundle, model, ours)
                assert got == their_tokens(model, prompted), (path.name, seed, lookahead)
                emitted += len(got)
    return bundle, emitted


def test_the_bf16_conversion_loads_with_its_own_config_and_matches_mlx_audio(
    builds: dict[str, Path], mlx_sources: MlxSources
) -> None:
    bundle, emitted = compare(builds["bf16"])
    cfg = bundle.config
    assert bundle.layout == MLX_AUDIO_LAYOUT and not bundle.quantized
    assert bundle.decoder_path is None and bundle.rnnt_weights is not None
    # Everything from config.json: lookaheads and the default the converter writes ([56, 13]),
    # prompt table, vocabulary + blank, decoder sizes.
    assert cfg.encoder.supported_lookaheads == (3, 0, 6, 13) and cfg.encoder.default_lookahead == 13
    assert cfg.encoder.left_context_frames == 56
    assert dict(cfg.prompt_dictionary) == PROMPT_DICTIONARY
    assert cfg.default_prompt_id == PROMPT_DICTIONARY["auto"]
    assert bundle.pieces[:-1] == tuple(generated_vocabulary(mlx_sources.spec.vocab_size)[:-1])
    assert cfg.blank_token_id == mlx_sources.spec.blank_id == cfg.vocab_size - 1
    assert cfg.decoder_hidden_size == mlx_sources.spec.decoder_hidden
    assert all(isinstance(w, mx.array) for w in bundle.encoder_weights.values())
    assert emitted > 0


@pytest.mark.parametrize("build", ["q8", "mixed68"])
def test_quantized_builds_stay_packed_and_decode_exactly_like_mlx_audio(
    builds: dict[str, Path], build: str
) -> None:
    bundle, emitted = compare(builds[build], seeds=(5, 6, 7))
    assert emitted >= 30, "the calibrated model emits on the probe audio"
    packed = {n: w for n, w in bundle.encoder_weights.items() if isinstance(w, QuantizedLinear)}
    # Every linear layer of the encoder side stays packed (the pointwise convs are convolutions).
    assert len(packed) == 9 * 2 + 1 + 2 + 1  # per layer 9, subsampling out, prompt MLP, projector
    assert all(w.weight.dtype == mx.uint32 for w in packed.values())
    bits = set(bundle.quantized.values())
    if build == "q8":
        assert bits == {(8, 64)} and len(bundle.quantized) == 22 + 3  # + embedding, joint.pred, head
    else:
        eight = {n for n, b in bundle.quantized.items() if b == (8, 64)}
        assert eight == mixed68_protected(bundle.config) and bits == {(6, 64), (8, 64)}


def test_ttg_export_q8_writes_what_mlx_audios_converter_writes(
    builds: dict[str, Path], mlx_sources: MlxSources, tmp_path: Path
) -> None:
    """The same weights through `ttg export --quantize q8 --dtype bf16` (from the five-file bundle) and
    through mlx-audio's convert (from the .nemo; bf16 is its default): the very same tensors, the same
    config but for the default lookahead (ours keeps the source's; the converter always writes 13)."""
    assert (
        ttg(
            [
                "export",
                str(mlx_sources.bundle),
                "--out",
                str(tmp_path / "q8"),
                "--quantize",
                "q8",
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    mine = load_arrays(tmp_path / "q8" / "model.safetensors")
    want = load_arrays(builds["q8"] / "model.safetensors")
    assert mine.keys() == want.keys()
    for name, w in want.items():
        assert mine[name].dtype == w.dtype and mine[name].shape == w.shape, name
        assert bool(mx.array_equal(mine[name], w)), name
    c_mine = json.loads((tmp_path / "q8" / "config.json").read_text())
    c_want = json.loads((builds["q8"] / "config.json").read_text())
    assert c_mine["default_att_context_size"] == [56, 3] and c_want["default_att_context_size"] == [56, 13]
    c_mine.pop("default_att_context_size"), c_want.pop("default_att_context_size")
    assert c_mine == c_want


def test_ttg_export_mixed68_loads_in_mlx_audio_and_decodes_the_same(
    mlx_sources: MlxSources, tmp_path: Path
) -> None:
    out = tmp_path / "mixed68"
    assert ttg(["export", str(mlx_sources.bundle), "--out", str(out), "--quantize", "mixed68"]) == 0
    bundle, emitted = compare(out, seeds=(5, 6))
    assert emitted > 0
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (6, 64)
    assert {k for k, v in q.items() if isinstance(v, dict)} == mixed68_protected(bundle.config)
    assert json.loads((out / "quant_bitmap.json").read_text())["joint.joint_net.2"] == {
        "bits": 8,
        "group_size": 64,
    }


# -- speech-swift ------------------------------------------------------------------------------------
#
# Written exactly as soniqo/speech-swift (7b2d17f) reads it, Sources/NemotronStreamingASR/:
# - NemotronMLXRuntime.swift, `fromDirectory`: config.json, model.safetensors and vocab.json required;
#   languages.json ({"promptDictionary": ...}) or lang2slot.json (flat), which must have "auto";
#   weights loaded with `update(parameters:verify: .all)`, i.e. exactly the module tree's parameters.
# - NemotronMLXConfiguration.swift: the config keys (CodingKeys) and `quantization` {mode, bits,
#   group_size}; its validate() also pins the full-size geometry, which a loader that reads the
#   sizes does not need (this bundle is tiny).
# - NemotronMLXNetwork.swift: the tensor names. `NemotronMLXCausalConv2D` wraps its Conv2d as `conv`
#   (encoder.pre_encode.conv.{0,2,5}.conv.*), `NemotronMLXPromptKernel` holds `layers`
#   (prompt_kernel.layers.{0,2}.*); `nemotronQuantizedLinear` (QuantizedLinear: weight, scales,
#   biases [, bias]) for pre_encode.out, the feed-forward and attention linears and the joint's
#   three; plain Linear for the prompt MLP, Embedding, LSTM (Wx, Wh, bias) and the convolutions.
#   `NemotronMLXEncoder.stream` multiplies the subsampling output by sqrt(hiddenSize).


def _swift_name(name: str) -> str:
    name = re.sub(r"^encoder\.pre_encode\.conv\.([025])\.", r"encoder.pre_encode.conv.\1.conv.", name)
    return re.sub(r"^prompt_kernel\.(\d+)\.", r"prompt_kernel.layers.\1.", name)


def write_swift_bundle(out: Path, model: Any, bits: int, rename: bool = True) -> None:
    from mlx.utils import tree_flatten

    cfg = model.config
    enc, dec, joint = cfg.encoder, cfg.decoder, cfg.joint
    params = dict(tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), {_swift_name(k) if rename else k: v for k, v in params.items()}
    )
    config = {
        "model_type": "nemotron_streaming_rnnt_mlx",
        "sample_rate": 16000,
        "vocab_size": dec.vocab_size,
        "preprocessor": {
            "sample_rate": 16000,
            "features": enc.feat_in,
            "n_fft": 512,
            "window_size": 0.025,
            "window_stride": 0.01,
            "preemph": 0.97,
        },
        "encoder": {
            "feat_in": enc.feat_in,
            "n_layers": enc.n_layers,
            "d_model": enc.d_model,
            "n_heads": enc.n_heads,
            "ff_expansion_factor": enc.ff_expansion_factor,
            "subsampling_factor": enc.subsampling_factor,
            "conv_kernel_size": enc.conv_kernel_size,
            "subsampling_conv_channels": enc.subsampling_conv_channels,
            "use_bias": False,
            "conv_norm_type": "layer_norm",
        },
        "decoder": {
            "blank_as_pad": True,
            "vocab_size": dec.vocab_size,
            "prednet": {"pred_hidden": dec.pred_hidden, "pred_rnn_layers": dec.pred_rnn_layers},
        },
        "joint": {
            "num_classes": joint.num_classes,
            "jointnet": {
                "joint_hidden": joint.joint_hidden,
                "activation": "relu",
                "encoder_hidden": joint.encoder_hidden,
                "pred_hidden": joint.pred_hidden,
            },
        },
        "prompt_kernel": {
            "num_prompts": cfg.prompt.num_prompts,
            "hidden": cfg.prompt.prompt_hidden,
            "d_model": enc.d_model,
        },
        "streaming": {
            "chunk_ms": 320,
            "mel_frames": 32,
            "pre_cache_size": 9,
            "output_frames": 4,
            "attention_left_context": 56,
            "conv_cache_size": enc.conv_kernel_size - 1,
        },
        "quantization": {"mode": "affine", "bits": bits, "group_size": 64},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "vocab.json").write_text(json.dumps(list(cfg.vocabulary), ensure_ascii=False))
    (out / "lang2slot.json").write_text(json.dumps(dict(cfg.prompt.prompt_dictionary)))


def _swift_packs(path: str) -> int | None:
    """speech-swift's QuantizedLinear modules (everything linear but the prompt MLP and embedding)."""
    return None if path.startswith("prompt_kernel") or path == "decoder.prediction.embed" else 8


@pytest.fixture(scope="module")
def swift_model(builds: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """mlx-audio's model of the same weights with speech-swift's packing and input scaling."""
    out = tmp_path_factory.mktemp("swift-source")
    return mlx_audio_quantize(builds["bf16"], out, _swift_packs, config_edit={"encoder": {"xscaling": True}})


def test_the_speech_swift_layout_loads_as_its_swift_loader_reads_it(swift_model: Any, tmp_path: Path) -> None:
    write_swift_bundle(tmp_path / "int8", swift_model, bits=8)
    bundle = load_bundle(tmp_path / "int8", "f32")
    cfg = bundle.config
    assert bundle.layout == SWIFT_LAYOUT and cfg.encoder.scale_input
    assert cfg.encoder.supported_lookaheads == (3,) and cfg.max_symbols_per_step == 10
    assert dict(cfg.prompt_dictionary) == PROMPT_DICTIONARY and cfg.default_prompt_id == 101
    assert (
        bundle.quantized["joint.joint_net.2"] == (8, 64) and "prompt_kernel.layers.0" not in bundle.quantized
    )
    assert isinstance(bundle.encoder_weights["encoder.subsampling.linear.weight"], QuantizedLinear)
    enc = StreamingEncoder(bundle.encoder_weights, cfg.encoder, "f32", compile=False, unpack=False)
    mel = log_mel(probe_audio(6.0, seed=9), bundle.mel_filters, cfg.features)
    for language in ("en-US", "auto"):
        _, want = their_frames(swift_model, mel, 3, language)
        ours = enc.forward_offline(mel, 3, cfg.prompt_id(language))
        np.testing.assert_allclose(ours, want, atol=TOL * np.abs(want).max(), rtol=0)
        np.testing.assert_allclose(stream(enc, mel, 3, cfg.prompt_id(language)), ours, atol=TOL, rtol=0)


def test_the_speech_swift_layout_has_its_own_names(swift_model: Any, tmp_path: Path) -> None:
    write_swift_bundle(tmp_path / "b", swift_model, bits=8, rename=False)  # mlx-audio's names
    with pytest.raises(Exception, match=r"missing tensor encoder\.pre_encode\.conv\.0\.conv\.weight"):
        load_bundle(tmp_path / "b")
