"""RNN-T greedy decoding: the reference's tokens, per stream and batched, over checked ORT graphs."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors import safe_open

from asr_core.decoder import (
    BatchedGreedyDecoder,
    DecoderState,
    Emission,
    GreedyDecoder,
    NumpyRnnt,
    RnntGraphs,
    RnntWeights,
)
from asr_core.errors import BundleError
from asr_core.features import log_mel
from tests.fixtures import peers
from tests.fixtures.bundle import ReferenceBundle
from tools.bundle.filters import slaney_mel_filters
from tools.bundle.numpy_encoder import encoder_forward, joiner_frames
from tools.bundle.probe import probe_audio
from tools.bundle.spec import TINY

BLANK = 9


class ScriptedNet:
    """A fake prediction network + joint for the algorithm alone.

    g = [number of tokens emitted so far]; frame f = [tokens that should have been emitted once this
    frame is done]. The joint says token (count % 9) while count < target, else blank.
    """

    def __init__(self) -> None:
        self.decoder_calls = 0

    def zero_state(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((1, batch, 1), np.float32), np.zeros((1, batch, 1), np.float32)

    def decoder_step(self, tokens: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, ...]:
        self.decoder_calls += 1
        tokens = np.asarray(tokens)
        primed = tokens == BLANK  # the priming call: count stays 0
        h2 = h + np.where(primed, 0, 1)[None, :, None].astype(np.float32)
        return h2[0].copy(), h2, c.copy()

    def joiner(self, f: np.ndarray, g: np.ndarray) -> np.ndarray:
        logits = np.zeros((f.shape[0], BLANK + 1), np.float32)
        count, target = g[:, 0].astype(int), f[:, 0].astype(int)
        emit = count < target
        logits[np.arange(len(f)), np.where(emit, count % BLANK, BLANK)] = 1.0
        return logits


def _script(targets: list[int]) -> np.ndarray:
    return np.array(targets, np.float32)[:, None]


def test_each_frame_emits_until_blank_and_state_only_moves_on_emissions() -> None:
    net = ScriptedNet()
    dec = GreedyDecoder(net, BLANK)
    state = dec.new_state()
    assert net.decoder_calls == 1  # primed with blank once
    out = dec.decode(state, _script([0, 2, 2, 3]))
    assert [(e.token, e.frame) for e in out] == [(0, 1), (1, 1), (2, 3)]
    # each carries the softmax probability of its logit 1 against nine logits 0
    assert all(e.prob == pytest.approx(np.e / (np.e + 9)) for e in out)
    assert net.decoder_calls == 1 + 3  # a blank never runs the prediction network
    assert state.frames == 4 and float(state.g[0]) == 3


def test_at_most_max_symbols_per_frame_then_the_frame_advances() -> None:
    dec = GreedyDecoder(ScriptedNet(), BLANK, max_symbols=10)
    out = dec.decode(dec.new_state(), _script([25, 25]))
    assert [e.frame for e in out] == [0] * 10 + [1] * 10
    assert [e.token for e in out[:10]] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]


def test_state_carries_across_chunks() -> None:
    targets = [0, 1, 1, 4, 4, 4, 5, 9, 9, 10]
    dec = GreedyDecoder(ScriptedNet(), BLANK)
    whole = dec.decode(dec.new_state(), _script(targets))
    state = dec.new_state()
    parts: list[Emission] = []
    for a, b in ((0, 3), (3, 3), (3, 4), (4, 10)):
        parts += dec.decode(state, _script(targets[a:b]) if b > a else np.zeros((0, 1), np.float32))
    assert parts == whole
    assert state.frames == len(targets)


def test_batched_decoding_gives_each_stream_its_per_stream_tokens() -> None:
    rng = np.random.default_rng(0)
    scripts = [np.cumsum(rng.integers(0, 4, size=n)).tolist() for n in (0, 1, 5, 9, 13)]
    scripts.append([30, 30, 31])  # max-symbols bursts in a batch
    single = GreedyDecoder(ScriptedNet(), BLANK)
    want = [single.decode(single.new_state(), _script(s)) if s else [] for s in scripts]
    batched = BatchedGreedyDecoder(ScriptedNet(), BLANK)
    states = batched.new_states(len(scripts))
    got = batched.decode(states, [_script(s) if s else np.zeros((0, 1), np.float32) for s in scripts])
    assert got == want
    assert [s.frames for s in states] == [len(s) for s in scripts]


def test_batched_decoding_of_nothing() -> None:
    dec = BatchedGreedyDecoder(ScriptedNet(), BLANK)
    assert dec.decode([], []) == []
    with pytest.raises(ValueError):
        dec.decode(dec.new_states(2), [np.zeros((1, 1), np.float32)])


# -- the real graphs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graphs(tiny_bundle: Path) -> RnntGraphs:
    return RnntGraphs(tiny_bundle / "decoder.onnx", tiny_bundle / "joiner.onnx", vocab_size=TINY.vocab_size)


def _frames(n: int, seed: int) -> np.ndarray:
    # calibrated bundles see joiner inputs with mean 0 and std 0.5 (tools/bundle/weights.py)
    return (0.5 * np.random.default_rng(seed).standard_normal((n, TINY.decoder_hidden))).astype(np.float32)


@pytest.fixture(scope="module")
def speech_frames(tiny_bundle: Path) -> list[np.ndarray]:
    """The bundle's own encoder frames of 4 speech-like signals of 4 s (numpy encoder, offline)."""
    with safe_open(str(tiny_bundle / "encoder.safetensors"), "np") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    filters = slaney_mel_filters()
    return [
        joiner_frames(
            weights, encoder_forward(weights, log_mel(probe_audio(4.0, seed=s), filters), 4), 101, 128
        )
        for s in range(4)
    ]


