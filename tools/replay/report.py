"""The replay report: per-call results, the summary over calls, the harness's own numbers, and the
writers (JSON, Markdown). Building it from a finished run is pure (`call_result`, `summarize`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.replay import analysis
from tools.replay.analysis import ReceivedEvent, Stats, UtteranceResult, UtteranceTiming
from tools.replay.scrape import BatchPoint

OUTCOMES = ("completed", "rejected", "failed", "stopped")


@dataclass(frozen=True, slots=True)
class CallResult:
    """One call, or one leg of a SIPREC call (its calls have one result per leg, same index and Call-ID)."""

    index: int
    sip_call_id: str
    lang: str
    clips: tuple[str, ...]
    outcome: str  # completed | rejected | failed | stopped
    detail: str = ""  # why it was rejected/failed, or how it ended
    status: int | None = None  # final response to the INVITE
    retry_after_s: float | None = None
    setup_s: float | None = None  # INVITE sent → 200 received
    codec: str = ""
    ptime_ms: int = 0
    media_s: float = 0.0  # audio time the call carried
    rtp_planned: int = 0
    rtp_sent: int = 0  # datagrams handed to the kernel (duplicates included)
    rtp_lost_impairment: int = 0
    rtp_duplicated_impairment: int = 0
    rtp_reordered_impairment: int = 0
    rtp_send_errors: int = 0
    rtp_echoed: int = 0
    rtcp_received: int = 0  # the gateway's RTCP packets (receiver reports) that reached the call's socket
    send_jitter_ms: float = 0.0  # RFC 3550 §6.4.1 estimator over our send times
    send_lateness_max_ms: float = 0.0
    invite_retransmits: int = 0
    bye_retransmits: int = 0
    utterances: tuple[UtteranceResult, ...] = ()
    partials: int = 0
    finals: int = 0
    finals_outside: int = 0  # finals covering no utterance (analysis.finals_outside)
    unstable_partials: int = 0
    partials_with_successor: int = 0
    call_end_received: bool = False
    call_end: dict[str, str] = field(default_factory=dict)
    gateway_lang: str | None = None  # the language the gateway says it used (call_start `lang`)
    gateway_rtp_packets: int | None = None  # packets the gateway counted (call_end `rtp_packets`)
    gateway_rtp_lost: int | None = None  # call_end `rtp_lost`
    reference: str | None = None
    hypothesis: str = ""
    word_errors: int | None = None
    ref_words: int | None = None
    leg: str = ""  # SIPREC: the leg name the gateway should use ("" for a plain call: every event)
    vendor: str = ""  # SIPREC: whose offer the call's INVITE was shaped like
    label: str = ""  # SIPREC: the a=label of the leg's m= line
    events_on_other_legs: int = 0  # transcripts of this call on a leg the call did not expect


@dataclass(frozen=True, slots=True)
class Summary:
    calls: int
    completed: int
    rejected: int
    failed: int
    stopped: int
    rejected_by_status: dict[str, int]
    max_retry_after_s: float | None
    setup_s: Stats
    ttf_s: Stats
    ttfp_s: Stats
    ttf_published_s: Stats  # to the final's XADD: without the replay's own lag in reading it
    utterances: int
    utterances_without_final: int | None  # None: events were not read back (--no-redis)
    partials: int
    finals: int
    finals_outside: int  # finals covering no utterance: TTF cannot see them
    partial_instability: float | None  # share of partials not a prefix of their successor
    wer: float | None
    wer_ref_words: int
    rtp_planned: int
    rtp_sent: int
    rtp_send_errors: int
    rtp_echoed: int
    rtcp_received: int
    completed_without_rtcp: int  # completed plain calls that got none (SIPREC offers no rtcp-mux)
    calls_without_call_end: int | None
    gateway_rtp_packets: int | None  # what the gateway counted, over calls that reported it
    rtp_sent_to_reporting_calls: int  # what we sent to those same calls
    lang_mismatches: int  # calls the gateway transcribed in another language than the header asked
    peak_active_calls: int
    legs: int = 0  # results: one per call, or one per leg of SIPREC calls
    legs_with_finals: int = 0  # legs of completed calls that got at least one final
    events_on_other_legs: int = 0  # transcripts on legs no call expected (a leg named wrongly)


@dataclass(frozen=True, slots=True)
class HarnessStats:
    """The replay process itself: if it lags, the numbers measure the harness, not the gateway."""

    wall_s: float
    cpu_s: float
    cpu_percent: float  # of one core
    packets_sent: int
    packets_per_s: float
    send_lateness_ms: Stats  # p50/p95/p99 from a 0.1 ms histogram; n = packets
    send_jitter_ms_mean: float
    send_jitter_ms_max: float
    sip_sent: int
    sip_received: int
    sip_parse_errors: int
    sip_stray: int
    sip_transport_errors: int
    redis_entries_read: int
    redis_errors: int
    scrape_errors: int
    event_loop: str


@dataclass(frozen=True, slots=True)
class Report:
    config: dict[str, Any]
    started_at: str
    summary: Summary
    harness: HarnessStats
    calls: tuple[CallResult, ...]
    batch_series: tuple[BatchPoint, ...] = ()
    concurrency_series: tuple[tuple[float, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))

    @property
    def ok(self) -> bool:
        s = self.summary
        return s.calls > 0 and s.completed == s.calls


@dataclass(frozen=True, slots=True)
class CapacityLevel:
    concurrency: int
    summary: Summary
    held: bool
    why: str  # what broke the bound, or "" when held


@dataclass(frozen=True, slots=True)
class CapacityReport:
    bound_s: float
    baseline_p95_s: float | None
    capacity: int  # highest concurrency that held (0 if none)
    levels: tuple[CapacityLevel, ...]

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


# --- building ---------------------------------------------------------------------------------------


def transcript_results(
    utterances: Sequence[UtteranceTiming],
    events: Sequence[ReceivedEvent],
    reference: str | None,
    margin_ms: int = analysis.DEFAULT_MARGIN_MS,
    leg: str = "",
) -> dict[str, Any]:
    """The transcript-side fields of a CallResult (kwargs), from what was sent and what came back.

    `leg` (SIPREC): only that leg's transcripts count, and the RTP counters are the leg's own from
    call_end's `legs` object; "" takes every event of the call (a plain call has one leg)."""
    if leg:
        events = [e for e in events if e.type in ("call_start", "call_end") or e.fields.get("leg") == leg]
    unstable, considered = analysis.partial_stability(events)
    hyp = analysis.final_text(events)
    errors: int | None = None
    words: int | None = None
    if reference is not None:
        errors, words = analysis.word_errors(reference, hyp)
    call_end = next((e for e in events if e.type == "call_end"), None)
    call_start = next((e for e in events if e.type == "call_start"), None)
    end_fields = call_end.fields if call_end else {}
    if leg:
        end_fields = leg_stats(end_fields, leg)
    return {
        "gateway_lang": (call_start.fields.get("lang") or None) if call_start else None,
        "gateway_rtp_packets": _opt_int(end_fields.get("rtp_packets")),
        "gateway_rtp_lost": _opt_int(end_fields.get("rtp_lost")),
        "utterances": tuple(analysis.match_utterances(utterances, events, margin_ms)),
        "partials": sum(1 for e in events if e.type == "partial"),
        "finals": sum(1 for e in events if e.type == "final"),
        "finals_outside": analysis.finals_outside(utterances, events, margin_ms),
        "unstable_partials": unstable,
        "partials_with_successor": considered,
        "call_end_received": call_end is not None,
        "call_end": dict(call_end.fields) if call_end else {},
        "reference": reference,
        "hypothesis": hyp,
        "word_errors": errors,
        "ref_words": words,
    }


