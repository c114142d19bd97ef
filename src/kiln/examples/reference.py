"""Plain-NumPy reference implementations of the example models.

Tests compare the server's answers with these instead of with onnxruntime, so a bug shared by
the ONNX graph and the runtime (or by the server's use of the runtime) cannot hide. The math
is done in float64 from the same seeded weights the ONNX builder uses, then rounded to the
float32 the model returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from kiln.examples import models

Array = npt.NDArray[Any]
F64 = npt.NDArray[np.float64]


def _require(inputs: Mapping[str, Array], *names: str) -> list[Array]:
    missing = [name for name in names if name not in inputs]
    if missing:
        raise ValueError(f"missing input(s) {missing}; expected {list(names)}")
    return [np.asarray(inputs[name]) for name in names]


def _softmax(logits: F64) -> F64:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))  # max-shift avoids overflow
    out: F64 = shifted / shifted.sum(axis=-1, keepdims=True)
    return out


def _simple(inputs: Mapping[str, Array]) -> dict[str, Array]:
    a, b = (x.astype(np.int32, copy=False) for x in _require(inputs, "INPUT0", "INPUT1"))
    # int32 arithmetic wraps on overflow, exactly like the ONNX Add/Sub on int32.
    return {"OUTPUT0": a + b, "OUTPUT1": a - b}


def _parse_decimal(element: object) -> int:
    # Triton clients send BYTES elements as bytes; onnxruntime wants str. Accept both.
    text = element.decode("utf-8") if isinstance(element, bytes) else str(element)
    return int(text)


def _simple_string(inputs: Mapping[str, Array]) -> dict[str, Array]:
    a_text, b_text = _require(inputs, "INPUT0", "INPUT1")
    parse = np.vectorize(_parse_decimal, otypes=[object])  # object: no silent truncation
    a, b = parse(a_text), parse(b_text)
    info = np.iinfo(np.int32)
    if any(not info.min <= int(n) <= info.max for n in (*a.flat, *b.flat)):
        # The model's Cast to int32 has no defined answer for these, so neither do we.
        raise ValueError("simple_string inputs must be decimal integers that fit in int32")
    numbers = _simple({"INPUT0": a.astype(np.int32), "INPUT1": b.astype(np.int32)})
    to_bytes = np.vectorize(lambda n: str(int(n)).encode("ascii"), otypes=[object])
    return {name: to_bytes(value) for name, value in numbers.items()}


def _mlp(inputs: Mapping[str, Array]) -> dict[str, Array]:
    (x,) = _require(inputs, "INPUT")
    weights = models.mlp_weights()
    hidden: F64 = x.astype(np.float64)
    layers = len(models.MLP_HIDDEN) + 1
    for layer in range(1, layers + 1):
        hidden = hidden @ weights[f"W{layer}"].astype(np.float64) + weights[f"B{layer}"]
        if layer < layers:
            hidden = np.maximum(hidden, 0.0)
    return {
        "LOGITS": hidden.astype(np.float32),
        "PROBABILITIES": _softmax(hidden).astype(np.float32),
    }


def _conv2d_same(images: F64, kernel: F64, bias: F64) -> F64:
    """Stride-1 convolution with zero "same" padding: [N, C, H, W] -> [N, O, H, W]."""
    pad = kernel.shape[-1] // 2
    padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    # windows[n, c, h, w, i, j] = padded[n, c, h + i, w + j]; no data is copied.
    windows = sliding_window_view(padded, kernel.shape[-2:], axis=(2, 3))
    # ONNX Conv is a cross-correlation (the kernel is not flipped), which is this einsum.
    out: F64 = np.einsum("nchwij,ocij->nohw", windows, kernel)
    return out + bias[None, :, None, None]


def _max_pool_2x2(images: F64) -> F64:
    n, c, h, w = images.shape
    pooled: F64 = images.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))
    return pooled


def _cnn(inputs: Mapping[str, Array]) -> dict[str, Array]:
    (x,) = _require(inputs, "IMAGE")
    if x.ndim != 4 or x.shape[1:] != models.CNN_IMAGE:
        raise ValueError(f"IMAGE must be [batch, {', '.join(map(str, models.CNN_IMAGE))}]")
    weights = models.cnn_weights()
    hidden: F64 = x.astype(np.float64)
    for layer in range(1, len(models.CNN_CHANNELS) + 1):
        kernel = weights[f"conv{layer}_W"].astype(np.float64)
        bias = weights[f"conv{layer}_B"].astype(np.float64)
        hidden = _max_pool_2x2(np.maximum(_conv2d_same(hidden, kernel, bias), 0.0))
    # C, H, W flattening order matches ONNX Flatten(axis=1) on an NCHW tensor.
    flat = hidden.reshape(hidden.shape[0], -1)
    logits = flat @ weights["fc_W"].astype(np.float64) + weights["fc_B"]
    return {"PROBABILITIES": _softmax(logits).astype(np.float32)}


def _simple_sequence(inputs: Mapping[str, Array]) -> dict[str, Array]:
    """One step of the accumulator, state and controls given explicitly as inputs."""
    value, start, ready, acc = (
        x.astype(np.int32, copy=False)
        for x in _require(inputs, "INPUT", "START", "READY", "ACC_IN")
    )
    total = acc * (np.int32(1) - start) + value * ready
    return {"OUTPUT": total, "ACC_OUT": total.copy()}


def _simple_sequence_state(inputs: Mapping[str, Array]) -> dict[str, Array]:
    value, acc = (x.astype(np.int32, copy=False) for x in _require(inputs, "INPUT", "ACC_IN"))
    total = acc + value
    return {"OUTPUT": total, "ACC_OUT": total.copy()}


def _image_preprocess(inputs: Mapping[str, Array]) -> dict[str, Array]:
    (x,) = _require(inputs, "IMAGE")
    if x.ndim != 4 or x.shape[1:] != models.RAW_IMAGE:
        raise ValueError(f"IMAGE must be [batch, {', '.join(map(str, models.RAW_IMAGE))}]")
    # float32 division, as the model does it: x / 255 rounds the same way in both.
    scaled = x.astype(np.float32) / np.float32(models.RAW_PIXEL_MAX)
    return {"NORMALIZED": np.ascontiguousarray(scaled.transpose(0, 3, 1, 2))}


def _postprocess(inputs: Mapping[str, Array]) -> dict[str, Array]:
    (p,) = _require(inputs, "PROBABILITIES")
    return {
        "CLASS": p.argmax(axis=1, keepdims=True).astype(np.int64),
        "SCORE": p.max(axis=1, keepdims=True).astype(np.float32),
    }


def _cnn_pipeline(inputs: Mapping[str, Array]) -> dict[str, Array]:
    """The ensemble: image_preprocess -> cnn -> postprocess."""
    (image,) = _require(inputs, "IMAGE")
    probabilities = _cnn({"IMAGE": _image_preprocess({"IMAGE": image})["NORMALIZED"]})
    return {**probabilities, **_postprocess(probabilities)}


def _torch_mlp(inputs: Mapping[str, Array]) -> dict[str, Array]:
    # The mlp under Triton's <name>__<index> tensor names (see the torch_mlp config).
    out = _mlp({"INPUT": _require(inputs, "INPUT__0")[0]})
    return {"LOGITS__0": out["LOGITS"], "PROBABILITIES__1": out["PROBABILITIES"]}


_REFERENCES: dict[str, Callable[[Mapping[str, Array]], dict[str, Array]]] = {
    "simple": _simple,
    "simple_string": _simple_string,
    "mlp": _mlp,
    "cnn": _cnn,
    "simple_sequence": _simple_sequence,
    "simple_sequence_oldest": _simple_sequence,
    "simple_sequence_state": _simple_sequence_state,
    "image_preprocess": _image_preprocess,
    "postprocess": _postprocess,
    "cnn_pipeline": _cnn_pipeline,
    "python_preprocess": _image_preprocess,  # the same computation, in a Python model
    "python_pipeline": _cnn_pipeline,  # so the same pipeline, with python_preprocess first
    "torch_mlp": _torch_mlp,
}

# The sequence models' client inputs are only INPUT: the batcher adds the rest.
SEQUENCE_MODELS = ("simple_sequence", "simple_sequence_oldest", "simple_sequence_state")


def reference_outputs(model_name: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Expected outputs of an example model, computed with NumPy alone.

    ``inputs`` maps input names to batched arrays (leading batch dim, as sent to the server).
    Numeric outputs are int32/float32 like the model's. ``simple_string`` accepts elements
    as ``bytes`` or ``str`` and returns an object array of ``bytes`` (Triton's BYTES form,
    which is what a Triton client hands back; onnxruntime itself returns ``str``).
    """
    try:
        reference = _REFERENCES[model_name]
    except KeyError:
        raise ValueError(
            f"unknown example model '{model_name}'; known: {', '.join(_REFERENCES)}"
        ) from None
    return reference(inputs)