def test_graphs_report_their_sizes_and_take_any_batch(graphs: RnntGraphs) -> None:
    assert (graphs.shape.layers, graphs.shape.hidden, graphs.shape.joint, graphs.shape.vocab) == (
        2,
        64,
        64,
        257,
    )
    assert graphs.decoder_batched and graphs.joiner_batched
    h, c = graphs.zero_state(3)
    g, h2, c2 = graphs.decoder_step(np.array([1, 2, 3]), h, c)
    assert g.shape == (3, 64) and h2.shape == c2.shape == (2, 3, 64)
    assert graphs.joiner(g, g).shape == (3, 257)


def test_numpy_rnnt_matches_the_onnx_graphs(reference_tiny: ReferenceBundle) -> None:
    state = {k: v.numpy() for k, v in reference_tiny.model.state_dict().items()}
    net = NumpyRnnt(RnntWeights.from_torch_names(state, TINY.decoder_layers))
    ort_graphs = RnntGraphs(reference_tiny.bundle / "decoder.onnx", reference_tiny.bundle / "joiner.onnx")
    h, c = net.zero_state(4)
    tokens = np.array([0, 5, TINY.blank_id, 100])
    for a, b in zip(net.decoder_step(tokens, h, c), ort_graphs.decoder_step(tokens, h, c), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    f = _frames(4, 2)
    np.testing.assert_allclose(net.joiner(f, f), ort_graphs.joiner(f, f), rtol=1e-5, atol=1e-4)
    frames = _frames(80, 3)
    numpy_dec, ort_dec = GreedyDecoder(net, TINY.blank_id), GreedyDecoder(ort_graphs, TINY.blank_id)
    assert numpy_dec.decode(numpy_dec.new_state(), frames) == ort_dec.decode(ort_dec.new_state(), frames)


def test_batched_equals_per_stream_on_the_real_graphs_with_streams_joining_midway(
    graphs: RnntGraphs, speech_frames: list[np.ndarray]
) -> None:
    rng = np.random.default_rng(5)
    n_streams, n_steps = 12, 14
    single = GreedyDecoder(graphs, TINY.blank_id)
    batched = BatchedGreedyDecoder(graphs, TINY.blank_id)
    # stream i joins at step i % 3 and sends chunks of 0..5 frames
    plans = {
        i: [_frames(int(rng.integers(0, 6)), 100 * i + k) for k in range(n_steps - i % 3)]
        for i in range(n_streams)
    }
    want = {}
    for i, chunks in plans.items():
        st = single.new_state()
        want[i] = [single.decode(st, ch) for ch in chunks]
    got: dict[int, list[list[Emission]]] = {i: [] for i in plans}
    states: dict[int, DecoderState] = {}
    for step in range(n_steps):
        due = [i for i in plans if step >= i % 3]
        for i in due:
            if i not in states:
                states[i] = batched.new_state()
        out = batched.decode([states[i] for i in due], [plans[i][step - i % 3] for i in due])
        for i, ems in zip(due, out, strict=True):
            got[i].append(ems)
    assert got == want
    assert sum(len(e) for chunks in want.values() for e in chunks) > 10  # tokens were emitted


# -- parity with the reference implementation (HF transformers generate) ---------------------------


def _hf_frames_and_tokens(
    ref: ReferenceBundle, audio: np.ndarray, prompt: int, lookahead: int
) -> tuple[np.ndarray, list[int]]:
    torch = peers.module("torch")
    transformers = peers.module("transformers")
    extractor = transformers.NemotronAsrStreamingFeatureExtractor(feature_size=128)
    feats = extractor(audio, sampling_rate=16000, return_tensors="pt")
    kw = {
        "input_features": feats["input_features"],
        "attention_mask": feats["attention_mask"],
        "prompt_ids": torch.tensor([prompt]),
        "num_lookahead_tokens": lookahead,
    }
    with torch.no_grad():
        enc = ref.model.get_audio_features(**kw)
        out = ref.model.generate(**kw, max_new_tokens=4000)
    n = int(enc.attention_mask.sum())
    tokens = [t for t in out.sequences[0].tolist()[1:] if t != ref.spec.blank_id]
    return enc.pooler_output[0, :n].numpy(), tokens


@pytest.mark.reference
@pytest.mark.parametrize(
    ("seed", "seconds", "prompt", "lookahead"),
    [(11, 3.0, 101, 3), (12, 2.3, 19, 0), (13, 4.1, 0, 13), (14, 1.0, 101, 6)],
)
def test_greedy_tokens_equal_the_reference_generate(
    reference_tiny: ReferenceBundle, seed: int, seconds: float, prompt: int, lookahead: int
) -> None:
    frames, want = _hf_frames_and_tokens(reference_tiny, probe_audio(seconds, seed=seed), prompt, lookahead)
    graphs = RnntGraphs(reference_tiny.bundle / "decoder.onnx", reference_tiny.bundle / "joiner.onnx")
    dec = GreedyDecoder(graphs, reference_tiny.spec.blank_id)
    assert [e.token for e in dec.decode(dec.new_state(), frames)] == want
    for chunk in (1, lookahead + 1, 7):  # any chunking of the same frames: the same tokens
        state, got = dec.new_state(), []
        for i in range(0, len(frames), chunk):
            got += [e.token for e in dec.decode(state, frames[i : i + chunk])]
        assert got == want, chunk
    assert want, "the calibrated reference model emits tokens"


@pytest.mark.reference
def test_streaming_tokens_equal_the_reference_streaming_generate(reference_tiny: ReferenceBundle) -> None:
    """HF's streaming generate (a generator of mel chunks, encoder caches carried) vs our decoder fed
    the same streaming encoder output chunk by chunk, predictor state carried across chunks."""
    torch = peers.module("torch")
    transformers = peers.module("transformers")
    model, lookahead, prompt = reference_tiny.model, 3, 19
    extractor = transformers.NemotronAsrStreamingFeatureExtractor(feature_size=128)
    n_mel = 25 + 32 * 9  # whole chunks only (HF requires exact chunk sizes)
    audio = probe_audio(n_mel * 0.01 + 0.005, seed=21)
    mel = extractor(audio, sampling_rate=16000, return_tensors="pt")["input_features"][:, :n_mel]
    bounds = [0, 25, *range(57, n_mel + 1, 32)]
    chunks = [mel[:, a:b] for a, b in itertools.pairwise(bounds)]

    def gen() -> Iterator[object]:
        yield from chunks

    with torch.no_grad():
        out = model.generate(
            gen(), prompt_ids=torch.tensor([prompt]), num_lookahead_tokens=lookahead, max_new_tokens=4000
        )
        frames, cache, pad = [], None, None
        for ch in chunks:
            enc = model.get_audio_features(
                input_features=ch,
                prompt_ids=torch.tensor([prompt]),
                num_lookahead_tokens=lookahead,
                use_cache=True,
                cache=cache,
                padding_cache=pad,
                output_attention_mask=False,
            )
            cache, pad = enc.cache, enc.padding_cache
            frames.append(enc.pooler_output[0].numpy())
    want = [t for t in out.sequences[0].tolist()[1:] if t != reference_tiny.spec.blank_id]
    graphs = RnntGraphs(reference_tiny.bundle / "decoder.onnx", reference_tiny.bundle / "joiner.onnx")
    batched = BatchedGreedyDecoder(graphs, reference_tiny.spec.blank_id)
    state = batched.new_state()
    got = [e.token for f in frames for e in batched.decode([state], [f])[0]]
    assert got == want and want


# -- graph validation -------------------------------------------------------------------------------


def _copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fix_batch(path: Path) -> None:
    """Rewrite a graph the way the published export has it: batch fixed to 1."""
    model = onnx.load(str(path))
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param == "batch":
                d.Clear()
                d.dim_value = 1
    onnx.save(model, str(path))


def test_fixed_batch_graphs_are_widened_and_give_the_same_results(
    tiny_bundle: Path, tmp_path: Path, graphs: RnntGraphs
) -> None:
    b = _copy_bundle(tiny_bundle, tmp_path / "b")
    _fix_batch(b / "decoder.onnx")
    _fix_batch(b / "joiner.onnx")
    fixed = RnntGraphs(b / "decoder.onnx", b / "joiner.onnx")
    assert fixed.decoder_batched and fixed.joiner_batched
    frames = [_frames(5, 7), _frames(3, 8)]
    a, bb = BatchedGreedyDecoder(fixed, TINY.blank_id), BatchedGreedyDecoder(graphs, TINY.blank_id)
    assert a.decode(a.new_states(2), frames) == bb.decode(bb.new_states(2), frames)


def test_a_joiner_that_cannot_be_widened_is_run_row_by_row(tmp_path: Path, graphs: RnntGraphs) -> None:
    j, v = 64, 257
    rng = np.random.default_rng(0)
    w = rng.standard_normal((j, v)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["encoder_frame", "decoder_out"], ["s"]),
            helper.make_node("Reshape", ["s", "shape"], ["r"]),  # hard-codes batch 1
            helper.make_node("MatMul", ["r", "w"], ["logits"]),
        ],
        "joiner",
        [
            helper.make_tensor_value_info("encoder_frame", TensorProto.FLOAT, [1, j]),
            helper.make_tensor_value_info("decoder_out", TensorProto.FLOAT, [1, j]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, v])],
        [numpy_helper.from_array(np.array([1, j], np.int64), "shape"), numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "joiner.onnx"))
    loop = RnntGraphs(graphs.decoder_path, tmp_path / "joiner.onnx")
    assert loop.decoder_batched and not loop.joiner_batched
    f = _frames(3, 4)
    np.testing.assert_allclose(loop.joiner(f, f), (f + f) @ w, rtol=1e-5, atol=1e-4)


