"""What the replay sends: audio loading and the VAD rule, call plans, RTP packets on an absolute
schedule, impairments, load shapes and language mixes (pure cores, no sockets)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from gateway.audio import g711
from gateway.rtp.packet import parse_rtp
from tests.fixtures import peers
from tests.fixtures.replay import burst_pcm, write_burst_wav
from tools.replay import audio
from tools.replay.config import Impairments, LanguageMix, LoadConfig
from tools.replay.load import LoadShape
from tools.replay.rtp import LatenessHistogram, RtpStream

BURSTS = [(300, 1300), (2100, 2800)]


def clip(tmp_path: Path, bursts: list[tuple[int, int]] = BURSTS, total_ms: int = 3200) -> audio.AudioClip:
    return audio.load_clip(write_burst_wav(tmp_path / "c.wav", bursts, total_ms, "hello world"), pause_ms=600)


# --- audio and VAD -------------------------------------------------------------------------------


def test_vad_finds_each_burst_to_the_frame() -> None:
    pcm = audio.to_int16(burst_pcm(BURSTS, 3200, rate=8000))
    assert audio.speech_segments(pcm, pause_ms=600) == [
        audio.Utterance(300, 1300),
        audio.Utterance(2100, 2800),
    ]


def test_vad_merges_speech_across_pauses_shorter_than_pause_ms_and_drops_clicks() -> None:
    pcm = audio.to_int16(burst_pcm([(200, 700), (1000, 1500), (2500, 2530), (3000, 3400)], 3600, rate=8000))
    assert audio.speech_segments(pcm, pause_ms=600) == [
        audio.Utterance(200, 1500),
        audio.Utterance(3000, 3400),
    ]
    assert len(audio.speech_segments(pcm, pause_ms=200)) == 3  # the 30 ms click still goes


def test_vad_threshold_follows_the_loudest_frame_so_a_noise_floor_is_not_speech() -> None:
    rng = np.random.default_rng(0)
    x = burst_pcm([(500, 1500)], 2000, rate=8000) + rng.normal(0, 10 ** (-60 / 20), 16000).astype(np.float32)
    assert audio.speech_segments(audio.to_int16(x), pause_ms=600) == [audio.Utterance(500, 1500)]


def test_files_of_any_rate_and_channels_are_read_as_8khz_mono_with_their_reference(tmp_path: Path) -> None:
    stereo = np.stack([burst_pcm(BURSTS, 3200, rate=44100)] * 2, axis=1)
    sf.write(str(tmp_path / "a.flac"), stereo, 44100)
    (tmp_path / "a.txt").write_text("the reference\n")
    c = audio.load_clip(tmp_path / "a.flac", pause_ms=600)
    assert c.pcm.dtype == np.int16 and len(c.pcm) == 3200 * 8
    assert c.reference == "the reference" and c.utterances == (
        audio.Utterance(300, 1300),
        audio.Utterance(2100, 2800),
    )


def test_headerless_g711_files_are_decoded(tmp_path: Path) -> None:
    pcm = audio.to_int16(burst_pcm(BURSTS, 3200, rate=8000))
    (tmp_path / "s.alaw").write_bytes(g711.encode(pcm, "PCMA"))
    c = audio.load_clip(tmp_path / "s.alaw", pause_ms=600)
    assert len(c.pcm) == len(pcm) and c.utterances == (
        audio.Utterance(300, 1300),
        audio.Utterance(2100, 2800),
    )


def test_unreadable_audio_and_empty_folders_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.wav").write_bytes(b"RIFF not really")
    with pytest.raises(audio.AudioError, match=r"bad\.wav"):
        audio.load_clip(tmp_path / "bad.wav", 600)
    (tmp_path / "empty").mkdir()
    with pytest.raises(audio.AudioError, match="no audio files"):
        audio.load_library(tmp_path / "empty", 600)


def test_language_folders_serve_their_language_and_root_files_the_rest(tmp_path: Path) -> None:
    write_burst_wav(tmp_path / "shared.wav", BURSTS, 3200)
    (tmp_path / "uk-UA").mkdir()
    write_burst_wav(tmp_path / "uk-UA" / "uk.wav", BURSTS, 3200)
    lib = audio.load_library(tmp_path, 600)
    assert [c.name for c in lib.pool("uk-UA")] == ["uk.wav"]
    assert [c.name for c in lib.pool("en-US")] == ["shared.wav"]


def test_generated_espeak_set_has_references_and_two_utterances_per_file(tmp_path: Path) -> None:
    peers.tool("espeak-ng")
    audio.generate_espeak(tmp_path, 1, ["en-US"])
    lib = audio.load_library(tmp_path, 600)
    [c] = lib.shared
    assert c.reference and len(c.reference.split()) > 10
    assert len(c.utterances) == 2  # two sentences 1.2 s apart
    stamp = (tmp_path / ".espeak-set").read_text()
    audio.generate_espeak(tmp_path, 1, ["en-US"])  # same parameters: reused, not regenerated
    assert (tmp_path / ".espeak-set").read_text() == stamp


# --- call plans ----------------------------------------------------------------------------------


def test_call_plan_puts_clips_on_packet_boundaries_with_lead_gap_and_tail(tmp_path: Path) -> None:
    c = clip(tmp_path)
    plan = audio.plan_call([c, c], ptime_ms=20, lead_ms=200, gap_ms=1000, tail_ms=2000)
    assert [p.first_packet for p in plan.clips] == [10, 10 + 160 + 50]
    assert plan.n_packets == 10 + 160 + 50 + 160 + 100
    first, second = plan.utterances[0], plan.utterances[2]
    assert (first.start_ms, first.end_ms, first.start_packet, first.end_packet) == (500, 1500, 25, 74)
    assert (second.start_ms, second.end_ms) == (200 + 3200 + 1000 + 300, 200 + 3200 + 1000 + 1300)
    assert plan.reference == "hello world hello world"
    # Each utterance names its sentence, the same in every call that plays the clip: a model that says
    # nothing for one sentence is told apart from a lost final by it.
    assert [u.sentence for u in plan.utterances] == [f"{c.name}#{k}" for _ in range(2) for k in range(2)]


def test_clip_picker_repeats_files_until_the_call_is_long_enough(tmp_path: Path) -> None:
    write_burst_wav(tmp_path / "a.wav", BURSTS, 3200)
    write_burst_wav(tmp_path / "b.wav", BURSTS, 3200)
    picker = audio.ClipPicker(audio.load_library(tmp_path, 600))
    assert [c.name for c in picker.clips_for_call("en-US", 0, 1000)] == ["a.wav"]
    assert [c.name for c in picker.clips_for_call("en-US", 10, 1000)] == ["b.wav", "a.wav", "b.wav"]


# --- RTP -----------------------------------------------------------------------------------------


NO_IMPAIRMENTS = Impairments()


def stream(
    tmp_path: Path, imp: Impairments = NO_IMPAIRMENTS, codec: str = "PCMU", ptime: int = 20
) -> RtpStream:
    plan = audio.plan_call([clip(tmp_path)], ptime, lead_ms=200, gap_ms=0, tail_ms=500)
    return RtpStream(plan, codec, 0 if codec == "PCMU" else 8, 100.0, ptime, imp, random.Random(7))


def test_packets_are_due_on_an_absolute_grid_so_a_late_send_does_not_shift_the_next(tmp_path: Path) -> None:
    s = stream(tmp_path)
    assert s.next_deadline() == 100.0
    s.emit(100.013)  # processed 13 ms late
    assert s.next_deadline() == pytest.approx(100.02)
    s.emit(100.02)
    assert s.next_deadline() == pytest.approx(100.04)
    assert s.lateness.n == 2 and s.lateness.max_s == pytest.approx(0.013)


def test_packets_carry_the_clip_in_g711_with_rfc3550_sequence_timestamp_and_marker(tmp_path: Path) -> None:
    s = stream(tmp_path, codec="PCMA")
    packets = []
    while not s.done:
        [(delay, data)] = s.emit(s.next_deadline() or 0.0)
        assert delay == 0
        packets.append(parse_rtp(data))
    assert len(packets) == s.n_packets == 10 + 160 + 25
    assert [p.marker for p in packets[:2]] == [True, False]
    assert all(p.payload_type == 8 and p.ssrc == packets[0].ssrc and len(p.payload) == 160 for p in packets)
    assert all((b.sequence_number - a.sequence_number) % 65536 == 1 for a, b in itertools.pairwise(packets))
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in itertools.pairwise(packets))
    sent = np.concatenate([g711.decode(p.payload, "PCMA") for p in packets[10:170]])
    expected = g711.decode(g711.encode(s.plan.clips[0].clip.pcm, "PCMA"), "PCMA")
    assert np.array_equal(sent, expected)
    assert set(packets[0].payload) == {g711.SILENCE_CODE["PCMA"]}  # the lead-in is silence


def test_other_ptimes_carry_ptime_times_8_samples(tmp_path: Path) -> None:
    s = stream(tmp_path, ptime=30)
    [(_, data)] = s.emit(100.0)
    assert len(parse_rtp(data).payload) == 240 and s.next_deadline() == pytest.approx(100.03)


def test_speech_marks_record_when_the_first_and_last_speech_packets_were_processed(tmp_path: Path) -> None:
    s = stream(tmp_path)
    u = s.plan.utterances[0]
    while not s.done:
        t = s.next_deadline() or 0.0
        s.emit(t + 0.001)
    assert s.marks[0].start_t == pytest.approx(100.0 + u.start_packet * 0.02 + 0.001)
    assert s.marks[0].end_t == pytest.approx(100.0 + u.end_packet * 0.02 + 0.001)


def run_impaired(tmp_path: Path, imp: Impairments, n_streams: int = 12) -> tuple[int, int, list[float], int]:
    planned = sent = reordered = 0
    delays: list[float] = []
    for _ in range(n_streams):
        s = stream(tmp_path, imp)
        while not s.done:
            out = s.emit(s.next_deadline() or 0.0)
            sent += len(out)
            delays += [d for d, _ in out]
        planned += s.n_packets
        reordered += s.impairer.reordered
    return planned, sent, delays, reordered


def test_loss_and_duplication_happen_at_the_configured_rates(tmp_path: Path) -> None:
    planned, sent, _, _ = run_impaired(tmp_path, Impairments(loss=0.1))
    assert 0.85 * planned < sent < 0.95 * planned  # 2340 packets: 10 % ± 5 %
    planned, sent, _, _ = run_impaired(tmp_path, Impairments(duplicate=0.2))
    assert 1.15 * planned < sent < 1.25 * planned


def test_jitter_delays_packets_uniformly_within_the_bound(tmp_path: Path) -> None:
    _, _, delays, _ = run_impaired(tmp_path, Impairments(jitter_ms=40))
    assert min(delays) >= 0 and max(delays) <= 0.040 and 0.015 < float(np.mean(delays)) < 0.025


def test_a_reordered_packet_leaves_after_the_next_one(tmp_path: Path) -> None:
    _, _, delays, reordered = run_impaired(tmp_path, Impairments(reorder=0.05))
    late = [d for d in delays if d > 0]
    assert len(late) == reordered > 0 and all(0.02 < d <= 0.03 for d in late)


def test_impairments_are_reproducible_from_the_seed(tmp_path: Path) -> None:
    a = run_impaired(tmp_path, Impairments(loss=0.1, jitter_ms=10, duplicate=0.1), 2)
    b = run_impaired(tmp_path, Impairments(loss=0.1, jitter_ms=10, duplicate=0.1), 2)
    assert a == b


def test_lateness_histogram_quantiles_at_a_tenth_of_a_millisecond() -> None:
    h = LatenessHistogram()
    for i in range(100):
        h.add(i * 0.0001)  # 0.0 .. 9.9 ms
    h.add(-0.001)  # early counts as on time
    assert h.n == 101 and h.quantile(0.5) == pytest.approx(0.0050)
    assert h.quantile(0.99) == pytest.approx(0.0099) and h.max_s == pytest.approx(0.0099)


# --- load shapes and languages ------------------------------------------------------------------


def test_concurrency_cap_holds_and_ended_calls_are_replaced_until_the_total() -> None:
    shape = LoadShape(LoadConfig(calls=3, total=5, cps=1000), 0.0)
    assert shape.due(0.0, 0) == 1  # rate 1000/s: one now, the next 1 ms later
    assert shape.due(0.001, 1) == 1 and shape.due(0.002, 2) == 1 and shape.due(0.003, 3) == 0
    assert shape.next_deadline(0.003, 3) is None  # full: wait for a call to end
    assert shape.due(1.0, 2) == 1 and shape.due(1.001, 2) == 1 and shape.due(1.002, 0) == 0
    assert not shape.accepting(1.002)


def test_arrivals_are_spaced_by_the_rate_and_a_wait_does_not_bank_a_burst() -> None:
    shape = LoadShape(LoadConfig(calls=100, total=100, cps=10), 0.0)
    assert shape.due(0.0, 0) == 1 and shape.due(0.05, 1) == 0
    assert shape.next_deadline(0.05, 1) == pytest.approx(0.1)
    assert shape.due(0.1005, 1) == 1  # a little late: the grid is kept
    assert shape.next_deadline(0.1005, 2) == pytest.approx(0.2)
    assert shape.due(5.0, 2) == 1 and shape.due(5.0, 3) == 0  # after a long wait: one, not 48


def test_ramp_raises_the_concurrency_target_linearly_to_calls() -> None:
    shape = LoadShape(LoadConfig(calls=5, cps=1000, ramp_s=8), 0.0)
    assert [shape.target(t) for t in (0, 1.9, 2, 4, 6, 8, 20)] == [1, 1, 2, 3, 4, 5, 5]
    assert shape.due(0.0, 0) == 1 and shape.next_deadline(0.0, 1) == pytest.approx(2.0)


def test_duration_keeps_placing_calls_until_it_ends() -> None:
    shape = LoadShape(LoadConfig(calls=2, cps=1000, duration_s=10), 0.0)
    assert shape.total is None
    started = sum(shape.due(t, 0) for t in np.arange(0, 12, 0.5))
    assert started == 20 and not shape.accepting(10.0)


def test_language_mix_assigns_exact_proportions_in_every_prefix() -> None:
    mix = LanguageMix.parse("en-US:0.7, uk-UA:0.3")
    langs = mix.assign(10)
    assert langs.count("en-US") == 7 and langs.count("uk-UA") == 3
    assert langs[:3].count("uk-UA") == 1
    assert LanguageMix.parse("de-DE").assign(2) == ["de-DE", "de-DE"]


@pytest.mark.parametrize("text", ["", "en-US:0", "en US:1", "en-US:x"])
def test_bad_language_mixes_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        LanguageMix.parse(text)


def test_impairment_probabilities_are_validated() -> None:
    with pytest.raises(ValueError, match="loss"):
        Impairments(loss=1.5)


@pytest.mark.parametrize("codec", ["PCMU", "PCMA"])
def test_packets_are_byte_identical_to_the_gateways_reference_packetizer(tmp_path: Path, codec: str) -> None:
    """The replay streams packets lazily (O(1) memory per call); gateway.rtp.sender builds a whole
    call's list up front. Given the same SSRC/sequence/timestamp, both must put the same bytes on the wire."""
    from gateway.rtp.sender import RtpSender

    s = stream(tmp_path, codec=codec)
    mine = []
    while not s.done:
        [(_, data)] = s.emit(s.next_deadline() or 0.0)
        mine.append(data)
    pcm = np.zeros(s.n_packets * s.spp, dtype=np.int16)  # the call's audio: silence with the clip in it
    placed = s.plan.clips[0]
    start = placed.first_packet * s.spp
    pcm[start : start + len(placed.clip.pcm)] = placed.clip.pcm
    ref = RtpSender(codec, ssrc=s.ssrc, seq=s.seq0, timestamp=s.ts0).audio(pcm)  # type: ignore[arg-type]
    assert [p.data for p in ref.packets] == mine
