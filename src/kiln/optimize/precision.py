"""Reduced-precision candidates: INT8 dynamic, INT8 static QDQ (calibrated), and GPU-only ones.

Static quantization writes QDQ (QuantizeLinear/DequantizeLinear pairs), the format ONNX
Runtime's CPU kernels fuse and TensorRT >= 10 consumes for explicit INT8 (TensorRT 11 removed
the calibrator API), so one calibrated model serves both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from kiln.optimize.data import Batch, sample_count, slice_batch
from kiln.optimize.types import Candidate

METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
}


class BatchReader(CalibrationDataReader):  # type: ignore[misc]
    """Feeds the calibration set to ``quantize_static`` in fixed-size batches."""

    def __init__(self, data: Batch, batch_size: int = 32) -> None:
        self._data = data
        self._batch_size = batch_size
        self._iter = self._batches()

    def _batches(self) -> Iterator[Batch]:
        n = sample_count(self._data)
        for start in range(0, n, self._batch_size):
            yield slice_batch(self._data, start, start + self._batch_size)

    def get_next(self) -> Batch | None:
        return next(self._iter, None)

    def rewind(self) -> None:
        self._iter = self._batches()


def preprocess(source: Path, workdir: Path) -> Path:
    """ONNX Runtime's recommended pre-quantization pass; the original model when it fails."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = workdir / "preprocessed.onnx"
    try:
        quant_pre_process(str(source), str(out), skip_symbolic_shape=True)
    except Exception as exc:  # an optional pass: quantizing the raw model still works
        logging.getLogger(__name__).info("quantization pre-processing skipped: %s", exc)
        return source
    return out


def build_int8_dynamic(source: Path, workdir: Path) -> Candidate:
    out = workdir / "int8-dynamic.onnx"
    candidate = Candidate(
        "int8-dynamic",
        "int8-dynamic",
        "INT8 weights, activations quantized at run time (quantize_dynamic)",
    )
    start = time.perf_counter()
    quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8)
    candidate.build_seconds = time.perf_counter() - start
    candidate.path = out
    return candidate


# Two QDQ forms: "static" (int8 activations, symmetric) is what TensorRT takes on a GPU; "u8s8"
# (uint8 asymmetric activations, int8 weights) is what ONNX Runtime's x86 CPU kernels run
# fastest. Measured on the digits CNNs (AVX512-VNNI Xeon, ORT 1.31): symmetric int8 activations
# ran 2-5x slower than u8s8 at batch 32; see benchmarks/HISTORY.md.
STATIC_FORMS = {"static": "int8-static", "u8s8": "int8-u8s8"}


def static_names() -> list[tuple[str, str, bool, str]]:
    """(name, method, per_channel, form) of every static INT8 candidate."""
    return [
        (f"int8-{form}-{method}-{'per-channel' if pc else 'per-tensor'}", method, pc, form)
        for form in STATIC_FORMS
        for method in METHODS
        for pc in (False, True)
    ]


def build_int8_static(
    source: Path,
    workdir: Path,
    calibration: Batch,
    method: str,
    per_channel: bool,
    form: str = "static",
) -> Candidate:
    granularity = "per-channel" if per_channel else "per-tensor"
    name = f"int8-{form}-{method}-{granularity}"
    out = workdir / f"{name}.onnx"
    tensorrt_form = form == "static"
    activations = "int8 symmetric" if tensorrt_form else "uint8 asymmetric"
    candidate = Candidate(
        name,
        STATIC_FORMS[form],
        f"INT8 QDQ, {activations} activations, {method} calibration, {granularity} weights "
        "(quantize_static)",
        precision="int8",
    )
    start = time.perf_counter()
    quantize_static(
        str(source),
        str(out),
        BatchReader(calibration),
        quant_format=QuantFormat.QDQ,
        per_channel=per_channel,
        activation_type=QuantType.QInt8 if tensorrt_form else QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=METHODS[method],
        extra_options={"ActivationSymmetric": tensorrt_form, "WeightSymmetric": True},
    )
    candidate.build_seconds = time.perf_counter() - start
    candidate.path = out
    return candidate


def build_fp16(source: Path, workdir: Path, name: str, keep_io_types: bool) -> Path:
    """The model with float16 weights and compute; float32 inputs/outputs when ``keep_io_types``.

    ONNX Runtime's own converter (``onnxruntime.transformers.float16``, shipped with every
    onnxruntime wheel) inserts the Cast nodes at the graph's edges when I/O is kept.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    out = workdir / f"{name}.onnx"
    model = onnx.load(str(source))
    converted = convert_float_to_float16(model, keep_io_types=keep_io_types)
    _sort_nodes(converted.graph)
    onnx.checker.check_model(converted)
    onnx.save(converted, str(out))
    return out


def _sort_nodes(graph: Any) -> None:
    """Topologically sort ``graph.node`` in place.

    The converter appends the input Casts after the nodes that read them; ONNX requires (and
    TensorRT's parser assumes) producers before consumers.
    """
    ready = {i.name for i in graph.input} | {w.name for w in graph.initializer} | {""}
    pending = list(graph.node)
    ordered = []
    while pending:
        runnable = [n for n in pending if all(i in ready for i in n.input)]
        if not runnable:  # a cycle or a dangling input: leave it for the checker to name
            ordered += pending
            break
        for node in runnable:
            ordered.append(node)
            ready.update(node.output)
        done = {id(n) for n in runnable}
        pending = [n for n in pending if id(n) not in done]
    copies = [type(n)() for n in ordered]
    for copy, node in zip(copies, ordered, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


def fold_int32_bias(source: Path, out: Path) -> Path:
    """The QDQ model with every INT32 bias ``DequantizeLinear`` folded into a float constant.

    ``quantize_static`` quantizes biases to INT32 behind a DequantizeLinear (ONNX Runtime's
    CPU kernels fuse it into QGemm/QLinearConv), but TensorRT's ONNX parser takes only INT8
    (and FP8/INT4) DequantizeLinear inputs and refuses the model. TensorRT expects the bias
    in float next to INT8 weights and activations, so the TensorRT candidate is built from
    this copy: each such node becomes the initializer ``(q - zero_point) * scale`` it would
    compute, in the scale's dtype, and nothing else changes.
    """
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    kept = []
    for node in graph.node:
        init = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if init is None or init.data_type != onnx.TensorProto.INT32:
            kept.append(node)
            continue
        q = numpy_helper.to_array(init).astype(np.int64)
        scale = numpy_helper.to_array(inits[node.input[1]])
        zero = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 else 0
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if np.ndim(scale) == 1 and q.ndim > 1:  # per-axis: line the scale up with ``axis``
            shape = [1] * q.ndim
            shape[axis] = -1
            scale, zero = np.reshape(scale, shape), np.reshape(zero, shape)
        value = ((q - np.asarray(zero, np.int64)) * scale).astype(scale.dtype)
        graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in node.input}
    unused = [t for t in graph.initializer if t.name not in used]
    for t in unused:  # the INT32 biases and their now unread scales and zero points
        graph.initializer.remove(t)
    onnx.save_model(model, str(out))
    return out
