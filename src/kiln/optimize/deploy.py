"""Write the chosen candidate as a model repository entry ``kiln serve`` (or Triton) loads as is.

ONNX candidates become ``platform: "onnxruntime_onnx"`` entries (KIND_GPU with the CUDA or
TensorRT execution accelerator when they were measured on a GPU); TensorRT engines become
``platform: "tensorrt_plan"`` entries with ``model.plan``. Inputs and outputs are read from
the ONNX graph (for an engine: the ONNX model it was built from), not from a session, so a
float16 model's entry is written on a machine whose CPU provider could not run it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kiln.optimize.types import Candidate, ServingConfig

# ONNX TensorProto element types -> config.pbtxt data types.
_CONFIG_TYPES = {
    1: "TYPE_FP32",
    2: "TYPE_UINT8",
    3: "TYPE_INT8",
    6: "TYPE_INT32",
    7: "TYPE_INT64",
    9: "TYPE_BOOL",
    10: "TYPE_FP16",
    11: "TYPE_FP64",
    16: "TYPE_BF16",
}

# Triton's onnxruntime backend: optimization.graph.level -1 = basic, 1 = extended, else all.
_GRAPH_LEVEL = {"basic": -1, "extended": 1, "all": 2}


def _tensors(onnx_path: Path) -> tuple[str, str]:
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}

    def entry(value: onnx.ValueInfoProto) -> str:
        t = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim][1:]
        text = ", ".join(str(d) for d in dims)
        return (
            f'  {{\n    name: "{value.name}"\n    data_type: {_CONFIG_TYPES[t.elem_type]}\n'
            f"    dims: [ {text} ]\n  }}"
        )

    inputs = ",\n".join(entry(i) for i in graph.input if i.name not in weights)
    return inputs, ",\n".join(entry(o) for o in graph.output)


def _serving(serving: ServingConfig | None, kind: str) -> str:
    instances = serving.instances if serving else 1
    text = f"instance_group [ {{ count: {instances}, kind: {kind} }} ]\n"
    if serving is not None and serving.max_queue_delay_us is not None:
        sizes = ", ".join(str(s) for s in serving.preferred_batch_sizes)
        preferred = f"\n  preferred_batch_size: [ {sizes} ]" if sizes else ""
        text += (
            f"dynamic_batching {{{preferred}\n  max_queue_delay_microseconds: "
            f"{serving.max_queue_delay_us}\n}}\n"
        )
    return text


def _accelerator(candidate: Candidate, cache_dir: Path | None) -> str:
    if candidate.runtime != "ort-tensorrt":
        return ""
    params = [("precision_mode", candidate.precision.upper())]
    if cache_dir is not None:
        params += [("trt_engine_cache_path", str(cache_dir.resolve())),
                   ("trt_timing_cache_enable", "true"),
                   ("trt_timing_cache_path", str(cache_dir.resolve()))]  # fmt: skip
    body = " ".join(f'parameters {{ key: "{k}" value: "{v}" }}' for k, v in params)
    return (
        "  execution_accelerators { gpu_execution_accelerator: [ "
        f'{{ name: "tensorrt" {body} }} ] }}\n'
    )


def config_text(
    name: str,
    candidate: Candidate,
    max_batch_size: int,
    threads: int,
    serving: ServingConfig | None = None,
    cache_dir: Path | None = None,
) -> str:
    source = candidate.built_from or candidate.path
    assert source is not None
    inputs, outputs = _tensors(source)
    kind = "KIND_CPU" if candidate.runtime == "cpu" else "KIND_GPU"
    head = f"# Written by kiln optimize: candidate {candidate.name} ({candidate.description}).\n"
    io = f"max_batch_size: {max_batch_size}\ninput [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
    if candidate.runtime == "tensorrt":
        return f'{head}name: "{name}"\nplatform: "tensorrt_plan"\n{io}{_serving(serving, kind)}'
    return (
        f'{head}name: "{name}"\nplatform: "onnxruntime_onnx"\n{io}{_serving(serving, kind)}'
        f"optimization {{\n  graph {{ level: {_GRAPH_LEVEL[candidate.graph_level]} }}\n"
        f"{_accelerator(candidate, cache_dir)}}}\n"
        f'parameters {{ key: "intra_op_thread_count" value {{ string_value: "{threads}" }} }}\n'
    )


def write_entry(
    repository: Path,
    name: str,
    candidate: Candidate,
    max_batch_size: int,
    threads: int,
    serving: ServingConfig | None = None,
) -> Path:
    """``REPO/NAME/config.pbtxt`` and ``REPO/NAME/1/model.{onnx,plan}``; the model folder."""
    assert candidate.path is not None
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    filename = "model.plan" if candidate.runtime == "tensorrt" else "model.onnx"
    if candidate.path.resolve() != (folder / "1" / filename).resolve():
        shutil.copyfile(candidate.path, folder / "1" / filename)
    # The ORT TensorRT EP's engine cache lives with the entry it belongs to.
    cache = folder / "trt_engine_cache" if candidate.runtime == "ort-tensorrt" else None
    if cache is not None:
        cache.mkdir(exist_ok=True)
    text = config_text(name, candidate, max_batch_size, threads, serving, cache)
    (folder / "config.pbtxt").write_text(text)
    return folder
