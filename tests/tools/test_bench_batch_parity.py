"""`ttg bench batch-parity` on the CPU: in f32 every stream of a many-row run says exactly what its
file says alone (batched == solo, through the whole engine with device-style decoding), the encoder's
frames of a stream stepped in a batch are its solo frames within rounding (compiled or not, and the
CPU's), and the device decoder gives the reference decoder's tokens for them alone and in a batch."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from asr_core.model import embedded_model_dir
from tests.fixtures import peers
from tools.bench.batch_parity import add_arguments, main


def test_every_stream_of_a_batched_run_has_its_files_solo_tokens_in_f32(tmp_path: Path) -> None:
    audio = tmp_path / "audio"
    audio.mkdir()
    for name, text in (("a", "could you check my account please"), ("b", "the engineer never came")):
        subprocess.run(
            [peers.tool("espeak-ng"), "-v", "en-us", "-s", "160", "-w", str(audio / f"{name}.wav"), text],
            check=True,
        )
    model = embedded_model_dir()
    assert model is not None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "parity.json"
    argv = ["--model", str(model), "--audio", str(audio), "--streams", "6", "--precision", "f32"]
    args = parser.parse_args([*argv, "--json", str(out)])
    assert main(args) == 0
    (r,) = json.loads(out.read_text())
    assert r["precision"] == "f32" and r["streams"] == 6 and r["files"] == 2
    assert all(n > 0 for n in r["solo_final_tokens"].values()), r  # each file says something alone
    assert r["max_batch"] > 1  # the streams really shared steps
    assert r["differing_streams"] == 0, r["examples"]
    assert r["frames_max_rel_diff"] < 1e-4  # the encoder's frames too, within f32 rounding
    # Compiled or not, batched or not, and against the CPU's: the same frames within f32 rounding.
    assert set(r["frames"]) >= {
        "engine batched vs engine solo",
        "plain solo vs engine solo",
        "engine solo vs cpu",
    }
    frames = r["frames"]
    assert all(d["rel"] < 1e-4 and d["first_chunk_over_1pct"] is None for d in frames.values()), frames
    assert r["reference_on_batched_frames_vs_solo_frames"] == 0
    assert r["matmul_one_row_vs_eight_rel_diff"]["f32"] < 1e-4
    # The device decoder, alone and batched, says what the reference decoder says on the same frames.
    assert r["decoder_device_solo_vs_reference"] == 0 and r["decoder_device_batched_vs_reference"] == 0