def leg_stats(call_end: dict[str, str], leg: str) -> dict[str, str]:
    """One leg's counters from call_end: its entry in the `legs` JSON object (docs/events.md), or the
    call's own fields when the call_end has no per-leg object (one leg)."""
    try:
        legs = json.loads(call_end.get("legs") or "{}")
    except ValueError:
        return {}
    entry = legs.get(leg) if isinstance(legs, dict) else None
    if isinstance(entry, dict):
        return {str(k): str(v) for k, v in entry.items()}
    return {} if legs else call_end


def _opt_int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def summarize(results: Sequence[CallResult], peak_active: int = 0, readback: bool = True) -> Summary:
    """Totals over a run's results: call outcomes once per call, media and transcripts per leg."""
    first: dict[str, CallResult] = {}
    for r in results:
        first.setdefault(r.sip_call_id, r)
    calls = list(first.values())
    legs = results
    outcomes = Counter(c.outcome for c in calls)
    rejected = [c for c in calls if c.outcome == "rejected"]
    answered = [c for c in calls if c.setup_s is not None]
    utts = [u for c in legs if c.outcome == "completed" for u in c.utterances]
    considered = sum(c.partials_with_successor for c in legs)
    wer_calls = [c for c in legs if c.outcome == "completed" and c.word_errors is not None and c.ref_words]
    ref_words = sum(c.ref_words or 0 for c in wer_calls)
    retry = [c.retry_after_s for c in rejected if c.retry_after_s is not None]
    reporting = [c for c in legs if c.gateway_rtp_packets is not None]
    return Summary(
        calls=len(calls),
        completed=outcomes["completed"],
        rejected=outcomes["rejected"],
        failed=outcomes["failed"],
        stopped=outcomes["stopped"],
        rejected_by_status={
            str(k): v for k, v in sorted(Counter(c.status for c in rejected).items(), key=str)
        },
        max_retry_after_s=max(retry) if retry else None,
        setup_s=analysis.stats(c.setup_s for c in answered if c.setup_s is not None),
        ttf_s=analysis.stats(u.ttf_s for u in utts if u.ttf_s is not None),
        ttfp_s=analysis.stats(u.ttfp_s for u in utts if u.ttfp_s is not None),
        ttf_published_s=analysis.stats(u.ttf_published_s for u in utts if u.ttf_published_s is not None),
        utterances=len(utts),
        utterances_without_final=sum(1 for u in utts if u.ttf_s is None) if readback else None,
        partials=sum(c.partials for c in legs),
        finals=sum(c.finals for c in legs),
        finals_outside=sum(c.finals_outside for c in legs),
        partial_instability=(sum(c.unstable_partials for c in legs) / considered) if considered else None,
        wer=(sum(c.word_errors or 0 for c in wer_calls) / ref_words) if ref_words else None,
        wer_ref_words=ref_words,
        rtp_planned=sum(c.rtp_planned for c in legs),
        rtp_sent=sum(c.rtp_sent for c in legs),
        rtp_send_errors=sum(c.rtp_send_errors for c in legs),
        rtp_echoed=sum(c.rtp_echoed for c in legs),
        rtcp_received=sum(c.rtcp_received for c in legs),
        completed_without_rtcp=sum(
            1 for c in legs if c.outcome == "completed" and not c.leg and not c.rtcp_received
        ),
        calls_without_call_end=(
            sum(1 for c in calls if c.setup_s is not None and not c.call_end_received) if readback else None
        ),
        gateway_rtp_packets=sum(c.gateway_rtp_packets or 0 for c in reporting) if reporting else None,
        rtp_sent_to_reporting_calls=sum(c.rtp_sent for c in reporting),
        lang_mismatches=sum(1 for c in calls if c.gateway_lang is not None and c.gateway_lang != c.lang),
        peak_active_calls=peak_active,
        legs=len(legs),
        legs_with_finals=sum(1 for c in legs if c.outcome == "completed" and c.finals > 0),
        events_on_other_legs=sum(c.events_on_other_legs for c in legs),
    )


