"""PyTorch -> ONNX with a dynamic batch axis, checked against PyTorch at several batch sizes.

MODEL is an ONNX file, a TorchScript file (``.pt``/``.pth``/``.ts``/``.torchscript``), or a
``package.module:factory`` reference whose factory returns an ``nn.Module``. PyTorch inputs need
``--input-shape NAME:1,64`` (float32, batch first). The dynamo exporter is tried first; the
TorchScript exporter is the fallback, as it still handles modules dynamo cannot trace.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from kiln.optimize.types import OptimizeError, OptimizeOptions

TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts", ".torchscript")
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def model_kind(model: str) -> str:
    if Path(model).suffix in TORCHSCRIPT_SUFFIXES:
        return "torchscript"
    if _REFERENCE.match(model) and not Path(model).exists():
        return "factory"
    return "onnx"


def parse_input_shape(spec: str) -> tuple[str, tuple[int, ...]]:
    """``NAME:1,64`` -> ("NAME", (1, 64)); the first dim is the example batch size."""
    name, _, dims = spec.partition(":")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        shape = ()
    if not name or not shape or any(d < 1 for d in shape):
        raise OptimizeError(f"--input-shape '{spec}' is not NAME:D0,D1,... (batch first)")
    return name, shape


def load_torch(model: str) -> Any:
    import torch

    if model_kind(model) == "torchscript":
        try:
            return torch.jit.load(model, map_location="cpu").eval()  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise OptimizeError(f"cannot load TorchScript file '{model}': {exc}") from exc
    module_name, _, factory = model.partition(":")
    try:
        built = getattr(importlib.import_module(module_name), factory)()
    except Exception as exc:
        raise OptimizeError(f"cannot build the model from '{model}': {exc}") from exc
    if not isinstance(built, torch.nn.Module):
        raise OptimizeError(f"'{model}' returned {type(built).__name__}, not a torch.nn.Module")
    return built.eval()


def _outputs(result: Any) -> list[np.ndarray]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [t.detach().cpu().numpy() for t in items]


def export(model: Any, shapes: dict[str, tuple[int, ...]], out: Path, dynamo: bool = True) -> str:
    """Export ``model`` to ``out``; returns the exporter that worked ("dynamo" or "torchscript")."""
    import torch

    names = list(shapes)
    args = tuple(torch.randn(*shape) for shape in shapes.values())
    with torch.no_grad():
        count = len(_outputs(model(*args)))
    output_names = [f"output_{i}" for i in range(count)]
    errors: list[str] = []
    if dynamo and not isinstance(model, torch.jit.ScriptModule):  # dynamo cannot trace those
        try:
            batch = torch.export.Dim("batch", min=1, max=4096)
            torch.onnx.export(model, args, str(out), input_names=names, output_names=output_names,
                              dynamic_shapes=tuple({0: batch} for _ in names), dynamo=True,
                              verbose=False)  # fmt: skip
            return "dynamo"
        except Exception as exc:
            errors.append(f"dynamo exporter: {_summary(exc)}")
    try:
        torch.onnx.export(model, args, str(out), input_names=names, output_names=output_names,
                          dynamic_axes={n: {0: "batch"} for n in names + output_names},
                          dynamo=False)  # fmt: skip
        return "torchscript"
    except Exception as exc:
        errors.append(f"TorchScript exporter: {_summary(exc)}")
    raise OptimizeError("ONNX export failed.\n  " + "\n  ".join(errors))


def _summary(exc: BaseException) -> str:
    """The exporter's own message, trimmed to the lines that name the failing op."""
    lines = [line.rstrip() for line in str(exc).splitlines() if line.strip()]
    keep = [line for line in lines if re.search(r"aten::|aten\.|op|Unsupported", line)]
    chosen = (keep or lines or [type(exc).__name__])[:6]
    return f"{type(exc).__name__}: " + " / ".join(chosen)


def check_export(model: Any, onnx_path: Path, shapes: dict[str, tuple[int, ...]],
                 batch_sizes: list[int], atol: float = 1e-4) -> None:  # fmt: skip
    """ONNX vs PyTorch at several batch sizes: catches a batch dim baked in as a constant."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for size in sorted({1, 2, *batch_sizes}):
        feeds = {n: rng.standard_normal((size, *s[1:])).astype(np.float32)
                 for n, s in shapes.items()}  # fmt: skip
        try:
            with torch.no_grad():
                expected = _outputs(model(*(torch.from_numpy(v) for v in feeds.values())))
        except Exception as exc:
            raise OptimizeError(
                f"the PyTorch model itself fails at batch size {size}, so it cannot be served "
                f"with a dynamic batch: {str(exc).strip().splitlines()[0]}"
            ) from exc
        try:
            got = session.run(None, feeds)
        except Exception as exc:
            raise OptimizeError(
                f"the exported ONNX model fails at batch size {size} (a batch dimension baked "
                f"in as a constant?): {str(exc).strip().splitlines()[0]}"
            ) from exc
        for i, (want, have) in enumerate(zip(expected, got, strict=True)):
            if want.shape != have.shape:
                raise OptimizeError(
                    f"exported output_{i} has shape {list(have.shape)} at batch size {size}, "
                    f"PyTorch gives {list(want.shape)}: the batch dimension is baked in as a "
                    "constant (make reshapes use -1 / x.shape[0], not a fixed size)"
                )
            err = float(np.max(np.abs(want - have), initial=0.0))
            if err > atol * max(1.0, float(np.max(np.abs(want), initial=0.0))):
                raise OptimizeError(
                    f"exported output_{i} differs from PyTorch by {err:.3g} at batch size {size}"
                )


def resolve_model(options: OptimizeOptions, work: Path, batch_sizes: list[int]
                  ) -> tuple[Path, str | None]:  # fmt: skip
    """The ONNX file to optimize, and which exporter produced it (None for ONNX input)."""
    kind = model_kind(options.model)
    if kind == "onnx":
        return Path(options.model), None
    if not options.input_shapes:
        raise OptimizeError(
            f"a PyTorch model ('{options.model}') needs --input-shape NAME:1,D1,... per input"
        )
    model = load_torch(options.model)
    out = work / "exported.onnx"
    exporter = export(model, options.input_shapes, out)
    check_export(model, out, options.input_shapes, batch_sizes)
    return out, exporter
