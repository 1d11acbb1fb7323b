"""Weights of decoder.onnx / joiner.onnx as plain arrays (for the numpy and MLX decoders).

Works on the graph's structure, not on initializer names, so both our graphs and exported ones are
read: the embedding is the Gather over a (V, H) initializer, each LSTM node gives W/R/B (ONNX gate
order i, o, f, c, converted back to PyTorch's i, f, g, o), the projector and the joint head are the
Gemm (or MatMul + Add) that follows. A graph of another shape is an `ExtractError`; callers verify
the result numerically against onnxruntime before trusting it (`RnntGraphs.weights()`).
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import numpy_helper

from asr_core.decoder.numpy_rnnt import LstmLayer, RnntWeights

F32 = NDArray[np.float32]
_TORCH_FROM_ONNX_GATES = (0, 2, 3, 1)  # ONNX blocks (i, o, f, c) -> PyTorch (i, f, g, o)


class ExtractError(ValueError):
    pass


def _gates_to_torch(w: F32) -> F32:
    blocks = np.split(w, 4, axis=0)
    return np.concatenate([blocks[k] for k in _TORCH_FROM_ONNX_GATES], axis=0)


def _inits(model: onnx.ModelProto) -> dict[str, F32]:
    out = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:  # constants folded into Constant nodes by some exporters
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            out[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return out


def _affine(model: onnx.ModelProto, inits: dict[str, F32]) -> tuple[F32, F32]:
    """The last Gemm (or MatMul [+ Add]) with a constant weight: returns (W (out, in), b (out,))."""
    nodes = list(model.graph.node)
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node.op_type == "Gemm" and node.input[1] in inits:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            w = inits[node.input[1]]
            w = w if attrs.get("transB", 0) else w.T
            if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0):
                raise ExtractError("Gemm with alpha/beta/transA is not supported")
            b = (
                inits[node.input[2]]
                if len(node.input) > 2 and node.input[2]
                else np.zeros(w.shape[0], np.float32)
            )
            return np.ascontiguousarray(w, np.float32), np.broadcast_to(b, (w.shape[0],)).astype(np.float32)
        if node.op_type == "MatMul" and node.input[1] in inits:
            w = inits[node.input[1]].T
            b = np.zeros(w.shape[0], np.float32)
            for later in nodes[i + 1 :]:
                if later.op_type == "Add" and node.output[0] in later.input:
                    other = [x for x in later.input if x != node.output[0]]
                    if other and other[0] in inits:
                        b = inits[other[0]].reshape(-1)
                    break
            return np.ascontiguousarray(w, np.float32), b.astype(np.float32)
    raise ExtractError("no Gemm/MatMul with constant weights")


def extract_rnnt_weights(decoder: onnx.ModelProto, joiner: onnx.ModelProto) -> RnntWeights:
    inits = _inits(decoder)
    gathers = [n for n in decoder.graph.node if n.op_type == "Gather" and n.input[0] in inits]
    if len(gathers) != 1:
        raise ExtractError(f"decoder: expected one embedding Gather, found {len(gathers)}")
    embedding = inits[gathers[0].input[0]].astype(np.float32)
    layers = []
    for node in (n for n in decoder.graph.node if n.op_type == "LSTM"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("direction", b"forward") not in (b"forward", "forward") or attrs.get("layout", 0) != 0:
            raise ExtractError("decoder: only forward LSTMs with layout 0 are supported")
        if "activations" in attrs or "clip" in attrs or attrs.get("input_forget", 0):
            raise ExtractError("decoder: LSTM with custom activations/clip/input_forget is not supported")
        w, r = inits[node.input[1]][0], inits[node.input[2]][0]
        hidden = r.shape[1]
        bias = np.zeros(8 * hidden, np.float32)
        if len(node.input) > 3 and node.input[3]:
            bias = inits[node.input[3]][0]
        layers.append(
            LstmLayer(
                _gates_to_torch(w).astype(np.float32),
                _gates_to_torch(r).astype(np.float32),
                _gates_to_torch(bias[: 4 * hidden] + bias[4 * hidden :]).astype(np.float32),
            )
        )
    if not layers:
        raise ExtractError("decoder: no LSTM node (a decoder exported with unrolled cells is not supported)")
    proj_w, proj_b = _affine(decoder, inits)
    head_w, head_b = _affine(joiner, _inits(joiner))
    return RnntWeights(embedding, tuple(layers), proj_w, proj_b, head_w, head_b)