# --- writers ---------------------------------------------------------------------------------------


def write_json(obj: Report | CapacityReport, path: Path) -> None:
    path.write_text(json.dumps(obj.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _opt(v: int | None) -> str:
    return "– (no readback)" if v is None else str(v)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.0f}"


def _stats_row(name: str, s: Stats) -> str:
    return f"| {name} | {s.n} | {_ms(s.p50)} | {_ms(s.p95)} | {_ms(s.p99)} | {_ms(s.mean)} | {_ms(s.max)} |"


def summary_markdown(s: Summary) -> list[str]:
    wer = "–" if s.wer is None else f"{100 * s.wer:.2f} % ({s.wer_ref_words} words)"
    instab = "–" if s.partial_instability is None else f"{100 * s.partial_instability:.2f} %"
    rejected = ", ".join(f"{k}: {v}" for k, v in s.rejected_by_status.items()) or "none"
    gateway = (
        "the gateway's call_end counters: none"
        if s.gateway_rtp_packets is None
        else f"the gateway counted {s.gateway_rtp_packets} RTP packets of the "
        f"{s.rtp_sent_to_reporting_calls} sent to the calls that reported it"
    )
    return [
        f"- calls: **{s.calls}**, completed {s.completed}, rejected {s.rejected} ({rejected}), "
        f"failed {s.failed}, stopped {s.stopped}; peak concurrent {s.peak_active_calls}",
        f"- utterances {s.utterances}, without a final {_opt(s.utterances_without_final)}; "
        f"partials {s.partials}, finals {s.finals} ({s.finals_outside} outside every utterance); "
        f"partial instability {instab}; WER {wer}",
        f"- RTP packets sent {s.rtp_sent} of {s.rtp_planned} planned; send errors {s.rtp_send_errors}; "
        f"calls without call_end {_opt(s.calls_without_call_end)}",
        f"- RTCP from the gateway (rtcp-mux): {s.rtcp_received} packets; completed calls with none "
        f"{s.completed_without_rtcp}",
        f"- {gateway}; calls in another language than asked: {s.lang_mismatches}",
        *(
            [
                f"- legs: **{s.legs}**, with finals {s.legs_with_finals}; transcripts on legs no call "
                f"expected {s.events_on_other_legs}"
            ]
            if s.legs != s.calls
            else []
        ),
        "",
        "| latency (ms) | n | p50 | p95 | p99 | mean | max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        _stats_row("time to final", s.ttf_s),
        _stats_row("time to final, to its XADD", s.ttf_published_s),
        _stats_row("time to first partial", s.ttfp_s),
        _stats_row("call setup (INVITE → 200)", s.setup_s),
    ]


def write_markdown(report: Report, path: Path, plots: Sequence[str] = ()) -> None:
    h = report.harness
    lat = h.send_lateness_ms
    c = report.config
    lines = [
        "# ttg replay report",
        "",
        f"Started {report.started_at}; target {c.get('target')} over {c.get('transport')}; "
        f"{c.get('load')}; impairments {c.get('impairments')}.",
        "",
        "## Summary",
        "",
        *summary_markdown(report.summary),
        "",
        "## Harness",
        "",
        f"- wall {h.wall_s:.1f} s, CPU {h.cpu_s:.1f} s = {h.cpu_percent:.1f} % of one core ({h.event_loop})",
        f"- {h.packets_sent} RTP packets, {h.packets_per_s:.0f} packets/s; send lateness p50/p99/max "
        f"{lat.p50 or 0:.2f}/{lat.p99 or 0:.2f}/{lat.max or 0:.2f} ms; "
        f"RFC 3550 send jitter mean {h.send_jitter_ms_mean:.3f} ms, max {h.send_jitter_ms_max:.3f} ms",
        f"- SIP sent {h.sip_sent}, received {h.sip_received}, unparsable {h.sip_parse_errors}, "
        f"stray {h.sip_stray}, transport errors {h.sip_transport_errors}; Redis entries read "
        f"{h.redis_entries_read}, errors {h.redis_errors}; /metrics scrape errors {h.scrape_errors}",
        "",
    ]
    if plots:
        lines += ["## Plots", "", *(f"![{p}]({p})" for p in plots), ""]
    per_leg = any(r.leg for r in report.calls)
    lines += [
        "## Legs" if per_leg else "## Calls",
        "",
        "| # | Call-ID | " + ("leg | SRC shape | " if per_leg else "") + "lang | outcome | setup ms | "
        "RTP sent | TTF ms (per utterance) | finals | WER |",
        "| --- | --- | " + ("--- | --- | " if per_leg else "") + "--- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.calls:
        ttf = " ".join(_ms(u.ttf_s) for u in r.utterances) or "–"
        wer = "–" if not r.ref_words else f"{100 * (r.word_errors or 0) / r.ref_words:.1f} %"
        outcome = r.outcome + (f" ({r.status} {r.detail})" if r.outcome != "completed" else "")
        leg = f"`{r.leg}` | {r.vendor} | " if per_leg else ""
        lines.append(
            f"| {r.index} | `{r.sip_call_id}` | {leg}{r.lang} | {outcome} | {_ms(r.setup_s)} | "
            f"{r.rtp_sent} | {ttf} | {r.finals} | {wer} |"
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_capacity_markdown(cap: CapacityReport, path: Path, plots: Sequence[str] = ()) -> None:
    base = "–" if cap.baseline_p95_s is None else f"{cap.baseline_p95_s * 1000:.0f} ms"
    lines = [
        "# ttg replay: capacity",
        "",
        f"Bound: p95 time-to-final ≤ **{cap.bound_s * 1000:.0f} ms** (single-call p95 {base} + margin). "
        f"Highest concurrency that held: **{cap.capacity}**.",
        "",
        "| concurrency | calls ok/total | TTF p50 | p95 | p99 ms | held | why not |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lv in cap.levels:
        s = lv.summary
        lines.append(
            f"| {lv.concurrency} | {s.completed}/{s.calls} | {_ms(s.ttf_s.p50)} | {_ms(s.ttf_s.p95)} | "
            f"{_ms(s.ttf_s.p99)} | {'yes' if lv.held else 'no'} | {lv.why} |"
        )
    if plots:
        lines += ["", *(f"![{p}]({p})" for p in plots)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