def _rename_input(path: Path, old: str, new: str) -> None:
    model = onnx.load(str(path))
    for vi in model.graph.input:
        if vi.name == old:
            vi.name = new
    for node in model.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
    onnx.save(model, str(path))


def test_bad_graphs_are_one_line_errors_naming_the_file(tiny_bundle: Path, tmp_path: Path) -> None:
    b = _copy_bundle(tiny_bundle, tmp_path / "b")
    dec, joi = b / "decoder.onnx", b / "joiner.onnx"
    with pytest.raises(BundleError, match=r"logits width \(vocabulary\) is 257, expected 13088"):
        RnntGraphs(dec, joi, vocab_size=13088)
    with pytest.raises(BundleError, match=r"h_in hidden \(dim 2\) is 64, expected 640"):
        RnntGraphs(dec, joi, hidden_size=640)
    with pytest.raises(BundleError, match="missing"):
        RnntGraphs(b / "nope.onnx", joi)
    (b / "garbage.onnx").write_bytes(b"\x00not a protobuf" * 10)
    with pytest.raises(BundleError, match=r"garbage\.onnx: not a readable ONNX model"):
        RnntGraphs(b / "garbage.onnx", joi)
    _rename_input(joi, "encoder_frame", "encoder_outputs")
    with pytest.raises(BundleError, match=r"joiner.onnx: inputs are \['encoder_outputs', 'decoder_out'\]"):
        RnntGraphs(dec, joi)
    with pytest.raises(BundleError) as info:
        RnntGraphs(joi, dec)  # swapped files
    assert "\n" not in str(info.value)


