"""G.711 tables against ITU-T G.711 values and the classic reference implementation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gateway.audio import g711
from tests.fixtures import peers

# ITU-T G.711 Table 2 (µ-law): decoder output value (14-bit scale) of the first step of each segment,
# y = (33·2^e) − 33, and the largest output 8031. Our int16 scale is ×4.
MU_SEGMENT_STARTS = [0, 33, 99, 231, 495, 1023, 2079, 4191]
# ITU-T G.711 Table 1 (A-law): first output of each segment (13-bit scale, max 4032). Our scale is ×8.
A_SEGMENT_STARTS = [1, 33, 66, 132, 264, 528, 1056, 2112]


def mu_code(positive: bool, segment: int, step: int) -> int:
    """The transmitted µ-law character: bit 7 = 1 for positive; segment and step bits inverted."""
    return ((0 if positive else 0x80) | (segment << 4) | step) ^ 0xFF


def a_code(positive: bool, segment: int, step: int) -> int:
    """The transmitted A-law character: even bits inverted (XOR 0x55); sign bit 1 = positive."""
    return ((0x80 if positive else 0) | (segment << 4) | step) ^ 0x55


@pytest.mark.parametrize("segment", range(8))
def test_ulaw_segment_starts_decode_to_itu_table_values(segment: int) -> None:
    assert g711.ULAW_TO_INT16[mu_code(True, segment, 0)] == MU_SEGMENT_STARTS[segment] * 4
    assert g711.ULAW_TO_INT16[mu_code(False, segment, 0)] == -MU_SEGMENT_STARTS[segment] * 4


@pytest.mark.parametrize("segment", range(8))
def test_alaw_segment_starts_decode_to_itu_table_values(segment: int) -> None:
    assert g711.ALAW_TO_INT16[a_code(True, segment, 0)] == A_SEGMENT_STARTS[segment] * 8
    assert g711.ALAW_TO_INT16[a_code(False, segment, 0)] == -A_SEGMENT_STARTS[segment] * 8


def test_ulaw_extremes_and_the_two_zeros() -> None:
    assert g711.ULAW_TO_INT16[0x80] == 8031 * 4
    assert g711.ULAW_TO_INT16[0x00] == -8031 * 4
    assert g711.ULAW_TO_INT16[0xFF] == 0
    assert g711.ULAW_TO_INT16[0x7F] == 0


def test_alaw_extremes_and_the_smallest_steps() -> None:
    assert g711.ALAW_TO_INT16[0xAA] == 4032 * 8
    assert g711.ALAW_TO_INT16[0x2A] == -4032 * 8
    assert g711.ALAW_TO_INT16[0xD5] == 8  # A-law has no zero: its silence code decodes to +1 (13-bit)
    assert g711.ALAW_TO_INT16[0x55] == -8


@pytest.mark.parametrize("law", ["PCMU", "PCMA"])
def test_step_sizes_double_each_segment(law: str) -> None:
    table = g711.DECODE_INT16[law].astype(np.int64)
    positive = np.sort(table[table > 0])
    steps = np.diff(np.unique(positive))
    # 16 steps per segment; within a segment the step is constant, and it doubles segment to segment.
    assert set(steps[:14].tolist()) == {8 if law == "PCMU" else 16}
    assert steps.max() == (256 * 4 if law == "PCMU" else 128 * 8)


@pytest.mark.parametrize("law", ["PCMU", "PCMA"])
def test_every_code_survives_decode_then_encode(law: str) -> None:
    codes = np.arange(256, dtype=np.uint8)
    again = np.frombuffer(g711.encode(g711.DECODE_INT16[law][codes], law), dtype=np.uint8)  # type: ignore[arg-type]
    if law == "PCMU":
        # µ-law's negative zero (0x7F) decodes to 0, which encodes as positive zero (0xFF).
        expected = codes.copy()
        expected[0x7F] = 0xFF
        assert np.array_equal(again, expected)
    else:
        assert np.array_equal(again, codes)


@pytest.mark.parametrize("law", ["PCMU", "PCMA"])
def test_encoding_is_monotonic_and_error_is_within_one_step(law: str) -> None:
    x = np.arange(-32768, 32768, dtype=np.int64)
    y = g711.decode(g711.encode(x.astype(np.int16), law), law).astype(np.int64)  # type: ignore[arg-type]
    assert np.all(np.diff(y) >= 0)
    levels = np.unique(g711.DECODE_INT16[law].astype(np.int64))
    idx = np.searchsorted(levels, y)
    gap_below = np.where(idx > 0, levels[idx] - levels[np.maximum(idx - 1, 0)], 0)
    gap_above = np.where(idx < len(levels) - 1, levels[np.minimum(idx + 1, len(levels) - 1)] - levels[idx], 0)
    inside = np.abs(x) <= levels.max()
    assert np.all(np.abs(x - y)[inside] <= np.maximum(gap_below, gap_above)[inside])


def test_tables_equal_the_reference_implementation_for_every_input() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = peers.module("audioop")  # the classic Sun/CCITT code (stdlib ≤ 3.12, audioop-lts)
    codes = bytes(range(256))
    assert np.array_equal(np.frombuffer(audioop.ulaw2lin(codes, 2), np.int16), g711.ULAW_TO_INT16)
    assert np.array_equal(np.frombuffer(audioop.alaw2lin(codes, 2), np.int16), g711.ALAW_TO_INT16)
    x = np.arange(-32768, 32768, dtype=np.int16)
    assert audioop.lin2ulaw(x.tobytes(), 2) == g711.encode(x, "PCMU")
    assert audioop.lin2alaw(x.tobytes(), 2) == g711.encode(x, "PCMA")


def test_float_tables_are_the_int16_tables_over_32768() -> None:
    for law in ("PCMU", "PCMA"):
        assert g711.DECODE_FLOAT32[law].dtype == np.float32
        assert np.array_equal(g711.DECODE_FLOAT32[law] * 32768.0, g711.DECODE_INT16[law].astype(np.float32))
        assert np.abs(g711.DECODE_FLOAT32[law]).max() < 1.0


def test_silence_codes_decode_to_near_zero() -> None:
    assert g711.decode(bytes([g711.SILENCE_CODE["PCMU"]]) * 4, "PCMU").tolist() == [0, 0, 0, 0]
    assert g711.decode(bytes([g711.SILENCE_CODE["PCMA"]]), "PCMA").tolist() == [8]
