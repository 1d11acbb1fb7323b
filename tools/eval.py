"""`ttg eval`: word and character error rate of a model on a labelled set.

    ttg eval --set var/demo/test [--model DIR] [--condition test] [--lookahead 3] [--mode both] [--json OUT]

The set is a JSONL manifest (a file, or a folder holding `manifest.jsonl`), one utterance a line:
`{"audio": "path relative to the manifest", "text": "reference", "lang": "en-US"}` (`lang` optional;
other keys kept in the per-utterance output, `condition` can be filtered on).

Modes:
- `streaming` (default): every file goes through the engine exactly as `ttg transcribe` runs it
  (features, chunker, batched MLX encoder with caches, ONNX greedy decoder, transcript assembly, and
  the endpointing of `ttg serve`: the VAD closes utterances through flushes); the hypothesis is the
  stream's final segments joined. `--vad off` leaves the closing to the token-silence rules, so
  the two runs give the WER change caused by early finalization.
- `offline`: whole-utterance log-mel, the encoder's offline forward with the chunked_limited mask of
  the same lookahead, one greedy pass over all frames. In exact arithmetic it equals streaming.
- `both`: runs both, scores both, and lists the utterances whose two transcripts differ.

References and hypotheses are normalized alike before scoring (`tools.demo_model.text.normalize`:
lower case, punctuation dropped, apostrophes inside words kept); WER/CER from jiwer, per language too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.demo_model.text import normalize

STREAM_GROUP = 16  # files run as concurrent streams at a time (batched in the encoder)


@dataclass(frozen=True, slots=True)
class Entry:
    audio: Path
    text: str
    lang: str | None
    extra: dict[str, Any]


def load_manifest(path: Path) -> list[Entry]:
    """Entries of a JSONL manifest (or of DIR/manifest.jsonl); audio paths resolved against its folder."""
    manifest = path / "manifest.jsonl" if path.is_dir() else path
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest}: no such manifest")
    entries = []
    for n, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            audio, text = row.pop("audio"), row.pop("text")
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{manifest}:{n}: not a manifest line ({exc})") from None
        entries.append(Entry(manifest.parent / audio, str(text), row.pop("lang", None), row))
    return entries


def score(refs: Sequence[str], hyps: Sequence[str]) -> dict[str, Any]:
    """WER/CER (jiwer) over normalized texts; utterances with an empty reference are not scored."""
    import jiwer

    pairs = [(normalize(r), normalize(h)) for r, h in zip(refs, hyps, strict=True)]
    pairs = [(r, h) for r, h in pairs if r]
    if not pairs:
        return {"utterances": 0, "words": 0, "wer": None, "cer": None}
    r, h = [p[0] for p in pairs], [p[1] for p in pairs]
    words = jiwer.process_words(r, h)
    chars = jiwer.process_characters(r, h)
    return {
        "utterances": len(pairs),
        "words": sum(len(x.split()) for x in r),
        "wer": round(words.wer, 4),
        "cer": round(chars.cer, 4),
        "substitutions": words.substitutions,
        "deletions": words.deletions,
        "insertions": words.insertions,
        "sentence_errors": sum(a != b for a, b in pairs),
    }


def _language(entry: Entry, forced: str | None) -> str:
    return forced or entry.lang or "en-US"


def stream_finals(
    model: Any,
    entries: Sequence[Entry],
    audios: Sequence[np.ndarray],
    forced_lang: str | None,
    lookahead: int | None,
    vad: str | None = None,
) -> list[list[str]]:
    """Each entry through the engine (as `ttg transcribe`), STREAM_GROUP concurrent streams at a time:
    the texts of its finals, in order."""
    from asr_core.api import StreamEnded, TranscriptEvent
    from tools.transcribe import transcribe

    hyps: list[list[str]] = [[] for _ in entries]
    by_lang: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        by_lang.setdefault(_language(e, forced_lang), []).append(i)
    for lang, idx in by_lang.items():
        for start in range(0, len(idx), STREAM_GROUP):
            group = idx[start : start + STREAM_GROUP]
            results = transcribe(
                model,
                [entries[i].audio for i in group],
                [audios[i] for i in group],
                language=lang,
                lookahead=lookahead,
                vad=vad,
            )
            for i, events in zip(group, results, strict=True):
                end = events[-1]
                if not isinstance(end, StreamEnded) or end.reason != "finished":
                    raise RuntimeError(f"{entries[i].audio}: stream ended with {getattr(end, 'reason', end)}")
                finals = [ev.text for ev in events if isinstance(ev, TranscriptEvent) and ev.kind == "final"]
                hyps[i] = [t for t in finals if t]
    return hyps


def segmentation(finals: Sequence[Sequence[str]]) -> dict[str, int]:
    """How the endpointing cut the set's utterances (each one sentence): finals in all, utterances in
    more than one, and of those the ones whose last final is one word (a real pause before it, or a
    last word the model said late, after its sentence's final)."""
    split = [f for f in finals if len(f) > 1]
    return {
        "finals": sum(len(f) for f in finals),
        "split": len(split),
        "last_final_one_word": sum(1 for f in split if len(f[-1].split()) == 1),
    }


def run_offline(
    model_dir: Path,
    precision: str,
    entries: Sequence[Entry],
    audios: Sequence[np.ndarray],
    forced_lang: str | None,
    lookahead: int | None,
) -> list[str]:
    """Whole-utterance decode: offline log-mel -> encoder offline forward -> one greedy pass."""
    from asr_core.bundle import load_bundle
    from asr_core.decoder import GreedyDecoder
    from asr_core.encoder import StreamingEncoder
    from asr_core.features import FeatureConfig, log_mel
    from asr_core.tokenizer import Tokenizer

    bundle = load_bundle(model_dir, "f32" if precision == "auto" else precision)
    cfg = bundle.config
    encoder = StreamingEncoder(bundle.encoder_weights, cfg.encoder, bundle.precision)
    decoder = GreedyDecoder(bundle.rnnt_graphs(threads=1), cfg.blank_token_id, cfg.max_symbols_per_step)
    tokenizer = Tokenizer.from_bundle(bundle)
    feat_cfg = FeatureConfig.from_dict(asdict(cfg.features))
    r = cfg.encoder.default_lookahead if lookahead is None else lookahead
    hyps = []
    for e, audio in zip(entries, audios, strict=True):
        mel = log_mel(audio, bundle.mel_filters, feat_cfg)
        if len(mel) == 0:
            hyps.append("")
            continue
        frames = encoder.forward_offline(mel, r, cfg.prompt_id(_language(e, forced_lang)))
        ids = [em.token for em in decoder.decode(decoder.new_state(), np.asarray(frames, np.float32))]
        hyps.append(tokenizer.decode(ids).text)
    return hyps


def _by_language(
    entries: Sequence[Entry], refs: Sequence[str], hyps: Sequence[str], forced: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"all": score(refs, hyps)}
    langs = sorted({_language(e, forced) for e in entries})
    if len(langs) > 1:
        for lang in langs:
            sel = [i for i, e in enumerate(entries) if _language(e, forced) == lang]
            out[lang] = score([refs[i] for i in sel], [hyps[i] for i in sel])
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="set_path", type=Path, required=True, help="manifest.jsonl or a folder holding one"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model bundle directory (default: TTG_MODEL__DIR, else the demo model)",
    )
    parser.add_argument(
        "--lang", default=None, help="force one language prompt (default: each entry's `lang`, else en-US)"
    )
    parser.add_argument(
        "--lookahead", type=int, default=None, help="encoder lookahead in 80 ms frames (default: bundle's)"
    )
    parser.add_argument("--mode", choices=("streaming", "offline", "both"), default="streaming")
    parser.add_argument(
        "--condition", default=None, help="only entries whose `condition` is this (e.g. test)"
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N entries")
    parser.add_argument(
        "--vad",
        choices=("webrtc", "energy", "off"),
        default=None,
        help="streaming endpointing VAD (default: the engine's, as `ttg serve`)",
    )
    parser.add_argument("--precision", default="auto", choices=["auto", "f32", "f16", "bf16"])
    parser.add_argument(
        "--json", dest="json_out", type=Path, default=None, help="write results (and every hypothesis) here"
    )


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from asr_core.model import AsrModel
    from tools.transcribe import cli_model_dir, read_audio

    entries = load_manifest(args.set_path)
    if args.condition is not None:
        entries = [e for e in entries if e.extra.get("condition") == args.condition]
    if args.limit is not None:
        entries = entries[: args.limit]
    if not entries:
        raise ValueError("no utterances to evaluate (check --set / --condition)")
    audios = [read_audio(e.audio) for e in entries]
    model_dir = cli_model_dir(args.model)
    refs = [e.text for e in entries]
    result: dict[str, Any] = {
        "model": str(model_dir),
        "set": str(args.set_path),
        "condition": args.condition,
        "lookahead": args.lookahead,
        "vad": args.vad or "default",
        "utterances": len(entries),
        "audio_seconds": round(sum(len(a) for a in audios) / 16000, 1),
    }
    hyps: dict[str, list[str]] = {}
    if args.mode in ("streaming", "both"):
        model = AsrModel.load(model_dir, args.precision)
        t0 = time.monotonic()
        finals = stream_finals(model, entries, audios, args.lang, args.lookahead, args.vad)
        hyps["streaming"] = [" ".join(f) for f in finals]
        result["streaming"] = _by_language(entries, refs, hyps["streaming"], args.lang)
        result["streaming"]["segmentation"] = segmentation(finals)
        result["streaming"]["seconds"] = round(time.monotonic() - t0, 1)
    if args.mode in ("offline", "both"):
        t0 = time.monotonic()
        hyps["offline"] = run_offline(model_dir, args.precision, entries, audios, args.lang, args.lookahead)
        result["offline"] = _by_language(entries, refs, hyps["offline"], args.lang)
        result["offline"]["seconds"] = round(time.monotonic() - t0, 1)
    if len(hyps) == 2:
        differ = [
            i for i in range(len(entries)) if normalize(hyps["streaming"][i]) != normalize(hyps["offline"][i])
        ]
        result["streaming_vs_offline"] = {
            "differ": len(differ),
            "examples": [
                {
                    "audio": str(entries[i].audio),
                    "streaming": hyps["streaming"][i],
                    "offline": hyps["offline"][i],
                }
                for i in differ[:20]
            ],
        }
    result["utterance_results"] = [
        {
            "audio": str(e.audio),
            "ref": e.text,
            "lang": _language(e, args.lang),
            **{k: v[i] for k, v in hyps.items()},
        }
        for i, e in enumerate(entries)
    ]
    return result


def main(args: argparse.Namespace) -> int:
    try:
        result = evaluate(args)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"ttg eval: {exc}", file=sys.stderr)
        return 2
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for mode in ("streaming", "offline"):
        if mode not in result:
            continue
        for lang, s in result[mode].items():
            if isinstance(s, dict) and s.get("wer") is not None:
                print(
                    f"{mode:9s} {lang:6s} WER {100 * s['wer']:6.2f}%  CER {100 * s['cer']:6.2f}%  "
                    f"({s['utterances']} utterances, {s['words']} words)"
                )
        if mode == "streaming":
            seg = result[mode]["segmentation"]
            print(
                f"{mode:9s} {seg['finals']} finals for {result['utterances']} utterances: {seg['split']} in "
                f"more than one, {seg['last_final_one_word']} of them ending in a one-word final"
            )
        print(f"{mode:9s} took {result[mode]['seconds']} s for {result['audio_seconds']} s of audio")
    if "streaming_vs_offline" in result:
        print(
            f"streaming vs offline: {result['streaming_vs_offline']['differ']} of {result['utterances']} "
            "transcripts differ"
        )
    return 0