def test_weights_read_back_from_the_graphs_are_the_reference_weights(reference_tiny: ReferenceBundle) -> None:
    state = {k: v.numpy() for k, v in reference_tiny.model.state_dict().items()}
    want = RnntWeights.from_torch_names(state, TINY.decoder_layers)
    got = RnntGraphs(reference_tiny.bundle / "decoder.onnx", reference_tiny.bundle / "joiner.onnx").weights()
    for name in ("embedding", "proj_w", "proj_b", "head_w", "head_b"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for a, b in zip(got.lstm, want.lstm, strict=True):
        np.testing.assert_array_equal(a.w_ih, b.w_ih)
        np.testing.assert_array_equal(a.w_hh, b.w_hh)
        np.testing.assert_allclose(a.bias, b.bias, atol=1e-7)


def test_numpy_and_mlx_nets_decode_the_tokens_of_onnxruntime(
    graphs: RnntGraphs, speech_frames: list[np.ndarray]
) -> None:
    from asr_core.decoder.mlx_rnnt import MlxRnnt

    weights = graphs.weights()
    per_net = []
    for net in (graphs, NumpyRnnt(weights), MlxRnnt(weights)):
        dec = BatchedGreedyDecoder(net, TINY.blank_id)
        states = dec.new_states(len(speech_frames))
        per_net.append([dec.decode(states, [f[a : a + 4] for f in speech_frames]) for a in range(0, 50, 4)])
    tokens = [[[(e.token, e.frame) for e in ems] for ems in step] for step in (s for n in per_net for s in n)]
    n = len(per_net[0])
    assert tokens[:n] == tokens[n : 2 * n] == tokens[2 * n :]
    assert any(any(ems) for step in per_net[0] for ems in step)
    # the token probabilities agree across the three nets and are probabilities
    probs = [[e.prob for step in net for ems in step for e in ems] for net in per_net]
    np.testing.assert_allclose(probs[1], probs[0], atol=1e-4)
    np.testing.assert_allclose(probs[2], probs[0], atol=1e-4)
    assert all(0.0 < p <= 1.0 for p in probs[0])


def test_device_decoder_gives_each_stream_its_per_stream_tokens_with_slots_coming_and_going(
    graphs: RnntGraphs,
) -> None:
    from asr_core.decoder.device import DeviceDecoder

    rng = np.random.default_rng(7)
    n_streams, n_steps = 12, 10
    single = GreedyDecoder(graphs, TINY.blank_id, max_symbols=3)
    device = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3, capacity=2)  # grows
    # stream i lives from step i % 4 to i % 4 + 6 and sends chunks of 0..5 frames (scaled up so that
    # frames trigger runs of tokens: max_symbols is reached)
    plans = {
        i: [3 * _frames(int(rng.integers(0, 6)), 50 * i + k) for k in range(6)] for i in range(n_streams)
    }
    want = {}
    for i, chunks in plans.items():
        st = single.new_state()
        want[i] = [single.decode(st, ch) for ch in chunks]
    got: dict[int, list[list[Emission]]] = {i: [] for i in plans}
    slots: dict[int, int] = {}
    for step in range(n_steps):
        for i in list(slots):
            if step - i % 4 >= 6:
                device.release(slots.pop(i))  # its slot is reused by a later stream
        due = [i for i in plans if 0 <= step - i % 4 < 6]
        for i in due:
            if i not in slots:
                slots[i] = device.alloc()
        out = device.decode([slots[i] for i in due], [plans[i][step - i % 4] for i in due])
        for i, ems in zip(due, out, strict=True):
            got[i].append(ems)
    assert _ids(got) == _ids(want)
    got_p = [e.prob for chunks in got.values() for ems in chunks for e in ems]
    want_p = [e.prob for chunks in want.values() for ems in chunks for e in ems]
    np.testing.assert_allclose(got_p, want_p, atol=1e-4)
    emitted = [len(e) for chunks in want.values() for e in chunks]
    assert sum(emitted) > 10 and max(emitted) > 5  # several tokens per frame in some chunks


