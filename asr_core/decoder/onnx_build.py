"""decoder.onnx and joiner.onnx built node by node with onnx.helper (no torch export needed): what
`ttg make-bundle`/`ttg export` write, and what the loader builds in memory for a bundle that holds
the prediction network and joint as weights (the MLX layouts).

I/O follows the bundle contract (docs/architecture.md; the published export's names, model_spec.md §6.1)
with a symbolic batch dimension:

    decoder.onnx  token int64 [B,1], h_in f32 [L,B,H], c_in f32 [L,B,H]
                  -> decoder_out f32 [B,J] (through decoder_projector), h_out, c_out
    joiner.onnx   encoder_frame f32 [B,J], decoder_out f32 [B,J] -> logits f32 [B,V] (raw)

The prediction network is Gather (embedding) -> one ONNX LSTM node per layer -> Gemm (projector).
ONNX's LSTM takes its gates in the order i, o, f, c while PyTorch stores i, f, g, o, so the weight
blocks are permuted here; W and R get a leading num_directions axis and B = [Wb ; Rb].
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

from asr_core.decoder.numpy_rnnt import RnntWeights

OPSET = 17
PRODUCER = "ttg make-bundle"
BATCH = "batch"

# PyTorch gate blocks (i, f, g, o) -> ONNX order (i, o, f, c)
_TORCH_TO_ONNX_GATES = (0, 3, 1, 2)


def torch_gates_to_onnx(w: NDArray[np.float32]) -> NDArray[np.float32]:
    blocks = np.split(w, 4, axis=0)
    return np.concatenate([blocks[k] for k in _TORCH_TO_ONNX_GATES], axis=0)


def onnx_gates_to_torch(w: NDArray[np.float32]) -> NDArray[np.float32]:
    blocks = np.split(w, 4, axis=0)
    inverse = np.argsort(_TORCH_TO_ONNX_GATES)
    return np.concatenate([blocks[k] for k in inverse], axis=0)


def _init(name: str, array: NDArray[np.generic]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _model(graph: onnx.GraphProto, doc: str) -> onnx.ModelProto:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER, doc_string=doc
    )
    # ORT 1.17+ reads IR 9 models; pin it so the file does not change with the installed onnx version.
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def build_decoder(w: RnntWeights, lstm_b_ih: list[NDArray[np.float32]] | None = None) -> onnx.ModelProto:
    """The prediction network for one token step.

    `lstm_b_ih`, when given, splits each layer's summed bias back into (b_ih, b_hh = bias - b_ih) the
    way PyTorch stores it; the math is the same either way.
    """
    num_layers, hidden, proj_out = len(w.lstm), w.hidden, int(w.proj_w.shape[0])
    inits = [_init("decoder.embedding.weight", w.embedding), _init("axes_0", np.array([0], np.int64))]
    inits.append(_init("axes_1", np.array([1], np.int64)))
    inits.append(_init("split_layers", np.ones(num_layers, np.int64)))
    nodes = [
        helper.make_node("Gather", ["decoder.embedding.weight", "token"], ["embedded"], axis=0),  # [B,1,H]
        helper.make_node("Transpose", ["embedded"], ["x_0"], perm=[1, 0, 2]),  # [1,B,H] (seq, batch, in)
    ]
    if num_layers > 1:
        h_parts = [f"h_in_{i}" for i in range(num_layers)]
        c_parts = [f"c_in_{i}" for i in range(num_layers)]
        nodes.append(helper.make_node("Split", ["h_in", "split_layers"], h_parts, axis=0))
        nodes.append(helper.make_node("Split", ["c_in", "split_layers"], c_parts, axis=0))
    else:
        h_parts, c_parts = ["h_in"], ["c_in"]
    for i, layer in enumerate(w.lstm):
        b_ih = lstm_b_ih[i] if lstm_b_ih is not None else layer.bias
        b_hh = layer.bias - b_ih
        inits += [
            _init(f"decoder.lstm.{i}.W", torch_gates_to_onnx(layer.w_ih)[None]),
            _init(f"decoder.lstm.{i}.R", torch_gates_to_onnx(layer.w_hh)[None]),
            _init(
                f"decoder.lstm.{i}.B",
                np.concatenate([torch_gates_to_onnx(b_ih), torch_gates_to_onnx(b_hh)])[None],
            ),
        ]
        nodes.append(
            helper.make_node(
                "LSTM",
                [
                    f"x_{i}",
                    f"decoder.lstm.{i}.W",
                    f"decoder.lstm.{i}.R",
                    f"decoder.lstm.{i}.B",
                    "",
                    h_parts[i],
                    c_parts[i],
                ],
                [f"y_{i}", f"h_out_{i}", f"c_out_{i}"],
                hidden_size=hidden,
            )
        )
        nodes.append(helper.make_node("Squeeze", [f"y_{i}", "axes_1"], [f"x_{i + 1}"]))  # drop num_directions
    if num_layers > 1:
        nodes.append(helper.make_node("Concat", [f"h_out_{i}" for i in range(num_layers)], ["h_out"], axis=0))
        nodes.append(helper.make_node("Concat", [f"c_out_{i}" for i in range(num_layers)], ["c_out"], axis=0))
    else:
        nodes.append(helper.make_node("Identity", ["h_out_0"], ["h_out"]))
        nodes.append(helper.make_node("Identity", ["c_out_0"], ["c_out"]))
    inits += [
        _init("decoder.decoder_projector.weight", w.proj_w),
        _init("decoder.decoder_projector.bias", w.proj_b),
    ]
    nodes.append(helper.make_node("Squeeze", [f"x_{num_layers}", "axes_0"], ["last"]))  # [B,H]
    nodes.append(
        helper.make_node(
            "Gemm",
            ["last", "decoder.decoder_projector.weight", "decoder.decoder_projector.bias"],
            ["decoder_out"],
            transB=1,
        )
    )
    state: list[str | int | None] = [num_layers, BATCH, hidden]
    graph = helper.make_graph(
        nodes,
        "rnnt_prediction_network",
        inputs=[
            helper.make_tensor_value_info("token", TensorProto.INT64, [BATCH, 1]),
            helper.make_tensor_value_info("h_in", TensorProto.FLOAT, state),
            helper.make_tensor_value_info("c_in", TensorProto.FLOAT, state),
        ],
        outputs=[
            helper.make_tensor_value_info("decoder_out", TensorProto.FLOAT, [BATCH, proj_out]),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, state),
            helper.make_tensor_value_info("c_out", TensorProto.FLOAT, state),
        ],
        initializer=inits,
    )
    return _model(graph, "RNN-T prediction network: embedding -> LSTM -> decoder_projector (one token step)")


def build_joiner(w: RnntWeights) -> onnx.ModelProto:
    joint, vocab = int(w.head_w.shape[1]), w.vocab
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["encoder_frame", "decoder_out"], ["joint_sum"]),
            helper.make_node("Relu", ["joint_sum"], ["joint_hidden"]),
            helper.make_node(
                "Gemm", ["joint_hidden", "joint.head.weight", "joint.head.bias"], ["logits"], transB=1
            ),
        ],
        "rnnt_joint",
        inputs=[
            helper.make_tensor_value_info("encoder_frame", TensorProto.FLOAT, [BATCH, joint]),
            helper.make_tensor_value_info("decoder_out", TensorProto.FLOAT, [BATCH, joint]),
        ],
        outputs=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, vocab])],
        initializer=[_init("joint.head.weight", w.head_w), _init("joint.head.bias", w.head_b)],
    )
    return _model(graph, "RNN-T joint: head(relu(encoder_frame + decoder_out)), raw logits")
