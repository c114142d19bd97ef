"""config.pbtxt parsing: Triton configs load unchanged; every mistake names file, line, field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.config.loader import (
    ConfigError,
    find_line,
    load_config_file,
    parse_config_text,
    validate_config,
)
from kiln.config.model_config_pb2 import ModelConfig, ModelInstanceGroup

PATH = "repo/m/config.pbtxt"

# Written the way Triton's documentation writes configs: every block kiln must accept.
TRITON_CONFIG = """\
name: "resnet"
platform: "onnxruntime_onnx"
max_batch_size: 16
version_policy: { latest: { num_versions: 2 } }
input [
  {
    name: "input__0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "output__0"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 5000 }
}
instance_group [
  { count: 2 kind: KIND_CPU },
  { name: "gpu_group" count: 1 kind: KIND_GPU gpus: [ 0, 1 ] }
]
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
parameters [
  { key: "graph_optimization_level" value: { string_value: "extended" } }
]
optimization {
  graph { level: 1 }
  execution_accelerators {
    gpu_execution_accelerator : [ {
      name : "tensorrt"
      parameters { key: "precision_mode" value: "FP16" }
      parameters { key: "max_workspace_size_bytes" value: "1073741824" }
    } ]
  }
}
model_warmup [
  {
    name: "zeros"
    batch_size: 1
    inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
  }
]
"""


def test_triton_config_loads_unchanged(tmp_path: Path) -> None:
    folder = tmp_path / "resnet"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(TRITON_CONFIG)
    cfg = load_config_file(folder / "config.pbtxt")
    assert cfg.name == "resnet" and cfg.max_batch_size == 16
    assert cfg.version_policy.latest.num_versions == 2
    assert list(cfg.input[0].dims) == [3, 224, 224]
    assert cfg.input[0].format == cfg.input[0].FORMAT_NCHW
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100
    assert [g.kind for g in cfg.instance_group] == [
        ModelInstanceGroup.KIND_CPU,
        ModelInstanceGroup.KIND_GPU,
    ]
    assert list(cfg.instance_group[1].gpus) == [0, 1]
    assert cfg.parameters["intra_op_thread_count"].string_value == "2"
    assert cfg.parameters["graph_optimization_level"].string_value == "extended"
    accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert accel.name == "tensorrt" and accel.parameters["precision_mode"] == "FP16"
    assert cfg.model_warmup[0].inputs["input__0"].zero_data
    assert validate_config(cfg, "resnet", str(folder / "config.pbtxt"), TRITON_CONFIG) == []


@pytest.mark.parametrize(
    ("text", "line", "field", "suggestion"),
    [
        ('name: "m"\nmax_batch_sise: 4\n', 2, "max_batch_sise", "max_batch_size"),
        (
            'input [\n  {\n    name: "x"\n    data_typ: TYPE_FP32\n  }\n]\n',
            4,
            "data_typ",
            "data_type",
        ),
        ("dynamic_batching {\n  max_queue_delay: 5\n}\n", 2, "max_queue_delay", None),
        ("instance_group [ { cnt: 2 } ]\n", 1, "cnt", "count"),
    ],
)
def test_unknown_field_names_file_line_field_and_suggestion(
    text: str, line: int, field: str, suggestion: str | None
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, PATH)
    err = info.value
    assert (err.path, err.line, err.field) == (PATH, line, field)
    assert str(err).startswith(f"{PATH}:{line}:")
    assert f'unknown field "{field}"' in str(err)
    if suggestion:
        assert f'did you mean "{suggestion}"' in str(err)


@pytest.mark.parametrize(
    ("text", "field", "value", "suggestion"),
    [
        ('input [ { name: "x" data_type: TYPE_FLOAT32 dims: [1] } ]', "data_type", "TYPE_FLOAT32",
         "TYPE_FP32"),
        ("instance_group [ { kind: KIND_GPUU } ]", "kind", "KIND_GPUU", "KIND_GPU"),
        ('input [ { name: "x" format: NCHW } ]', "format", "NCHW", "FORMAT_NCHW"),
    ],
)  # fmt: skip
def test_bad_enum_value_names_field_and_suggests(
    text: str, field: str, value: str, suggestion: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, PATH)
    err = info.value
    assert err.line == 1 and err.field == field
    assert f"invalid value {value}" in str(err) and f'"{field}"' in str(err)
    assert f'did you mean "{suggestion}"' in str(err)


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        ('name: "m"\nmax_batch_size: "x"\n', 2, "max_batch_size", "Couldn't parse integer"),
        ("max_batch_size: 1.5\n", 1, "max_batch_size", "Couldn't parse integer"),
        ("max_batch_size: 1\nmax_batch_size: 2\n", 2, "max_batch_size", "more than once"),
    ],
)
def test_bad_values_name_the_field(text: str, line: int, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, PATH)
    assert (info.value.line, info.value.field) == (line, field)
    assert words in str(info.value) and f'"{field}"' in str(info.value)


def test_syntax_error_has_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('name: "m"\ninput [ { name: "x"\n', PATH)
    assert info.value.path == PATH and info.value.line is not None
    assert str(info.value).startswith(f"{PATH}:")


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_file(tmp_path / "missing" / "config.pbtxt")
    assert "cannot read model configuration" in str(info.value)
    (tmp_path / "bin.pbtxt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError):
        load_config_file(tmp_path / "bin.pbtxt")


# ---- validate_config ------------------------------------------------------------------------


def _problems(text: str, folder: str = "m") -> list[ConfigError]:
    return validate_config(parse_config_text(text, PATH), folder, PATH, text)


def test_name_must_match_folder() -> None:
    (problem,) = _problems('platform: "onnxruntime_onnx"\nname: "other"\n')
    assert problem.field == "name" and problem.line == 2
    assert '"other"' in problem.message and '"m"' in problem.message
    assert _problems('name: "m"\n') == []
    assert _problems("max_batch_size: 2\n") == []  # no name: the folder's


@pytest.mark.parametrize(
    ("text", "field", "line", "words"),
    [
        ("max_batch_size: -1\n", "max_batch_size", 1, ">= 0"),
        ('input [ { name: "a" dims: [1] } ]\n', "input[0].data_type", 1, "data_type"),
        ('input [ { name: "a" data_type: TYPE_FP32 } ]\n', "input[0].dims", 1, "dims"),
        ('output [ { name: "o" data_type: TYPE_FP32 dims: [0] } ]\n', "output[0].dims", 1, ">= 1"),
        ('input [ { name: "a" data_type: TYPE_FP32 dims: [-2] } ]\n', "input[0].dims", 1, "-1"),
        ("input [ { data_type: TYPE_FP32 dims: [1] } ]\n", "input[0].name", 1, "name"),
        (
            'input [\n { name: "a" data_type: TYPE_FP32 dims: [1] },\n'
            ' { name: "a" data_type: TYPE_FP32 dims: [1] }\n]\n',
            "input[1].name", 3, "duplicate",
        ),
        ("version_policy { specific { } }\n", "version_policy.specific", 1, "no versions"),
        ("instance_group [ { count: -1 } ]\n", "instance_group[0].count", 1, ">= 0"),
        ("instance_group [ { kind: KIND_CPU gpus: [0] } ]\n", "instance_group[0].gpus", 1, "gpus"),
        (
            "max_batch_size: 4\ndynamic_batching {\n  preferred_batch_size: [ 8 ]\n}\n",
            "dynamic_batching.preferred_batch_size", 3, "exceeds max_batch_size 4",
        ),
        (
            "dynamic_batching { priority_levels: 2 default_priority_level: 3 }\n",
            "dynamic_batching.default_priority_level", 1, "[1, 2]",
        ),
        ('platform: "ensemble"\n', "ensemble_scheduling", 1, "ensemble_scheduling"),
    ],
)  # fmt: skip
def test_validate_config_reports_field_and_line(
    text: str, field: str, line: int, words: str
) -> None:
    problems = _problems(text)
    assert [p.field for p in problems] == [field], problems
    assert problems[0].line == line and problems[0].path == PATH
    assert words in problems[0].message


def test_validate_config_reports_every_problem() -> None:
    text = 'name: "x"\nmax_batch_size: -2\ninput [ { name: "a" } ]\n'
    fields = {p.field for p in _problems(text)}
    assert fields == {"name", "max_batch_size", "input[0].data_type", "input[0].dims"}


def test_validate_config_leaves_auto_complete_its_fields() -> None:
    # no inputs, outputs or max_batch_size: auto-complete fills them later
    assert _problems('platform: "onnxruntime_onnx"\n') == []
    assert validate_config(ModelConfig(), "m", PATH) == []


def test_find_line_skips_comments_strings_and_nesting() -> None:
    text = '# name: "comment"\nplatform: "name: in a string"\ninput [ { name: "a" } ]\nname: "m"\n'
    assert find_line(text, "name", top_level=True) == 4
    assert find_line(text, "name") == 3
    assert find_line(text, "name", "m") == 4
    assert find_line(text, "name", nth=2) == 4
    assert find_line(text, "missing") is None
    assert find_line(None, "name") is None
