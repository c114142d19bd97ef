"""Write the example models as a Triton-layout model repository.

Layout per model::

    <dest>/<model>/config.pbtxt
    <dest>/<model>/1/model.onnx
    <dest>/<model>/labels.txt      (classifiers only)

The configs are plain text, written the way a user would write them by hand, so that the
example repository doubles as documentation of the config format.

An ensemble (``cnn_pipeline``, ``python_pipeline``) has an empty version folder: its steps
are other models.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx

from kiln.examples import models as graphs  # 'models' is also a parameter name below
from kiln.examples import python_models

log = logging.getLogger(__name__)

DIGIT_LABELS: tuple[str, ...] = tuple(f"digit_{i}" for i in range(graphs.NUM_CLASSES))

_CPU_INSTANCE = """\
instance_group [
  {
    count: 1
    kind: KIND_CPU
  }
]
"""


def _simple_config(name: str, data_type: str) -> str:
    # simple and simple_string differ only in name and data type, exactly as in Triton's docs.
    tensor = """\
  {{
    name: "{tensor}"
    data_type: {data_type}
    dims: [ 16 ]
  }}"""
    inputs = ",\n".join(tensor.format(tensor=t, data_type=data_type) for t in ("INPUT0", "INPUT1"))
    outputs = ",\n".join(
        tensor.format(tensor=t, data_type=data_type) for t in ("OUTPUT0", "OUTPUT1")
    )
    return f"""\
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
{inputs}
]
output [
{outputs}
]
{_CPU_INSTANCE}"""


MLP_CONFIG = f"""\
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [
  {{
    name: "INPUT"
    data_type: TYPE_FP32
    dims: [ 64 ]
  }}
]
output [
  {{
    name: "LOGITS"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }},
  {{
    name: "PROBABILITIES"
    data_type: TYPE_FP32
    dims: [ 10 ]
    label_filename: "labels.txt"
  }}
]
{_CPU_INSTANCE}"""

# The mlp as TorchScript, named with Triton's <name>__<index> convention for PyTorch models.
TORCH_MLP_CONFIG = f"""\
name: "torch_mlp"
platform: "pytorch_libtorch"
max_batch_size: 64
input [
  {{
    name: "INPUT__0"
    data_type: TYPE_FP32
    dims: [ 64 ]
  }}
]
output [
  {{
    name: "LOGITS__0"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }},
  {{
    name: "PROBABILITIES__1"
    data_type: TYPE_FP32
    dims: [ 10 ]
    label_filename: "labels.txt"
  }}
]
{_CPU_INSTANCE}"""

CNN_CONFIG = f"""\
name: "cnn"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [
  {{
    name: "IMAGE"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 1, 28, 28 ]
  }}
]
output [
  {{
    name: "PROBABILITIES"
    data_type: TYPE_FP32
    dims: [ 10 ]
    label_filename: "labels.txt"
  }}
]
{_CPU_INSTANCE}"""


_SEQUENCE_CONTROLS = """\
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START  int32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "READY"
      control [ { kind: CONTROL_SEQUENCE_READY  int32_false_true: [ 0, 1 ] } ]
    }
  ]
"""

_SEQUENCE_STATE = """\
  state [
    {
      input_name: "ACC_IN"
      output_name: "ACC_OUT"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: { name: "zero"  data_type: TYPE_INT32  dims: [ 1 ]  zero_data: true }
    }
  ]
