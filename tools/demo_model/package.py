"""Trained checkpoint -> HF model folder -> five-file bundle (+ tokenizer, clips, card) for shipping.

    python -m tools.demo_model.package --checkpoint OUT_OF_TRAINING --data var/demo/carry \
        --hf var/demo/hf --bundle asr_core/demo_model --clips var/demo/test --dtype f16

1. `write_hf_folder`: the checkpoint's model tensors into transformers' own format (`config.json` +
   `model.safetensors` via `save_pretrained`), i.e. exactly what an upstream HF checkpoint looks like.
2. `write_bundle_from_hf`: that folder -> bundle through `ttg export` (tools/export.py, the path an
   upstream checkpoint takes: encoder.safetensors with HF names, decoder/joiner ONNX checked in
   onnxruntime against numpy, melfilters.f32, config, tokens.txt with blank last + tokenizer.model from
   the demo's SentencePiece model); then the prompt table keeps the slots the model was trained on
   (en-US 0, uk-UA 19, auto 101).
3. `ship_clips` + `write_card`: a few held-out clips (`clips/` + manifest) and `demo_model.json`
   (config, corpus, training summary) beside the bundle.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.demo_model.model import PROMPTS, DemoConfig

DEMO_PROMPTS = {
    "en-US": PROMPTS["en-US"],
    "en": PROMPTS["en-US"],
    "uk-UA": PROMPTS["uk-UA"],
    "uk": PROMPTS["uk-UA"],
    "auto": PROMPTS["auto"],
}


def checkpoint_config(checkpoint: Path) -> DemoConfig:
    """The model size a checkpoint was trained at (its train_log.json), the full demo size without a log."""
    log_path = checkpoint / "train_log.json"
    if not log_path.exists():
        return DemoConfig()
    return DemoConfig(**json.loads(log_path.read_text())["config"])


def write_hf_folder(checkpoint: Path, out: Path, vocab_size: int, cfg: DemoConfig | None = None) -> Path:
    """Checkpoint parts (train.py) -> `out/config.json` + `out/model.safetensors` (f32, HF names)."""
    from tools.demo_model.model import build_model
    from tools.demo_model.train import read_checkpoint

    state, progress, _, _ = read_checkpoint(checkpoint)
    model = build_model(cfg or checkpoint_config(checkpoint), vocab_size, training=False)
    model.load_state_dict(state, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "training_progress.json").write_text(json.dumps(progress, indent=2) + "\n")
    return out


def write_bundle_from_hf(
    hf_dir: Path, tokenizer_model: Path, out: Path, dtype: str = "f16"
) -> dict[str, Any]:
    """HF folder -> bundle through the project's export path (`ttg export`: encoder.safetensors, ONNX
    graphs checked in onnxruntime, config, filters, tokens.txt + tokenizer.model from `tokenizer_model`),
    then the demo's prompt table (the slots it was trained on) in place of the real model's."""
    from tools.export import export

    summary = export(hf_dir, out, dtype, sentencepiece=tokenizer_model)
    if summary["missing"]:
        raise ValueError(f"{hf_dir}: the bundle is incomplete: {summary['missing']}")
    cfg_path = out / "nemotron_onnx_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["prompt_dictionary"] = dict(DEMO_PROMPTS)
    cfg["default_prompt_id"] = PROMPTS["auto"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    summary["bytes"] = sizes
    summary["total_bytes"] = sum(sizes.values())
    return summary


def ship_clips(test_dir: Path, out: Path, per_lang: dict[str, int]) -> list[dict[str, Any]]:
    """Copy the first few held-out "test" clips per language into `out/clips/` with a manifest."""
    rows = [
        json.loads(x) for x in (test_dir / "manifest.jsonl").read_text(encoding="utf-8").splitlines() if x
    ]
    chosen: list[dict[str, Any]] = []
    for lang, n in per_lang.items():
        chosen += [r for r in rows if r["lang"] == lang and r.get("condition") == "test"][:n]
    clips = out / "clips"
    if clips.exists():
        shutil.rmtree(clips)
    clips.mkdir(parents=True)
    manifest = []
    for r in chosen:
        name = Path(r["audio"]).name
        shutil.copyfile(test_dir / r["audio"], clips / name)
        manifest.append(
            {"audio": name, "text": r["text"], "lang": r["lang"], "condition": "test", "voice": r["voice"]}
        )
    (clips / "manifest.jsonl").write_text(
        "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in manifest), encoding="utf-8"
    )
    return manifest


def write_card(bundle: Path, checkpoint: Path, data: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """`demo_model.json`: what the model is, what it was trained on, and how it was trained."""
    card: dict[str, Any] = {
        "name": "ttg demo model (espeak-ng call-centre speech, en-US + uk-UA)",
        "doc": "docs/demo-model.md",
        "languages": {"en-US": PROMPTS["en-US"], "uk-UA": PROMPTS["uk-UA"], "auto": PROMPTS["auto"]},
        "config": checkpoint_config(checkpoint).to_dict(),
        "bundle_bytes": summary.get("total_bytes"),
        "encoder_dtype": summary.get("dtype"),
    }
    if (data / "corpus.json").exists():
        card["corpus"] = json.loads((data / "corpus.json").read_text())
    log_path = checkpoint / "train_log.json"
    if log_path.exists():
        log = json.loads(log_path.read_text())
        card["training"] = {
            k: log.get(k)
            for k in (
                "device",
                "torch",
                "transformers",
                "loss",
                "params",
                "progress",
                "wall_seconds",
                "torchaudio_check",
            )
        }
        card["training"]["last_eval"] = (log.get("evals") or [None])[-1]
        # What the log calls "test": the carried held-out clips unless the run scored another set (--test).
        test_set = log.get("args", {}).get("test")
        card["training"]["last_eval_test_set"] = (
            test_set if test_set not in (None, "None") else "carry/test.npz (the first held-out clips)"
        )
        card["training"]["train_data"] = log.get("data")
    (bundle / "demo_model.json").write_text(
        json.dumps(card, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return card


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="folder with model.safetensors(.part-NN)")
    p.add_argument("--data", type=Path, default=Path("var/demo/carry"), help="folder with tokenizer.model")
    p.add_argument("--hf", type=Path, default=Path("var/demo/hf"))
    p.add_argument("--bundle", type=Path, default=Path("asr_core/demo_model"))
    p.add_argument(
        "--clips", type=Path, default=Path("var/demo/test"), help="held-out set to take shipped clips from"
    )
    p.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f16")
    args = p.parse_args(argv)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(args.data / "tokenizer.model"))
    write_hf_folder(args.checkpoint, args.hf, sp.get_piece_size() + 1)
    summary = write_bundle_from_hf(args.hf, args.data / "tokenizer.model", args.bundle, args.dtype)
    summary["clips"] = ship_clips(args.clips, args.bundle, {"en-US": 6, "uk-UA": 2})
    write_card(args.bundle, args.checkpoint, args.data, summary)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
