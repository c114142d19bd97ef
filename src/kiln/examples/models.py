"""ONNX graphs and seeded weights for the example models.

Every graph is built with ``onnx.helper`` so the example repository needs no downloads, and
every weight comes from a seeded generator so two builds produce byte-identical files. The
weight functions are the single source of truth: the ONNX builders here and the NumPy
reference in :mod:`kiln.examples.reference` both call them, so they cannot drift apart.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

# Opset 17 / IR 8 is old enough for every onnxruntime >= 1.14 and new enough for all the ops
# used here; newer IR versions are rejected by older runtimes, so the value is pinned rather
# than taken from the installed onnx package.
OPSET = 17
IR_VERSION = 8

# Symbolic name of the leading dimension: the server's batcher stacks requests along it.
BATCH_DIM = "batch"

# Shape constants shared with the configs and the reference implementation.
SIMPLE_WIDTH = 16
MLP_INPUT = 64  # an 8x8 digit image, flattened (like scikit-learn's digits data set)
MLP_HIDDEN = (256, 128)
MLP_PIXEL_MAX = 16.0  # digits pixels are counts 0..16, not intensities in [0, 1]
NUM_CLASSES = 10
CNN_IMAGE = (1, 28, 28)  # C, H, W (an MNIST-sized grayscale image)
CNN_CHANNELS = (8, 16)
CNN_KERNEL = 3
# The cnn_pipeline ensemble takes raw 8-bit images in H, W, C order, as cameras and image
# libraries produce them; image_preprocess turns them into the cnn's [0, 1] N, C, H, W floats.
RAW_IMAGE = (CNN_IMAGE[1], CNN_IMAGE[2], CNN_IMAGE[0])  # H, W, C
RAW_PIXEL_MAX = 255.0

WEIGHT_SEED = 0

Weights = dict[str, npt.NDArray[np.float32]]


def _he_normal(
    rng: np.random.Generator, shape: tuple[int, ...], fan_in: int
) -> npt.NDArray[np.float32]:
    # He scaling keeps activations at a similar magnitude through the ReLU layers, so the
    # random classifiers produce spread-out (not saturated, not uniform) probabilities.
    out: npt.NDArray[np.float32] = (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(
        np.float32
    )
    return out


def _small_bias(rng: np.random.Generator, size: int) -> npt.NDArray[np.float32]:
    # Non-zero biases so that a backend which drops the Add would be caught by the tests.
    return (rng.standard_normal(size) * 0.1).astype(np.float32)


def mlp_weights() -> Weights:
    """Weights of the ``mlp`` model, keyed by ONNX initializer name (``W*`` are [in, out])."""
    rng = np.random.default_rng(WEIGHT_SEED)
    sizes = (MLP_INPUT, *MLP_HIDDEN, NUM_CLASSES)
    weights: Weights = {}
    for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes), start=1):
        weights[f"W{layer}"] = _he_normal(rng, (fan_in, fan_out), fan_in)
        weights[f"B{layer}"] = _small_bias(rng, fan_out)
    # Fold the usual "divide pixels by 16" normalization into the first layer so clients can
    # send raw digits data. Without it the logits reach ~20 and float32 rounding in the
    # runtime approaches the 1e-4 relative tolerance the tests compare with.
    weights["W1"] /= np.float32(MLP_PIXEL_MAX)
    return weights


def cnn_weights() -> Weights:
    """Weights of the ``cnn`` model, keyed by ONNX initializer name.

    ``conv*_W`` are [out_channels, in_channels, k, k] (ONNX Conv layout); ``fc_W`` is
    [features, classes] where features are flattened in C, H, W order.
    """
    rng = np.random.default_rng(WEIGHT_SEED)
    k = CNN_KERNEL
    in_channels, height, width = CNN_IMAGE
    weights: Weights = {}
    for layer, out_channels in enumerate(CNN_CHANNELS, start=1):
        fan_in = in_channels * k * k
        weights[f"conv{layer}_W"] = _he_normal(rng, (out_channels, in_channels, k, k), fan_in)
        weights[f"conv{layer}_B"] = _small_bias(rng, out_channels)
        in_channels = out_channels
        height, width = height // 2, width // 2  # each conv block ends with a 2x2 max pool
    features = in_channels * height * width
    weights["fc_W"] = _he_normal(rng, (features, NUM_CLASSES), features)
    weights["fc_B"] = _small_bias(rng, NUM_CLASSES)
    return weights


def _value_info(name: str, elem_type: int, dims: tuple[int, ...]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, [BATCH_DIM, *dims])


def _finish(graph: onnx.GraphProto, doc: str) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="kiln",
        doc_string=doc,
    )
    # full_check runs shape inference too, so a wrong dim in a builder fails here, at build
    # time, rather than when the server first loads the file.
    onnx.checker.check_model(model, full_check=True)
    return model


def _initializers(weights: Weights) -> list[TensorProto]:
    # Sorted so that the serialized file does not depend on dict insertion order.
    return [numpy_helper.from_array(weights[name], name) for name in sorted(weights)]


def build_simple() -> onnx.ModelProto:
    """``OUTPUT0 = INPUT0 + INPUT1`` and ``OUTPUT1 = INPUT0 - INPUT1`` on int32 [batch, 16]."""
    dims = (SIMPLE_WIDTH,)
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [
            _value_info("INPUT0", TensorProto.INT32, dims),
            _value_info("INPUT1", TensorProto.INT32, dims),
        ],
        [
            _value_info("OUTPUT0", TensorProto.INT32, dims),
            _value_info("OUTPUT1", TensorProto.INT32, dims),
        ],
    )
    return _finish(graph, "Triton's classic 'simple' example: element-wise sum and difference.")


def build_simple_string() -> onnx.ModelProto:
    """``simple`` on decimal strings: parse to int32, add/subtract, format back to strings."""
    dims = (SIMPLE_WIDTH,)
    to_int = TensorProto.INT32
    to_str = TensorProto.STRING
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["INPUT0"], ["input0_int"], to=to_int),
            helper.make_node("Cast", ["INPUT1"], ["input1_int"], to=to_int),
            helper.make_node("Add", ["input0_int", "input1_int"], ["sum_int"]),
            helper.make_node("Sub", ["input0_int", "input1_int"], ["diff_int"]),
            helper.make_node("Cast", ["sum_int"], ["OUTPUT0"], to=to_str),
            helper.make_node("Cast", ["diff_int"], ["OUTPUT1"], to=to_str),
        ],
        "simple_string",
        [_value_info("INPUT0", to_str, dims), _value_info("INPUT1", to_str, dims)],
        [_value_info("OUTPUT0", to_str, dims), _value_info("OUTPUT1", to_str, dims)],
    )
    return _finish(
        graph, "Triton's 'simple_string' example: sum and difference of decimal strings."
    )


def build_mlp() -> onnx.ModelProto:
    """64 -> 256 -> ReLU -> 128 -> ReLU -> 10 classifier with LOGITS and PROBABILITIES."""
    nodes: list[onnx.NodeProto] = []
    current = "INPUT"
    layers = len(MLP_HIDDEN) + 1
    for layer in range(1, layers + 1):
        matmul = f"fc{layer}_matmul"
        nodes.append(helper.make_node("MatMul", [current, f"W{layer}"], [matmul]))
        # The last affine layer writes the LOGITS output directly; the others feed a ReLU.
        added = "LOGITS" if layer == layers else f"fc{layer}_out"
        nodes.append(helper.make_node("Add", [matmul, f"B{layer}"], [added]))
        if layer < layers:
            current = f"relu{layer}_out"
            nodes.append(helper.make_node("Relu", [added], [current]))
    nodes.append(helper.make_node("Softmax", ["LOGITS"], ["PROBABILITIES"], axis=-1))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [_value_info("INPUT", TensorProto.FLOAT, (MLP_INPUT,))],
        [
            _value_info("LOGITS", TensorProto.FLOAT, (NUM_CLASSES,)),
            _value_info("PROBABILITIES", TensorProto.FLOAT, (NUM_CLASSES,)),
        ],
        initializer=_initializers(mlp_weights()),
    )
    return _finish(graph, "Seeded random MLP digit classifier (8x8 images, 10 classes).")


def build_cnn() -> onnx.ModelProto:
    """Two Conv/ReLU/MaxPool blocks, Flatten, Gemm to 10 classes, Softmax."""
    pad = CNN_KERNEL // 2  # "same" padding: the pools, not the convs, shrink the image
    nodes: list[onnx.NodeProto] = []
    current = "IMAGE"
    for layer in range(1, len(CNN_CHANNELS) + 1):
        nodes += [
            helper.make_node(
                "Conv",
                [current, f"conv{layer}_W", f"conv{layer}_B"],
                [f"conv{layer}_out"],
                kernel_shape=[CNN_KERNEL, CNN_KERNEL],
                pads=[pad, pad, pad, pad],
            ),
            helper.make_node("Relu", [f"conv{layer}_out"], [f"relu{layer}_out"]),
            helper.make_node(
                "MaxPool",
                [f"relu{layer}_out"],
                [f"pool{layer}_out"],
                kernel_shape=[2, 2],
                strides=[2, 2],
            ),
        ]
        current = f"pool{layer}_out"
    nodes += [
        helper.make_node("Flatten", [current], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_W", "fc_B"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["PROBABILITIES"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [_value_info("IMAGE", TensorProto.FLOAT, CNN_IMAGE)],
        [_value_info("PROBABILITIES", TensorProto.FLOAT, (NUM_CLASSES,))],
        initializer=_initializers(cnn_weights()),
    )
    return _finish(graph, "Seeded random CNN image classifier (1x28x28 images, 10 classes).")


def build_simple_sequence() -> onnx.ModelProto:
    """Running sum over a sequence: ``ACC_OUT = OUTPUT = ACC_IN * (1 - START) + INPUT * READY``.

    An ONNX graph keeps nothing between runs, so the accumulator travels through the implicit
    state ``ACC_IN`` -> ``ACC_OUT`` that the sequence batcher carries; the control inputs
    START (reset) and READY (this batch row holds a real request) come from the batcher too.
    """
    one = numpy_helper.from_array(np.array(1, dtype=np.int32), "one")
    dims = (1,)
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["keep"]),
            helper.make_node("Mul", ["ACC_IN", "keep"], ["carried"]),
            helper.make_node("Mul", ["INPUT", "READY"], ["step"]),
            helper.make_node("Add", ["carried", "step"], ["ACC_OUT"]),
            helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"]),
        ],
        "simple_sequence",
        [
            _value_info(name, TensorProto.INT32, dims)
            for name in ("INPUT", "START", "READY", "ACC_IN")
        ],
        [
            _value_info("OUTPUT", TensorProto.INT32, dims),
            _value_info("ACC_OUT", TensorProto.INT32, dims),
        ],
        initializer=[one],
    )
    return _finish(graph, "Triton's classic sequence example: an accumulator (controls + state).")


def build_simple_sequence_state() -> onnx.ModelProto:
    """Running sum kept only in implicit state: ``ACC_OUT = OUTPUT = ACC_IN + INPUT``.

    No control inputs: the batcher starts each sequence from the state's initial value.
    """
    dims = (1,)
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["ACC_IN", "INPUT"], ["ACC_OUT"]),
            helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"]),
        ],
        "simple_sequence_state",
        [_value_info(name, TensorProto.INT32, dims) for name in ("INPUT", "ACC_IN")],
        [
            _value_info("OUTPUT", TensorProto.INT32, dims),
            _value_info("ACC_OUT", TensorProto.INT32, dims),
        ],
    )
    return _finish(graph, "An accumulator whose running sum is implicit sequence state.")


def build_image_preprocess() -> onnx.ModelProto:
    """UINT8 [batch, 28, 28, 1] (HWC) -> FP32 [batch, 1, 28, 28] (NCHW) scaled to [0, 1]."""
    scale = numpy_helper.from_array(np.array(RAW_PIXEL_MAX, dtype=np.float32), "pixel_max")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["IMAGE"], ["image_float"], to=TensorProto.FLOAT),
            helper.make_node("Div", ["image_float", "pixel_max"], ["image_scaled"]),
            helper.make_node("Transpose", ["image_scaled"], ["NORMALIZED"], perm=[0, 3, 1, 2]),
        ],
        "image_preprocess",
        [_value_info("IMAGE", TensorProto.UINT8, RAW_IMAGE)],
        [_value_info("NORMALIZED", TensorProto.FLOAT, CNN_IMAGE)],
        initializer=[scale],
    )
    return _finish(graph, "Raw 8-bit HWC images to the cnn's normalized NCHW input.")


def build_postprocess() -> onnx.ModelProto:
    """FP32 PROBABILITIES [batch, 10] -> INT64 CLASS [batch, 1] and FP32 SCORE [batch, 1]."""
    graph = helper.make_graph(
        [
            helper.make_node("ArgMax", ["PROBABILITIES"], ["CLASS"], axis=1, keepdims=1),
            # opset 17 still takes ReduceMax's axes as an attribute (an input from opset 18)
            helper.make_node("ReduceMax", ["PROBABILITIES"], ["SCORE"], axes=[1], keepdims=1),
        ],
        "postprocess",
        [_value_info("PROBABILITIES", TensorProto.FLOAT, (NUM_CLASSES,))],
        [
            _value_info("CLASS", TensorProto.INT64, (1,)),
            _value_info("SCORE", TensorProto.FLOAT, (1,)),
        ],
    )
    return _finish(graph, "Top-1 class index and its probability from a classifier's output.")
