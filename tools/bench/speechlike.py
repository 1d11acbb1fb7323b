"""`ttg bench speechlike`: does a bundle decode telephone speech the way a speech model does?

    ttg bench speechlike --model DIR [--precision auto|f32|f16] [--per-voice 4] [--json OUT]

Held-out speech (call-centre sentences and espeak-ng voices that the speech calibration does not
use; pauses of 1.2-2.0 s, every other one line noise) goes through the telephone
channel (G.711 µ-law at 8 kHz, back to 16 kHz) and the engine (`ttg transcribe`'s streaming, partials
at every growth), one stream per voice, each with its voice's prompt. Printed per stream and in total:

- tokens per second of speech and per second of pause. A token's time is that of the event that
  first carries it (the frame of the segment's last token then), so it can be up to one chunk
  (320 ms) early; tokens within --tolerance-ms of a sentence count as speech, the rest as pause;
- finals: after how many sentences a final came in the pause (the sentence's last token and the next
  sentence's first are in two segments; after the last sentence: its final was not the stream-end
  one), how often consecutive tokens of one sentence fell into two segments (a final inside a
  sentence), and sentences without any token;
- distinct tokens and the characters of text the finals carry.

For a bundle made with `ttg make-bundle --calibrate speech` (the default at --size full) expect
2-5 tokens per second of speech, none in pauses and a final in every pause; a probe-calibrated or
real model shows what it does. Numbers only: nothing here asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.bundle.speech import Speaker, SpeechSet, SpeechStream, render

HELD_OUT_SPEAKERS = (
    Speaker("en-gb+m3", "en-US", 165, 45),
    Speaker("en-us+m4", "en-US", 155, 35),
    Speaker("en-gb-x-rp+f4", "auto", 160, 65),
    Speaker("uk+f3", "uk-UA", 150, 55),
)
FRAME_MS = 80


# Neither the calibration's sentences nor the replay's (tools.replay imports Redis and more, which the
# GPU machine lacks); the same kind of call-centre speech.
HELD_OUT_SENTENCES: dict[str, tuple[str, ...]] = {
    "en": (
        "Hello, I am calling because my internet has been down since yesterday.",
        "Can you check whether the payment went through on Monday?",
        "The reference number on the letter is seven four one nine.",
        "I would like to speak to someone about closing my account.",
        "The engineer said he would come back on Wednesday afternoon.",
        "My phone keeps showing no signal in the kitchen.",
        "Could you send the contract to my new email address?",
        "We were promised a refund within ten working days.",
        "The bill says I used three hundred minutes, which is wrong.",
        "Is it possible to move the delivery to next week?",
        "I have two questions about the new pricing plan.",
        "Thank you, that is all I needed for today.",
        "The automatic top up did not work this month.",
        "Please note that I will be abroad until the end of May.",
        "My daughter needs a separate line on the same account.",
        "The connection drops whenever it rains heavily.",
    ),
    "uk": (
        "Добрий вечір, у мене не працює інтернет з учорашнього дня.",
        "Перевірте, будь ласка, чи надійшла моя оплата.",
        "Номер заявки сім чотири один дев'ять.",
        "Я хочу поговорити про закриття рахунку.",
        "Майстер обіцяв прийти в середу після обіду.",
        "Телефон постійно показує відсутність сигналу.",
        "Надішліть договір на мою нову адресу.",
        "Нам обіцяли повернути гроші протягом десяти днів.",
    ),
}


def held_out_set(per_voice: int, seed: int = 1) -> SpeechSet:
    return SpeechSet(
        speakers=HELD_OUT_SPEAKERS,
        sentences=HELD_OUT_SENTENCES,
        per_speaker=per_voice,
        seed=seed,
        pause_ms=(1200, 2000),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="bundle directory")
    parser.add_argument("--precision", default="auto", choices=["auto", "f32", "f16", "bf16"])
    parser.add_argument("--per-voice", type=int, default=4, help="sentences per voice (4 voices)")
    parser.add_argument("--decoder-mode", choices=["workers", "batched"], default=None)
    parser.add_argument(
        "--tolerance-ms", type=int, default=400, help="tokens this close to a sentence count as speech"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


@dataclass(frozen=True, slots=True)
class StreamResult:
    name: str
    prompt: str
    speech_s: float
    pause_s: float
    speech_tokens: int
    pause_tokens: int
    pauses: int  # after each sentence that got tokens (the last one's runs to the stream's end)
    pauses_with_final: int  # the sentence's last token and the next one's first are in two segments
    pauses_merged: int  # ... in one segment (no final in the pause)
    splits_inside_sentences: int  # consecutive tokens of one sentence in two segments
    silent_sentences: int  # sentences without a token
    finals: int
    distinct_tokens: int
    text_chars: int

    @property
    def speech_rate(self) -> float:
        return self.speech_tokens / self.speech_s if self.speech_s else 0.0

    @property
    def pause_rate(self) -> float:
        return self.pause_tokens / self.pause_s if self.pause_s else 0.0


@dataclass(frozen=True, slots=True)
class TimedToken:
    ms: int
    token: int
    segment: int


def token_times(events: Sequence[Any]) -> list[TimedToken]:
    """Every token, timed by the first event that carries it (at that event's last token's frame)."""
    out: list[TimedToken] = []
    seen: dict[int, int] = {}  # segment id -> tokens already timed
    for ev in events:
        ids = getattr(ev, "token_ids", None)
        if ids is None:
            continue
        done = seen.get(ev.segment_id, 0)
        at = max(0, ev.end_ms - FRAME_MS)
        out += [TimedToken(at, int(t), ev.segment_id) for t in ids[done:]]
        seen[ev.segment_id] = max(done, len(ids))
    return out


def analyse(stream: SpeechStream, events: Sequence[Any], tolerance_ms: int) -> StreamResult:
    """Tokens within `tolerance_ms` of a sentence belong to it; the others are pause tokens."""
    rate = 16_000
    end_ms = len(stream.pcm) * 1000 // rate
    near = [
        (max(0, s * 1000 // rate - tolerance_ms), min(end_ms, e * 1000 // rate + tolerance_ms))
        for s, e in stream.spans
    ]
    times = token_times(events)
    sentence = [next((i for i, (a, b) in enumerate(near) if a <= t.ms < b), None) for t in times]
    spoken = [(t, i) for t, i in zip(times, sentence, strict=True) if i is not None]
    at_end = {ev.segment_id for ev in events if getattr(ev, "kind", None) == "final" and ev.at_end_of_stream}
    with_final = merged = 0
    for i in range(len(near)):
        last = [t for t, j in spoken if j == i][-1:]
        if not last:
            continue
        following = [t for t, j in spoken if j == i + 1][:1]
        if following:
            closed = following[0].segment != last[0].segment
        else:  # the last sentence (or the next one said nothing): its segment's final came at a pause
            closed = last[0].segment not in at_end
        with_final += closed
        merged += not closed
    splits = sum(a[1] == b[1] and a[0].segment != b[0].segment for a, b in itertools.pairwise(spoken))
    finals = [ev for ev in events if getattr(ev, "kind", None) == "final"]
    return StreamResult(
        name=stream.name,
        prompt=stream.prompt,
        speech_s=stream.speech_seconds,
        pause_s=(end_ms - sum(b - a for a, b in near)) / 1000,
        speech_tokens=len(spoken),
        pause_tokens=len(times) - len(spoken),
        pauses=with_final + merged,
        pauses_with_final=with_final,
        pauses_merged=merged,
        splits_inside_sentences=splits,
        silent_sentences=len(near) - len({i for _, i in spoken}),
        finals=len(finals),
        distinct_tokens=len({t.token for t in times}),
        text_chars=sum(len(f.text) for f in finals),
    )


def _row(r: StreamResult) -> str:
    return (
        f"{r.name:<16} {r.prompt:<6} {r.speech_s:6.1f} {r.speech_rate:8.2f} {r.pause_s:6.1f} "
        f"{r.pause_rate:8.2f} {r.pauses_with_final:>5}/{r.pauses:<3} {r.splits_inside_sentences:>6} "
        f"{r.silent_sentences:>6} {r.distinct_tokens:>8}"
    )


def stream_speech(
    model: Any, streams: list[SpeechStream], decoder_mode: str | None = None
) -> list[list[Any]]:
    """The streams through the engine as `ttg transcribe` runs them, partials at every growth. Without
    the voice activity detector: finals come from the decoder's own token silence, so where they land
    measures the bundle, not the detector (which also ends utterances at a comma's pause)."""
    from asr_core.config import EndpointConfig
    from tools.transcribe import transcribe

    return transcribe(
        model,
        [Path(s.name) for s in streams],
        [s.pcm for s in streams],
        language=[s.prompt for s in streams],
        lookahead=3,
        decoder_mode=decoder_mode,
        vad="off",
        endpoint=EndpointConfig(partial_interval_ms=0),
    )


def main(args: argparse.Namespace) -> int:
    from asr_core.model import AsrModel

    streams = render(held_out_set(args.per_voice))
    model = AsrModel.load(args.model, args.precision)
    t0 = time.monotonic()
    events = stream_speech(model, streams, args.decoder_mode)
    wall = time.monotonic() - t0
    results = [analyse(s, ev, args.tolerance_ms) for s, ev in zip(streams, events, strict=True)]
    sums: dict[str, Any] = {
        k: sum(getattr(r, k) for r in results)
        for k in StreamResult.__dataclass_fields__
        if k not in ("name", "prompt", "distinct_tokens")
    }
    distinct = len({t.token for ev in events for t in token_times(ev)})
    total = StreamResult(name="all", prompt="", distinct_tokens=distinct, **sums)
    print(f"model {args.model} ({model.info.precision} on {model.info.device}); {wall:.1f} s wall")
    print(
        f"{'voice':<16} {'prompt':<6} {'speech':>6} {'tok/s':>8} {'pause':>6} {'tok/s':>8} "
        f"{'final at pause':>9} {'splits':>6} {'silent':>6} {'distinct':>8}"
    )
    for r in [*results, total]:
        print(_row(r))
    if args.json:
        out = {
            "model": str(args.model),
            "precision": model.info.precision,
            "device": model.info.device,
            "wall_s": round(wall, 2),
            "streams": [
                asdict(r)
                | {
                    "speech_rate": r.speech_rate,
                    "pause_rate": r.pause_rate,
                    "sentences_ms": [[a * 1000 // 16_000, b * 1000 // 16_000] for a, b in s.spans],
                    "tokens_ms_id_segment": [[t.ms, t.token, t.segment] for t in token_times(ev)],
                }
                for r, s, ev in zip(results, streams, events, strict=True)
            ],
            "total": asdict(total) | {"speech_rate": total.speech_rate, "pause_rate": total.pause_rate},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