def reference_sequence(model_name: str, values: list[int]) -> list[int]:
    """What a sequence model answers to each request of one sequence sending ``values``.

    Steps the one-step reference the way the sequence batcher drives the model: START on
    the first request, READY on every one, the state from zeros and then from ACC_OUT.
    """
    if model_name not in SEQUENCE_MODELS:
        raise ValueError(f"'{model_name}' is not a sequence example; known: {SEQUENCE_MODELS}")
    acc = np.zeros((1, 1), np.int32)
    answers: list[int] = []
    for step, value in enumerate(values):
        feeds = {
            "INPUT": np.full((1, 1), value, np.int32),
            "START": np.full((1, 1), int(step == 0), np.int32),
            "READY": np.ones((1, 1), np.int32),
            "ACC_IN": acc,
        }
        out = reference_outputs(model_name, feeds)
        acc = out["ACC_OUT"]
        answers.append(int(out["OUTPUT"][0, 0]))
    return answers


def reference_responses(
    model_name: str, inputs: Mapping[str, np.ndarray]
) -> list[dict[str, Array]]:
    """The responses a decoupled example model streams for one request, in order."""
    if model_name != "repeat_int32":
        raise ValueError(f"'{model_name}' is not a decoupled example; known: ['repeat_int32']")
    (values,) = _require(inputs, "IN")
    return [
        {"OUT": np.array([v], np.int32), "IDX": np.array([i], np.uint32)}
        for i, v in enumerate(values.reshape(-1).astype(np.int32))
    ]