"""


def _sequence_config(name: str, strategy: str, controls: bool) -> str:
    # Only INPUT and OUTPUT are the client's: START/READY and the ACC_IN -> ACC_OUT state
    # belong to the sequence batcher, so the config does not list them as inputs/outputs.
    return f"""\
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [
  {{
    name: "INPUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }}
]
output [
  {{
    name: "OUTPUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }}
]
sequence_batching {{
  max_sequence_idle_microseconds: 5000000
{_SEQUENCE_CONTROLS if controls else ""}{_SEQUENCE_STATE}  {strategy}
}}
{_CPU_INSTANCE}"""


IMAGE_PREPROCESS_CONFIG = f"""\
name: "image_preprocess"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [
  {{
    name: "IMAGE"
    data_type: TYPE_UINT8
    format: FORMAT_NHWC
    dims: [ 28, 28, 1 ]
  }}
]
output [
  {{
    name: "NORMALIZED"
    data_type: TYPE_FP32
    dims: [ 1, 28, 28 ]
  }}
]
{_CPU_INSTANCE}"""

POSTPROCESS_CONFIG = f"""\
name: "postprocess"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [
  {{
    name: "PROBABILITIES"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }}
]
output [
  {{
    name: "CLASS"
    data_type: TYPE_INT64
    dims: [ 1 ]
  }},
  {{
    name: "SCORE"
    data_type: TYPE_FP32
    dims: [ 1 ]
  }}
]
{_CPU_INSTANCE}"""


# Keys of input_map/output_map are the composing model's tensor names, values the
# ensemble's own tensors: IMAGE and the outputs are the ensemble's, the rest internal.
# The two example pipelines differ only in their first step: image_preprocess (ONNX) or
# python_preprocess (the same computation in a Python-backend model).
def _pipeline_config(name: str, preprocess: str) -> str:
    return f"""\
name: "{name}"
platform: "ensemble"
max_batch_size: 32
input [
  {{
    name: "IMAGE"
    data_type: TYPE_UINT8
    format: FORMAT_NHWC
    dims: [ 28, 28, 1 ]
  }}
]
output [
  {{
    name: "CLASS"
    data_type: TYPE_INT64
    dims: [ 1 ]
  }},
  {{
    name: "SCORE"
    data_type: TYPE_FP32
    dims: [ 1 ]
  }},
  {{
    name: "PROBABILITIES"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "{preprocess}"
      model_version: -1
      input_map {{ key: "IMAGE" value: "IMAGE" }}
      output_map {{ key: "NORMALIZED" value: "normalized_image" }}
    }},
    {{
      model_name: "cnn"
      model_version: -1
      input_map {{ key: "IMAGE" value: "normalized_image" }}
      output_map {{ key: "PROBABILITIES" value: "PROBABILITIES" }}
    }},
    {{
      model_name: "postprocess"
      model_version: -1
      input_map {{ key: "PROBABILITIES" value: "PROBABILITIES" }}
      output_map {{ key: "CLASS" value: "CLASS" }}
      output_map {{ key: "SCORE" value: "SCORE" }}
    }}
  ]
}}
"""


CNN_PIPELINE_CONFIG = _pipeline_config("cnn_pipeline", "image_preprocess")
PYTHON_PIPELINE_CONFIG = _pipeline_config("python_pipeline", "python_preprocess")


@dataclass(frozen=True)
class ExampleModel:
    name: str
    config: str
    build: Callable[[], onnx.ModelProto] | None  # None: an ensemble or a Python model
    labels: tuple[str, ...] | None = None
    python: str | None = None  # a Python-backend model's model.py
    # A model file that is not ONNX: writes it into the version folder.
    write: Callable[[Path], object] | None = None
    # Python module the writer needs; without it the model is skipped, not an error.
    requires: str = ""


def _write_torch_mlp(version_dir: Path) -> object:
    from kiln.examples.torch_models import write_torchscript_mlp

    return write_torchscript_mlp(version_dir)


_MODELS: dict[str, ExampleModel] = {
    model.name: model
    for model in (
        ExampleModel("simple", _simple_config("simple", "TYPE_INT32"), graphs.build_simple),
        ExampleModel(
            "simple_string",
            _simple_config("simple_string", "TYPE_STRING"),
            graphs.build_simple_string,
        ),
        ExampleModel("mlp", MLP_CONFIG, graphs.build_mlp, DIGIT_LABELS),
        ExampleModel("cnn", CNN_CONFIG, graphs.build_cnn, DIGIT_LABELS),
        ExampleModel(
            "simple_sequence",
            _sequence_config("simple_sequence", "direct { }", controls=True),
            graphs.build_simple_sequence,
        ),
        ExampleModel(
            "simple_sequence_oldest",
            _sequence_config(
                "simple_sequence_oldest",
                "oldest { max_candidate_sequences: 16  preferred_batch_size: [ 4 ] }",
                controls=True,
            ),
            graphs.build_simple_sequence,
        ),
        ExampleModel(
            "simple_sequence_state",
            _sequence_config("simple_sequence_state", "direct { }", controls=False),
            graphs.build_simple_sequence_state,
        ),
        ExampleModel("image_preprocess", IMAGE_PREPROCESS_CONFIG, graphs.build_image_preprocess),
        ExampleModel("postprocess", POSTPROCESS_CONFIG, graphs.build_postprocess),
        ExampleModel("cnn_pipeline", CNN_PIPELINE_CONFIG, None),
        ExampleModel(
            "python_preprocess",
            python_models.PYTHON_PREPROCESS_CONFIG,
            None,
            python=python_models.PYTHON_PREPROCESS_MODEL,
        ),
        ExampleModel("python_pipeline", PYTHON_PIPELINE_CONFIG, None),
        ExampleModel(
            "repeat_int32",
            python_models.REPEAT_INT32_CONFIG,
            None,
            python=python_models.REPEAT_INT32_MODEL,
        ),
        ExampleModel(
            "torch_mlp",
            TORCH_MLP_CONFIG,
            None,
            DIGIT_LABELS,
            write=_write_torch_mlp,
            requires="torch",
        ),
    )
}

EXAMPLE_MODELS: tuple[str, ...] = tuple(_MODELS)


def example_config(name: str) -> str:
    """The config.pbtxt text of one example model."""
    return _lookup([name])[0].config


def _lookup(names: Iterable[str]) -> list[ExampleModel]:
    # dict.fromkeys de-duplicates while keeping the caller's order.
    wanted = list(dict.fromkeys(names))
    unknown = [name for name in wanted if name not in _MODELS]
    if unknown:
        raise ValueError(
            f"unknown example model(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(EXAMPLE_MODELS)}"
        )
    return [_MODELS[name] for name in wanted]


def unavailable_examples(models: Iterable[str] | None = None) -> dict[str, str]:
    """Example models this environment cannot build, with why (an optional extra missing)."""
    selected = _lookup(EXAMPLE_MODELS if models is None else models)
    return {
        m.name: f"needs {m.requires}: pip install kiln-serve[{m.requires}]"
        for m in selected
        if m.requires and importlib.util.find_spec(m.requires) is None
    }


def _write_model(model: ExampleModel, folder: Path) -> None:
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(model.config, encoding="utf-8")
    if model.build is not None:
        onnx.save_model(model.build(), folder / "1" / "model.onnx")
    if model.python is not None:
        (folder / "1" / "model.py").write_text(model.python, encoding="utf-8")
    if model.write is not None:
        model.write(folder / "1")
    if model.labels is not None:
        (folder / "labels.txt").write_text("\n".join(model.labels) + "\n", encoding="utf-8")


def _install(model: ExampleModel, dest: Path) -> Path:
    """Build into a hidden temp dir beside the target, then rename it into place.

    A crash mid-build leaves only the hidden (dot-named) temp dir, never a half-written
    model folder under the model's own name that a server would try to load.
    """
    target = dest / model.name
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}.", suffix=".tmp", dir=dest))
    try:
        _write_model(model, staging / "model")
        old = staging / "old"
        if target.exists() or target.is_symlink():
            # Move the old folder aside first: a rename cannot replace a non-empty directory.
            target.rename(old)
        try:
            (staging / "model").rename(target)
        except OSError:
            if old.exists() or old.is_symlink():
                old.rename(target)  # put the previous model back rather than lose it
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_example_repository(
    dest: str | Path, models: Iterable[str] | None = None, *, overwrite: bool = False
) -> list[Path]:
    """Write example models into the model repository ``dest`` (created if missing).

    ``models`` selects and orders the models (default: all of :data:`EXAMPLE_MODELS`).
    Returns the model folders written; a model whose optional extra is not installed
    (``torch_mlp`` without torch) is skipped with a logged warning. Raises ``ValueError``
    for an unknown model name and ``FileExistsError`` if a model folder already exists and
    ``overwrite`` is false; both are checked before anything is written, so a refused call
    leaves ``dest`` untouched.
    """
    if isinstance(models, str):
        models = [models]  # a lone name, not an iterable of one-letter names
    selected = _lookup(EXAMPLE_MODELS if models is None else models)
    root = Path(dest)
    if not overwrite:
        existing = [m.name for m in selected if (root / m.name).exists()]
        if existing:
            raise FileExistsError(
                f"model folder(s) {', '.join(existing)} already exist in {root}; "
                "pass overwrite=True to replace them"
            )
    root.mkdir(parents=True, exist_ok=True)
    skipped = unavailable_examples(m.name for m in selected)
    for name, reason in skipped.items():
        log.warning("example model '%s' skipped: %s", name, reason)
    return [_install(model, root) for model in selected if model.name not in skipped]
