"""decoder.onnx / joiner.onnx as onnxruntime sessions, with their I/O checked at creation.

Contract (docs/architecture.md, model_spec.md §6.1):

    decoder.onnx  token int64 [B,1], h_in f32 [L,B,H], c_in f32 [L,B,H] -> decoder_out [B,J], h_out, c_out
    joiner.onnx   encoder_frame f32 [B,J], decoder_out f32 [B,J] -> logits f32 [B,V]

B is symbolic in our graphs; the published export fixes it to 1. A fixed-batch graph is first widened
(its batch dims made symbolic) and the widened session is kept only if a batch of 3 gives exactly
the three single-row answers; otherwise rows go through the batch-1 session one by one. Either way
`decoder_step`/`joiner` take any batch size.

One `RnntGraphs` is owned by one thread (a decoder worker): sessions run with one intra-op and one
inter-op thread, sequential execution -- parallelism comes from workers, not from inside ORT.

The graphs may also come in memory (a bundle that holds the prediction network and joint as weights
has them built at load by asr_core.decoder.onnx_build): the same sessions, the same batched runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from numpy.typing import NDArray

from asr_core.decoder.extract import ExtractError, extract_rnnt_weights
from asr_core.decoder.numpy_rnnt import NumpyRnnt, RnntWeights
from asr_core.errors import BundleError

F32 = NDArray[np.float32]
DECODER_INPUTS = ("token", "h_in", "c_in")
DECODER_OUTPUTS = ("decoder_out", "h_out", "c_out")
JOINER_INPUTS = ("encoder_frame", "decoder_out")
JOINER_OUTPUTS = ("logits",)


@dataclass(frozen=True, slots=True)
class RnntShape:
    """What the graphs say about the model: LSTM layers L, hidden H, joint width J, vocabulary V."""

    layers: int
    hidden: int
    joint: int
    vocab: int


def session_options(threads: int = 1) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # ORT warnings (e.g. about widened shapes) are not ours to print
    return opts


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return out


def _elem(vi: onnx.ValueInfoProto) -> int:
    return int(vi.type.tensor_type.elem_type)


def _check_names(path: Path, kind: str, got: list[str], want: tuple[str, ...]) -> None:
    if sorted(got) != sorted(want):
        raise BundleError(f"{path.name}: {kind} are {got}, expected {list(want)}")


def _static(path: Path, what: str, dim: int | str | None, expected: int | None = None) -> int | None:
    if not isinstance(dim, int) or dim <= 0:
        return None
    if expected is not None and dim != expected:
        raise BundleError(f"{path.name}: {what} is {dim}, expected {expected}")
    return dim


def _widen_batch(model: onnx.ModelProto, batch_axes: dict[str, int]) -> onnx.ModelProto:
    """Copy of `model` whose graph inputs/outputs have a symbolic dim at the given axes."""
    wide = copy.deepcopy(model)
    for vi in list(wide.graph.input) + list(wide.graph.output):
        if vi.name in batch_axes:
            dim = vi.type.tensor_type.shape.dim[batch_axes[vi.name]]
            dim.Clear()
            dim.dim_param = "batch"
    del wide.graph.value_info[:]  # stale intermediate shapes would pin the batch again
    return wide


class RnntGraphs:
    """The prediction network and joint of a bundle, runnable at any batch size."""

    def __init__(
        self,
        decoder_path: Path | str | onnx.ModelProto,
        joiner_path: Path | str | onnx.ModelProto,
        *,
        vocab_size: int | None = None,
        hidden_size: int | None = None,
        num_layers: int | None = None,
        threads: int = 1,
    ) -> None:
        """From the two files, or from graphs already in memory (`decoder_path`/`joiner_path` are
        then their names in messages)."""
        self._models: tuple[onnx.ModelProto, onnx.ModelProto] | None = None
        if isinstance(decoder_path, onnx.ModelProto) and isinstance(joiner_path, onnx.ModelProto):
            self._models = (decoder_path, joiner_path)
            self.decoder_path, self.joiner_path = Path("decoder.onnx"), Path("joiner.onnx")
            dec_model, joi_model = decoder_path, joiner_path
        elif isinstance(decoder_path, onnx.ModelProto) or isinstance(joiner_path, onnx.ModelProto):
            raise TypeError("both graphs from files, or both in memory")
        else:
            self.decoder_path, self.joiner_path = Path(decoder_path), Path(joiner_path)
            dec_model = self._load(self.decoder_path)
            joi_model = self._load(self.joiner_path)
        self.shape = self._check_io(dec_model, joi_model, vocab_size, hidden_size, num_layers)
        opts = session_options(threads)
        self._dec, self.decoder_batched = self._sessions(
            dec_model,
            self.decoder_path,
            opts,
            {"token": 0, "h_in": 1, "c_in": 1, "decoder_out": 0, "h_out": 1, "c_out": 1},
        )
        self._joi, self.joiner_batched = self._sessions(
            joi_model, self.joiner_path, opts, {"encoder_frame": 0, "decoder_out": 0, "logits": 0}
        )
        self._check_run()

    # -- loading and validation -------------------------------------------------------------------

    @staticmethod
    def _load(path: Path) -> onnx.ModelProto:
        if not path.is_file():
            raise BundleError(f"{path.name}: missing ({path})")
        try:
            return onnx.load(str(path))
        except Exception as exc:  # protobuf raises several types for a damaged file
            raise BundleError(
                f"{path.name}: not a readable ONNX model ({exc.__class__.__name__}: {exc})"
            ) from exc

    def _check_io(
        self,
        dec: onnx.ModelProto,
        joi: onnx.ModelProto,
        vocab_size: int | None,
        hidden_size: int | None,
        num_layers: int | None,
    ) -> RnntShape:
        dp, jp = self.decoder_path, self.joiner_path
        inits = {i.name for i in dec.graph.initializer}
        d_in = {vi.name: vi for vi in dec.graph.input if vi.name not in inits}
        d_out = {vi.name: vi for vi in dec.graph.output}
        _check_names(dp, "inputs", list(d_in), DECODER_INPUTS)
        _check_names(dp, "outputs", list(d_out), DECODER_OUTPUTS)
        inits = {i.name for i in joi.graph.initializer}
        j_in = {vi.name: vi for vi in joi.graph.input if vi.name not in inits}
        j_out = {vi.name: vi for vi in joi.graph.output}
        _check_names(jp, "inputs", list(j_in), JOINER_INPUTS)
        _check_names(jp, "outputs", list(j_out), JOINER_OUTPUTS)

        f, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
        ranks = {
            (dp, "token"): (d_in["token"], i64, 2),
            (dp, "h_in"): (d_in["h_in"], f, 3),
            (dp, "c_in"): (d_in["c_in"], f, 3),
            (dp, "decoder_out"): (d_out["decoder_out"], f, 2),
            (dp, "h_out"): (d_out["h_out"], f, 3),
            (dp, "c_out"): (d_out["c_out"], f, 3),
            (jp, "encoder_frame"): (j_in["encoder_frame"], f, 2),
            (jp, "decoder_out"): (j_in["decoder_out"], f, 2),
            (jp, "logits"): (j_out["logits"], f, 2),
        }
        for (path, name), (vi, elem, rank) in ranks.items():
            if _elem(vi) != elem:
                want = "int64" if elem == i64 else "float32"
                raise BundleError(f"{path.name}: {name} has element type {_elem(vi)}, expected {want}")
            if len(_dims(vi)) != rank:
                raise BundleError(f"{path.name}: {name} has rank {len(_dims(vi))}, expected {rank}")
        h = _dims(d_in["h_in"])
        layers = _static(dp, "h_in layers (dim 0)", h[0], num_layers)
        hidden = _static(dp, "h_in hidden (dim 2)", h[2], hidden_size)
        _static(dp, "token dim 1", _dims(d_in["token"])[1], 1)
        joint = _static(jp, "encoder_frame width", _dims(j_in["encoder_frame"])[1])
        _static(jp, "joiner decoder_out width", _dims(j_in["decoder_out"])[1], joint)
        _static(dp, "decoder_out width", _dims(d_out["decoder_out"])[1], joint)
        vocab = _static(jp, "logits width (vocabulary)", _dims(j_out["logits"])[1], vocab_size)
        layers = layers or num_layers
        hidden = hidden or hidden_size
        if layers is None or hidden is None:
            raise BundleError(
                f"{dp.name}: h_in has no static [layers, batch, hidden] and the config gives none"
            )
        return RnntShape(layers=layers, hidden=hidden, joint=joint or -1, vocab=vocab or -1)

    def _sessions(
        self, model: onnx.ModelProto, path: Path, opts: ort.SessionOptions, batch_axes: dict[str, int]
    ) -> tuple[ort.InferenceSession, bool]:
        try:
            sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise BundleError(f"{path.name}: onnxruntime cannot load it ({exc})") from exc
        fixed = any(
            _dims(vi)[axis] == 1
            for vi in list(model.graph.input) + list(model.graph.output)
            if (axis := batch_axes.get(vi.name)) is not None
        )
        if not fixed:
            return sess, True
        try:
            wide = ort.InferenceSession(
                _widen_batch(model, batch_axes).SerializeToString(), opts, providers=["CPUExecutionProvider"]
            )
        except Exception:
            return sess, False
        return (wide, True) if self._same_rows(sess, wide, path) else (sess, False)

    def _probe_feeds(self, path: Path, batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        s = self.shape
        if path == self.decoder_path:
            state = (s.layers, batch, s.hidden)
            return {
                "token": (np.arange(batch, dtype=np.int64) % max(1, s.vocab if s.vocab > 0 else 1))[:, None],
                "h_in": rng.standard_normal(state).astype(np.float32),
                "c_in": rng.standard_normal(state).astype(np.float32),
            }
        width = s.joint if s.joint > 0 else s.hidden
        return {
            "encoder_frame": rng.standard_normal((batch, width)).astype(np.float32),
            "decoder_out": rng.standard_normal((batch, width)).astype(np.float32),
        }

    def _same_rows(self, one: ort.InferenceSession, wide: ort.InferenceSession, path: Path) -> bool:
        feeds = self._probe_feeds(path, 3)
        try:
            got = wide.run(None, feeds)
        except Exception:
            return False
        for row in range(3):
            single = {
                k: (v[:, row : row + 1] if k in ("h_in", "c_in") else v[row : row + 1])
                for k, v in feeds.items()
            }
            want = one.run(None, single)
            for name, g, w in zip((o.name for o in one.get_outputs()), got, want, strict=True):
                g_row = g[:, row : row + 1] if name in ("h_out", "c_out") else g[row : row + 1]
                if g_row.shape != w.shape or not np.allclose(g_row, w, rtol=1e-5, atol=1e-5):
                    return False
        return True

    def _check_run(self) -> None:
        try:
            dec = self.decoder_step(np.array([0], np.int64), *self.zero_state(1))
        except Exception as exc:
            raise BundleError(f"{self.decoder_path.name}: a test step failed ({exc})") from exc
        g = dec[0]
        if g.ndim != 2 or g.shape[0] != 1 or (self.shape.joint > 0 and g.shape[1] != self.shape.joint):
            raise BundleError(f"{self.decoder_path.name}: decoder_out has shape {g.shape}")
        try:
            logits = self.joiner(np.zeros_like(g), g)
        except Exception as exc:
            raise BundleError(f"{self.joiner_path.name}: a test step failed ({exc})") from exc
        if self.shape.joint < 0 or self.shape.vocab < 0:  # fill in what only a run could tell
            self.shape = RnntShape(
                self.shape.layers, self.shape.hidden, int(g.shape[1]), int(logits.shape[1])
            )

    def weights(self) -> RnntWeights:
        """The graphs' weights as arrays, checked against these sessions on a probe batch."""
        dec, joi = self._models or (onnx.load(str(self.decoder_path)), onnx.load(str(self.joiner_path)))
        weights = extract_rnnt_weights(dec, joi)
        net = NumpyRnnt(weights)
        feeds = self._probe_feeds(self.decoder_path, 3)
        tokens = feeds["token"][:, 0]
        want = self.decoder_step(tokens, feeds["h_in"], feeds["c_in"])
        got = net.decoder_step(tokens, feeds["h_in"], feeds["c_in"])
        want_logits = self.joiner(want[0], want[0])
        got_logits = net.joiner(want[0], want[0])
        for name, a, b in zip(
            ("decoder_out", "h_out", "c_out", "logits"), (*got, got_logits), (*want, want_logits), strict=True
        ):
            if a.shape != b.shape or not np.allclose(a, b, rtol=1e-4, atol=1e-4):
                raise ExtractError(f"{name} from the extracted weights differs from onnxruntime")
        return weights

    # -- the math ---------------------------------------------------------------------------------

    def zero_state(self, batch: int) -> tuple[F32, F32]:
        shape = (self.shape.layers, batch, self.shape.hidden)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def decoder_step(self, tokens: NDArray[np.integer], h: F32, c: F32) -> tuple[F32, F32, F32]:
        """tokens (B,), h/c (L,B,H) -> decoder_out (B,J), h', c'."""
        tok = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1, 1))
        if self.decoder_batched or tok.shape[0] == 1:
            g, h2, c2 = self._dec.run(DECODER_OUTPUTS, {"token": tok, "h_in": h, "c_in": c})
            return g, h2, c2
        rows = [
            self._dec.run(
                DECODER_OUTPUTS, {"token": tok[i : i + 1], "h_in": h[:, i : i + 1], "c_in": c[:, i : i + 1]}
            )
            for i in range(tok.shape[0])
        ]
        return (
            np.concatenate([r[0] for r in rows]),
            np.concatenate([r[1] for r in rows], axis=1),
            np.concatenate([r[2] for r in rows], axis=1),
        )

    def joiner(self, f: F32, g: F32) -> F32:
        """encoder frames f (B,J), decoder outputs g (B,J) -> logits (B,V)."""
        if self.joiner_batched or f.shape[0] == 1:
            logits: F32 = self._joi.run(JOINER_OUTPUTS, {"encoder_frame": f, "decoder_out": g})[0]
            return logits
        return np.concatenate(
            [
                self._joi.run(JOINER_OUTPUTS, {"encoder_frame": f[i : i + 1], "decoder_out": g[i : i + 1]})[0]
                for i in range(f.shape[0])
            ]
        )