def _ids(by_stream: dict[int, list[list[Emission]]]) -> dict[int, list[list[tuple[int, int]]]]:
    return {k: [[(e.token, e.frame) for e in ems] for ems in chunks] for k, chunks in by_stream.items()}


def test_a_device_decode_that_does_not_commit_leaves_the_state_as_it_was(graphs: RnntGraphs) -> None:
    from asr_core.decoder.device import DeviceDecoder

    device = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3)
    a, b = device.alloc(), device.alloc()
    first, probe, after = 3 * _frames(4, 1), 3 * _frames(4, 2), 3 * _frames(4, 3)
    device.decode([a, b], [first, first])
    tried = device.decode([a], [probe], [4], commit_frames=[0])  # what `a` would say: kept nowhere
    assert device.decode([a], [probe], [4], commit_frames=[0]) == tried  # (the same again: nothing moved)
    # a and b heard the same frames; the probe of a did not move it: both decode `after` alike.
    out_a, out_b = device.decode([a, b], [after, after], [4, 4])
    assert [(e.token, e.frame) for e in out_a] == [(e.token, e.frame) for e in out_b]
    single = GreedyDecoder(graphs, TINY.blank_id, max_symbols=3)
    st = single.new_state()
    single.decode(st, first)
    assert [(e.token, e.frame) for e in out_a] == [(e.token, e.frame) for e in single.decode(st, after)]
    assert out_a or tried[0]  # the frames are loud enough to emit


