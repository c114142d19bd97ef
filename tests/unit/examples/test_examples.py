"""The example model repository: files, configs, and ONNX models checked against NumPy."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest

from kiln.config.loader import parse_config_text, validate_config
from kiln.examples import (
    DIGIT_LABELS,
    EXAMPLE_MODELS,
    build_example_repository,
    example_config,
    reference_outputs,
    reference_responses,
    reference_sequence,
)

Array = npt.NDArray[Any]
Feeds = dict[str, Array]

ENSEMBLES = ("cnn_pipeline", "python_pipeline")
PYTHON_MODELS = ("python_preprocess", "repeat_int32")
TORCH_MODELS = ("torch_mlp",)  # TorchScript, tested in test_examples_torch.py
ONNX_MODELS = tuple(
    m for m in EXAMPLE_MODELS if m not in (*ENSEMBLES, *PYTHON_MODELS, *TORCH_MODELS)
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built once: every model test below reads the same repository.
    root = tmp_path_factory.mktemp("example_repo")
    build_example_repository(root)
    return root


def _session(repo: Path, name: str) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )


def _simple_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    shape = (batch, 16)
    return {
        "INPUT0": rng.integers(-1000, 1000, shape, dtype=np.int32),
        "INPUT1": rng.integers(-1000, 1000, shape, dtype=np.int32),
    }


def _simple_string_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    # onnxruntime needs str elements (it would turn bytes into "b'12'"), so the model is fed
    # str; the reference is fed bytes, as a Triton client would send them.
    numbers = _simple_feeds(batch, rng)
    return {name: value.astype(str).astype(object) for name, value in numbers.items()}


def _mlp_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    # Raw scikit-learn digits pixels: integer counts 0..16.
    return {"INPUT": rng.integers(0, 17, (batch, 64)).astype(np.float32)}


def _cnn_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    return {"IMAGE": rng.uniform(0.0, 1.0, (batch, 1, 28, 28)).astype(np.float32)}


def _sequence_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    # Control and state inputs as the sequence batcher builds them: [batch, 1] int32 each.
    column = (batch, 1)
    return {
        "INPUT": rng.integers(-1000, 1000, column, dtype=np.int32),
        "START": rng.integers(0, 2, column, dtype=np.int32),
        "READY": rng.integers(0, 2, column, dtype=np.int32),
        "ACC_IN": rng.integers(-1000, 1000, column, dtype=np.int32),
    }


def _sequence_state_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    feeds = _sequence_feeds(batch, rng)
    return {"INPUT": feeds["INPUT"], "ACC_IN": feeds["ACC_IN"]}


SEQUENCE_MODELS = ("simple_sequence", "simple_sequence_oldest", "simple_sequence_state")


def _raw_image_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    return {"IMAGE": rng.integers(0, 256, (batch, 28, 28, 1), dtype=np.uint8)}


def _probabilities_feeds(batch: int, rng: np.random.Generator) -> Feeds:
    logits = rng.standard_normal((batch, 10))
    return {"PROBABILITIES": (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype("f4")}


FEEDS: dict[str, Callable[[int, np.random.Generator], Feeds]] = {
    "simple": _simple_feeds,
    "simple_string": _simple_string_feeds,
    "mlp": _mlp_feeds,
    "cnn": _cnn_feeds,
    "simple_sequence": _sequence_feeds,
    "simple_sequence_oldest": _sequence_feeds,
    "simple_sequence_state": _sequence_state_feeds,
    "image_preprocess": _raw_image_feeds,
    "postprocess": _probabilities_feeds,
}

OUTPUTS = {
    "simple": ["OUTPUT0", "OUTPUT1"],
    "simple_string": ["OUTPUT0", "OUTPUT1"],
    "mlp": ["LOGITS", "PROBABILITIES"],
    "cnn": ["PROBABILITIES"],
    **{name: ["OUTPUT", "ACC_OUT"] for name in SEQUENCE_MODELS},
    "image_preprocess": ["NORMALIZED"],
    "postprocess": ["CLASS", "SCORE"],
}


def _to_bytes(array: Array) -> Array:
    if array.dtype == object:
        return np.vectorize(lambda s: s.encode() if isinstance(s, str) else s, otypes=[object])(
            array
        )
    return array


def _assert_matches(actual: dict[str, Array], expected: dict[str, Array]) -> None:
    assert set(actual) == set(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, name
        assert got.dtype == want.dtype, name
        if np.issubdtype(want.dtype, np.floating):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def _run_and_check(repo: Path, name: str, feeds: Feeds) -> dict[str, Array]:
    session = _session(repo, name)
    results = session.run(None, feeds)
    names = [out.name for out in session.get_outputs()]
    actual = {out: _to_bytes(value) for out, value in zip(names, results, strict=True)}
    expected = reference_outputs(name, {k: _to_bytes(v) for k, v in feeds.items()})
    _assert_matches(actual, expected)
    return actual


def test_example_models_order() -> None:
    assert (
        "simple",
        "simple_string",
        "mlp",
        "cnn",
        *SEQUENCE_MODELS,
        "image_preprocess",
        "postprocess",
        "cnn_pipeline",
        "python_preprocess",
        "python_pipeline",
        "repeat_int32",
        "torch_mlp",
    ) == EXAMPLE_MODELS


def test_layout(repo: Path) -> None:
    for name in EXAMPLE_MODELS:
        assert (repo / name / "config.pbtxt").is_file()
    for name in ONNX_MODELS:
        assert (repo / name / "1" / "model.onnx").is_file()
    for name in PYTHON_MODELS:
        assert [p.name for p in (repo / name / "1").iterdir()] == ["model.py"]
    for name in ENSEMBLES:  # Triton wants a version folder even though it stays empty
        assert list((repo / name / "1").iterdir()) == []
    assert sorted(p.name for p in repo.iterdir()) == sorted(EXAMPLE_MODELS)  # no temp dirs
    for name in ("mlp", "cnn"):
        labels = (repo / name / "labels.txt").read_text().splitlines()
        assert labels == [f"digit_{i}" for i in range(10)] == list(DIGIT_LABELS)


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_onnx_checker_and_versions(repo: Path, name: str) -> None:
    model = onnx.load(str(repo / name / "1" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version in (8, 9)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    # Every input and output has a symbolic (dynamic) leading batch dim.
    for value in [*model.graph.input, *model.graph.output]:
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch", value.name


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("name", ONNX_MODELS)
def test_model_matches_reference(repo: Path, name: str, batch: int) -> None:
    feeds = FEEDS[name](batch, np.random.default_rng(batch))
    actual = _run_and_check(repo, name, feeds)
    assert list(actual) == OUTPUTS[name]
    for value in actual.values():
        assert value.shape[0] == batch


def test_simple_classic_client_data(repo: Path) -> None:
    # The data of Triton's simple_http_infer_client.py / simple_grpc_infer_client.py.
    feeds = {
        "INPUT0": np.arange(16, dtype=np.int32)[None, :],
        "INPUT1": np.ones((1, 16), dtype=np.int32),
    }
    actual = _run_and_check(repo, "simple", feeds)
    np.testing.assert_array_equal(actual["OUTPUT0"][0], np.arange(16) + 1)
    np.testing.assert_array_equal(actual["OUTPUT1"][0], np.arange(16) - 1)


def test_simple_string_classic_client_data(repo: Path) -> None:
    feeds = {
        "INPUT0": np.array([[str(i) for i in range(16)]], dtype=object),
        "INPUT1": np.array([["1"] * 16], dtype=object),
    }
    actual = _run_and_check(repo, "simple_string", feeds)
    assert list(actual["OUTPUT0"][0]) == [str(i + 1).encode() for i in range(16)]
    assert list(actual["OUTPUT1"][0]) == [str(i - 1).encode() for i in range(16)]


def test_simple_string_reference_accepts_str_and_bytes() -> None:
    as_str = {"INPUT0": np.array([["7"] * 16], dtype=object), "INPUT1": np.full((1, 16), "-2")}
    as_bytes = {k: _to_bytes(v.astype(object)) for k, v in as_str.items()}
    for feeds in (as_str, as_bytes):
        out = reference_outputs("simple_string", feeds)
        assert out["OUTPUT0"].dtype == object
        assert list(out["OUTPUT0"][0]) == [b"5"] * 16
        assert list(out["OUTPUT1"][0]) == [b"9"] * 16


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_probabilities_are_distributions(name: str) -> None:
    feeds = FEEDS[name](4, np.random.default_rng(0))
    probabilities = reference_outputs(name, feeds)["PROBABILITIES"]
    assert probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert (probabilities > 0).all()


CONFIG_EXPECTATIONS = {
    "simple": ["max_batch_size: 8", "TYPE_INT32", "INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"],
    "simple_string": ["max_batch_size: 8", "TYPE_STRING", "INPUT0", "OUTPUT1"],
    "mlp": ["max_batch_size: 64", '"INPUT"', "dims: [ 64 ]", '"LOGITS"', '"PROBABILITIES"'],
    "cnn": ["max_batch_size: 32", '"IMAGE"', "FORMAT_NCHW", "dims: [ 1, 28, 28 ]"],
    "simple_sequence": ["sequence_batching", "CONTROL_SEQUENCE_START", "direct { }"],
    "simple_sequence_oldest": ["sequence_batching", "CONTROL_SEQUENCE_READY", "oldest {"],
    "simple_sequence_state": ["sequence_batching", 'input_name: "ACC_IN"', "zero_data: true"],
    "image_preprocess": ["TYPE_UINT8", "FORMAT_NHWC", "dims: [ 28, 28, 1 ]", '"NORMALIZED"'],
    "postprocess": ['"PROBABILITIES"', "TYPE_INT64", '"CLASS"', '"SCORE"'],
}

# What the config lists as outputs: a sequence model's state output is the batcher's.
CONFIG_OUTPUTS = {name: ["OUTPUT"] for name in SEQUENCE_MODELS}


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_config_text(repo: Path, name: str) -> None:
    text = (repo / name / "config.pbtxt").read_text()
    assert text == example_config(name)
    assert f'name: "{name}"' in text
    assert 'platform: "onnxruntime_onnx"' in text
    assert "kind: KIND_CPU" in text and "count: 1" in text
    assert "dynamic_batching" not in text
    for fragment in CONFIG_EXPECTATIONS[name]:
        assert fragment in text, fragment
    for output in CONFIG_OUTPUTS.get(name, OUTPUTS[name]):
        assert f'name: "{output}"' in text
    has_labels = name in ("mlp", "cnn")
    assert ('label_filename: "labels.txt"' in text) == has_labels
    assert text.count("{") == text.count("}") and text.count("[") == text.count("]")


def test_mlp_labels_only_on_probabilities(repo: Path) -> None:
    text = (repo / "mlp" / "config.pbtxt").read_text()
    assert text.count("label_filename") == 1
    assert text.index('"PROBABILITIES"') < text.index("label_filename")


def test_subset_returns_folders_in_order(tmp_path: Path) -> None:
    dest = tmp_path / "nested" / "repo"  # missing parents are created
    folders = build_example_repository(dest, ["cnn", "simple", "cnn"])
    assert folders == [dest / "cnn", dest / "simple"]
    assert sorted(p.name for p in dest.iterdir()) == ["cnn", "simple"]


def test_single_name_string(tmp_path: Path) -> None:
    assert build_example_repository(tmp_path, "mlp") == [tmp_path / "mlp"]


def test_build_is_deterministic(tmp_path: Path) -> None:
    first = build_example_repository(tmp_path / "a")
    second = build_example_repository(tmp_path / "b")
    for a, b in zip(first, second, strict=True):
        onnx_files = ("config.pbtxt", "1/model.onnx") if a.name in ONNX_MODELS else ()
        for file in onnx_files:
            assert (a / file).read_bytes() == (b / file).read_bytes(), (a.name, file)


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    build_example_repository(tmp_path, ["simple"])
    marker = tmp_path / "simple" / "marker"
    marker.write_text("keep me")
    with pytest.raises(FileExistsError, match="simple"):
        build_example_repository(tmp_path, ["mlp", "simple"])
    # Checked up front: nothing else was written and the existing folder is untouched.
    assert not (tmp_path / "mlp").exists()
    assert marker.read_text() == "keep me"


def test_overwrite_replaces_folder(tmp_path: Path) -> None:
    build_example_repository(tmp_path, ["simple", "mlp"])
    (tmp_path / "simple" / "marker").write_text("stale")
    (tmp_path / "simple" / "1" / "model.onnx").write_bytes(b"garbage")
    folders = build_example_repository(tmp_path, ["simple"], overwrite=True)
    assert folders == [tmp_path / "simple"]
    assert not (tmp_path / "simple" / "marker").exists()
    onnx.checker.check_model(onnx.load(str(tmp_path / "simple" / "1" / "model.onnx")))
    assert (tmp_path / "mlp" / "1" / "model.onnx").is_file()  # other models left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp", "simple"]  # no temp dirs


def test_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope"):
        build_example_repository(tmp_path / "repo", ["simple", "nope"])
    assert not (tmp_path / "repo").exists()
    with pytest.raises(ValueError, match="nope"):
        reference_outputs("nope", {})
    with pytest.raises(ValueError, match="nope"):
        example_config("nope")


def test_reference_rejects_missing_inputs() -> None:
    with pytest.raises(ValueError, match="INPUT1"):
        reference_outputs("simple", {"INPUT0": np.zeros((1, 16), np.int32)})


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
def test_sequence_model_accumulates(repo: Path, name: str) -> None:
    # Drive the ONNX file step by step as the batcher would, and compare with the
    # reference's running sums (which test_model_matches_reference ties to the file).
    session = _session(repo, name)
    wanted = {i.name for i in session.get_inputs()}
    values = [3, -1, 10, 7]
    acc = np.zeros((1, 1), np.int32)
    answers = []
    for step, value in enumerate(values):
        feeds = {
            "INPUT": np.full((1, 1), value, np.int32),
            "START": np.full((1, 1), int(step == 0), np.int32),
            "READY": np.ones((1, 1), np.int32),
            "ACC_IN": acc,
        }
        output, acc = session.run(
            ["OUTPUT", "ACC_OUT"], {k: v for k, v in feeds.items() if k in wanted}
        )
        answers.append(int(output[0, 0]))
    assert answers == reference_sequence(name, values)
    assert answers == list(np.cumsum(values))


def test_sequence_reference_refuses_other_models() -> None:
    with pytest.raises(ValueError, match="mlp"):
        reference_sequence("mlp", [1])


def _run_pipeline_in_onnxruntime(repo: Path, images: Array) -> dict[str, Array]:
    """The three composing models in sequence, in process: what the ensemble must return."""
    normalized = _session(repo, "image_preprocess").run(None, {"IMAGE": images})[0]
    (probabilities,) = _session(repo, "cnn").run(None, {"IMAGE": normalized})
    cls, score = _session(repo, "postprocess").run(None, {"PROBABILITIES": probabilities})
    return {"CLASS": cls, "SCORE": score, "PROBABILITIES": probabilities}


@pytest.mark.parametrize("batch", [1, 4])
def test_cnn_pipeline_reference_equals_composing_models(repo: Path, batch: int) -> None:
    images = _raw_image_feeds(batch, np.random.default_rng(10 + batch))["IMAGE"]
    chained = _run_pipeline_in_onnxruntime(repo, images)
    _assert_matches(chained, reference_outputs("cnn_pipeline", {"IMAGE": images}))
    assert chained["CLASS"].shape == (batch, 1) and chained["CLASS"].dtype == np.int64


PIPELINE_FIRST_STEP = {"cnn_pipeline": "image_preprocess", "python_pipeline": "python_preprocess"}


@pytest.mark.parametrize("name", ENSEMBLES)
def test_pipeline_config(repo: Path, name: str) -> None:
    text = (repo / name / "config.pbtxt").read_text()
    assert text == example_config(name)
    config = parse_config_text(text)
    assert config.name == name
    assert config.platform == "ensemble" and not config.instance_group
    steps = config.ensemble_scheduling.step
    assert [s.model_name for s in steps] == [PIPELINE_FIRST_STEP[name], "cnn", "postprocess"]
    assert all(s.model_version == -1 for s in steps)
    # Every step reads what the step before it writes; the ensemble's IMAGE feeds the first.
    assert dict(steps[0].input_map) == {"IMAGE": "IMAGE"}
    assert dict(steps[1].input_map) == {"IMAGE": steps[0].output_map["NORMALIZED"]}
    assert dict(steps[2].input_map) == {"PROBABILITIES": steps[1].output_map["PROBABILITIES"]}
    assert {o.name for o in config.output} == {"CLASS", "SCORE", "PROBABILITIES"}
    assert validate_config(config, name, "config.pbtxt") == []


def test_pipelines_differ_only_in_first_step() -> None:
    # python_pipeline is cnn_pipeline with the Python preprocessing model swapped in, so
    # their answers must be equal: the text says so line by line.
    cnn = example_config("cnn_pipeline").splitlines()
    python = example_config("python_pipeline").splitlines()
    differing = [(a, b) for a, b in zip(cnn, python, strict=True) if a != b]
    assert differing == [
        ('name: "cnn_pipeline"', 'name: "python_pipeline"'),
        ('      model_name: "image_preprocess"', '      model_name: "python_preprocess"'),
    ]
    # The composing Python model fits the ensemble's batch size and tensors.
    step = parse_config_text(example_config("python_preprocess"))
    assert (
        step.max_batch_size >= parse_config_text(example_config("python_pipeline")).max_batch_size
    )


# ---- Python-backend examples ------------------------------------------------------------


def _load_python_model(repo: Path, name: str) -> Any:
    """Import an example's model.py in this process, with kiln's pb_utils shim."""
    import importlib.util

    from kiln.backends.python import pb_utils

    pb_utils.install()
    spec = importlib.util.spec_from_file_location(f"example_{name}", repo / name / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


@pytest.mark.parametrize("batch", [1, 3])
def test_python_preprocess_matches_image_preprocess(repo: Path, batch: int) -> None:
    from kiln.backends.python import pb_utils
    from kiln.config.loader import config_to_json

    model = _load_python_model(repo, "python_preprocess")
    config = parse_config_text(example_config("python_preprocess"))

    model.initialize({"model_config": json.dumps(config_to_json(config))})
    feeds = [_raw_image_feeds(batch, np.random.default_rng(i)) for i in range(2)]
    requests = [
        pb_utils.InferenceRequest(inputs=[pb_utils.Tensor("IMAGE", f["IMAGE"])]) for f in feeds
    ]
    responses = model.execute(requests)
    assert len(responses) == 2  # one response per request of the list
    for feed, response in zip(feeds, responses, strict=True):
        got = {t.name(): t.as_numpy() for t in response.output_tensors()}
        _assert_matches(got, reference_outputs("python_preprocess", feed))
        # and equal to what the ONNX image_preprocess computes
        onnx_out = _session(repo, "image_preprocess").run(None, feed)[0]
        np.testing.assert_array_equal(got["NORMALIZED"], onnx_out)


class _Collect:
    window = 0  # no flow control (core/stream.py)

    def on_credit(self, grant: Any) -> None:
        raise AssertionError("no window: nothing to grant")

    def __init__(self) -> None:
        self.items: list[tuple[dict[str, Array] | None, bool]] = []

    def send(
        self, outputs: dict[str, Array] | None, final: bool, error: Any, parameters: Any = None
    ) -> None:
        assert error is None
        self.items.append((outputs, final))


@pytest.mark.parametrize("values", [[4, -7, 9], []])
def test_repeat_int32_streams_one_response_per_value(repo: Path, values: list[int]) -> None:
    from kiln.backends.base import InstanceSpec
    from kiln.backends.python.backend import PythonBackend
    from kiln.core.stats import RequestTimes
    from kiln.scheduling.base import Job

    config = parse_config_text(example_config("repeat_int32"))
    spec = InstanceSpec("repeat_int32", "cpu", 0, 0, 1)
    backend = PythonBackend(config, repo / "repeat_int32" / "1", spec)
    try:
        sink = _Collect()

        inputs = {"IN": np.array(values, np.int32)}
        job = Job(inputs, ["OUT", "IDX"], 1, RequestTimes(), request_id="r", sink=sink)
        assert backend.execute_requests([job]) == [{}]
    finally:
        backend.close()
    expected = reference_responses("repeat_int32", {"IN": np.array(values, np.int32)})
    assert [final for _, final in sink.items] == [False] * len(values) + [True]
    assert sink.items[-1][0] is None  # the FINAL flag came without a response
    for (outputs, _), want in zip(sink.items, expected, strict=False):
        assert outputs is not None
        _assert_matches(outputs, want)


def test_python_example_configs(repo: Path) -> None:
    for name in PYTHON_MODELS:
        text = (repo / name / "config.pbtxt").read_text()
        assert text == example_config(name)
        config = parse_config_text(text)
        assert config.backend == "python"
        assert validate_config(config, name, "config.pbtxt") == []
    assert parse_config_text(example_config("repeat_int32")).model_transaction_policy.decoupled