def test_a_commit_point_inside_the_chunk_equals_a_committed_decode_then_a_trial_from_it(
    graphs: RnntGraphs,
) -> None:
    """A flush in one pass: `commit_frames` keeps each row's state after its first k frames and goes on
    through the rest; tokens and kept states are those of two calls (commit the k frames, then decode
    the rest keeping nothing: `commit_frames` 0), for k at the start, inside and at the end of a row."""
    from asr_core.decoder.device import DeviceDecoder

    one, two = (DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3) for _ in range(2))
    chunks = [3 * _frames(n, 60 + i) for i, n in enumerate((6, 5, 8, 4))]
    keeps = [0, 2, 8, 4]
    warm = [3 * _frames(3, 70 + i) for i in range(4)]
    slots_one, slots_two = [one.alloc() for _ in chunks], [two.alloc() for _ in chunks]
    one.decode(slots_one, warm)
    two.decode(slots_two, warm)
    got = one.decode(slots_one, chunks, [3] * 4, commit_frames=keeps)
    head = two.decode(slots_two, [c[:k] for c, k in zip(chunks, keeps, strict=True)], [3] * 4)
    tail = two.decode(
        slots_two,
        [c[k:] for c, k in zip(chunks, keeps, strict=True)],
        [3 + k for k in keeps],
        commit_frames=[0] * 4,
    )
    assert [[(e.token, e.frame) for e in g] for g in got] == [
        [(e.token, e.frame) for e in h + t] for h, t in zip(head, tail, strict=True)
    ]
    assert sum(len(t) for t in tail) > 0 and sum(len(h) for h in head) > 0  # both parts emit
    after = [3 * _frames(5, 80 + i) for i in range(4)]  # the kept states decode alike from here
    assert [[(e.token, e.frame) for e in x] for x in one.decode(slots_one, after)] == [
        [(e.token, e.frame) for e in x] for x in two.decode(slots_two, after)
    ]


def test_device_decoder_warmup_traces_every_frame_bucket_and_leaves_no_trace_in_the_slots(
    graphs: RnntGraphs,
) -> None:
    from asr_core.decoder.device import DeviceDecoder

    warm = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3, capacity=2)
    cold = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3, capacity=2)
    assert warm.warmup(16) == 5  # 1, 2, 4, 8 and 16 frames
    assert warm.capacity == 2  # its scratch slot was given back
    assert warm.warmup(4, max_rows=5) == 4 * 3  # rows 1, 2, 4 and 8 (5 pads to 8); 1, 2, 4 frames
    assert warm.capacity == 8 and (warm.decodes, warm.iterations, warm.syncs) == (0, 0, 0)
    frames = 3 * _frames(4, 1)
    out_warm, out_cold = warm.decode([warm.alloc()], [frames]), cold.decode([cold.alloc()], [frames])
    assert [(e.token, e.frame) for e in out_warm[0]] == [(e.token, e.frame) for e in out_cold[0]]


def test_a_device_decode_takes_one_iteration_per_token_and_one_more_not_one_per_frame(
    graphs: RnntGraphs,
) -> None:
    """Blank frames between two tokens are judged together (the state does not change over them): a
    row needs as many iterations as it emits tokens, plus one that finds none left. Once the decoder
    has seen what such a decode needs, it queues that many and fetches everything in one sync."""
    from asr_core.decoder.device import DeviceDecoder

    device = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3, capacity=4)
    single = GreedyDecoder(graphs, TINY.blank_id, max_symbols=3)
    chunks = [_frames(16, 110 + i) for i in range(4)]  # 16 frames a row
    want = [[(e.token, e.frame) for e in single.decode(single.new_state(), ch)] for ch in chunks]
    needed = max(len(w) for w in want) + 1
    assert 1 < needed < 16  # the rows emit, on fewer frames than they have
    for attempt in range(3):
        slots = device.alloc_many(4)  # fresh streams: the same decode each time
        before = (device.iterations, device.syncs)
        got = device.decode(slots, chunks)
        assert [[(e.token, e.frame) for e in g] for g in got] == want
        if attempt:
            assert (device.iterations - before[0], device.syncs - before[1]) == (needed, 1)
        for slot in slots:
            device.release(slot)
    assert device.decodes == 3


def test_device_decoder_refuses_unknown_and_repeated_slots(graphs: RnntGraphs) -> None:
    from asr_core.decoder.device import DeviceDecoder

    device = DeviceDecoder(graphs.weights(), TINY.blank_id)
    a = device.alloc()
    with pytest.raises(ValueError, match="twice"):
        device.decode([a, a], [_frames(2, 0), _frames(2, 1)])
    with pytest.raises(ValueError, match="not allocated"):
        device.decode([a + 1], [_frames(2, 0)])
    device.release(a)
    with pytest.raises(ValueError, match="not allocated"):
        device.release(a)
    assert device.decode([], []) == []


def test_slots_allocated_together_start_primed_like_one_at_a_time(graphs: RnntGraphs) -> None:
    """A step's joins get their slots in one scatter; a reused slot forgets its old stream."""
    from asr_core.decoder.device import DeviceDecoder

    device = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3, capacity=2)
    old = device.alloc()
    device.decode([old], [3 * _frames(6, 90)])  # moves the slot's state away from the primed one
    device.release(old)
    many = device.alloc_many(3)  # reuses `old`, grows the pools for the rest
    assert old in many and device.capacity >= 4
    single = device.alloc()
    probe = 3 * _frames(5, 91)
    want = [(e.token, e.frame) for e in device.decode([single], [probe], [0])[0]]
    assert want  # the probe emits
    for slot in many:
        assert [(e.token, e.frame) for e in device.decode([slot], [probe], [0])[0]] == want


def test_a_device_decoder_iteration_gathers_only_the_tokens_embeddings_and_the_winning_logits(
    graphs: RnntGraphs, tmp_path: Path
) -> None:
    """An iteration's kernels are paid once per token a step emits: its graph gathers only the tokens'
    embeddings and the logits at each row's winning frame (each LSTM layer's state is read as a view,
    not gathered whole), and makes no index arrays of its own (the frames' and rows' positions come in,
    made once a decode)."""
    import mlx.core as mx

    from asr_core.decoder.device import DeviceDecoder
    from tools.bench.gpu_encoder import graph_launches

    device = DeviceDecoder(graphs.weights(), TINY.blank_id, max_symbols=3)
    B, T = 4, 8
    state = (mx.zeros((B, device.width)), *[mx.zeros((device.layers, B, device.hidden))] * 2)
    inputs = [
        mx.array(3 * np.stack([_frames(T, 120 + i) for i in range(B)])),
        mx.arange(T, dtype=mx.int32)[None],
        mx.arange(B, dtype=mx.int32),
        mx.full((B,), T, mx.int32),
        mx.full((B,), T, mx.int32),
        mx.zeros((B,), mx.int32),
        mx.zeros((B,), mx.int32),
        *state,
        *state,
    ]
    mx.eval(inputs)
    outputs = device._step(*inputs)
    mx.export_to_dot(str(tmp_path / "iteration.dot"), *outputs)
    kernels = graph_launches((tmp_path / "iteration.dot").read_text())["by_primitive"]
    assert kernels.get("Gather") == 2 and "Arange" not in kernels, kernels
