"""PythonBackend against a real worker process (no server): load, execute, faults."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.backends.base import InstanceSpec
from kiln.backends.python.backend import PythonBackend
from kiln.config.loader import parse_config_text
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

MODEL = """
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        if "fail" in json.loads(args["model_config"]).get("parameters", {}):
            raise RuntimeError("cannot open weights.bin")

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x.size and x.reshape(-1)[0] == -1:
                raise ValueError("negative one is not allowed")
            if x.size and x.reshape(-1)[0] == -2:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("bad row")))
                continue
            names = [pb_utils.Tensor("OUT", x * 2), pb_utils.Tensor("NAME",
                     np.array([self.args["model_instance_name"]], dtype=object))]
            out.append(pb_utils.InferenceResponse(output_tensors=names))
        return out
"""

CONFIG = """
name: "double"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

SPEC = InstanceSpec(name="double_0", kind="cpu", device_id=0, index=0, total_instances=1)


def _model_dir(tmp_path: Path, source: str = MODEL) -> Path:
    version = tmp_path / "double" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(source))
    return version


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[PythonBackend]:
    b = PythonBackend(parse_config_text(CONFIG), _model_dir(tmp_path), SPEC)
    yield b
    b.close()


class _Req:
    correlation_id = 0  # outside a sequence
    flags = 0

    def __init__(self, value: np.ndarray) -> None:
        self.inputs = {"IN": value}
        self.output_names = ["OUT", "NAME"]
        self.parameters: dict[str, object] = {}
        self.request_id = ""
        self.sink = None
        self.deadline_ns = 0


def test_execute_one_and_many(backend: PythonBackend) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = backend.execute({"IN": x}, ["OUT"])
    np.testing.assert_array_equal(out["OUT"], x * 2)
    assert out["NAME"].tolist() == [b"double_0_0"]
    outcomes = backend.execute_requests([_Req(x), _Req(np.ones((1, 5), np.float32))])  # type: ignore[list-item]
    assert isinstance(outcomes[0], dict) and isinstance(outcomes[1], dict)
    np.testing.assert_array_equal(outcomes[1]["OUT"], np.full((1, 5), 2, np.float32))


def test_one_request_fails_alone(backend: PythonBackend) -> None:
    good, bad = np.ones((1, 2), np.float32), np.full((1, 2), -2, np.float32)
    outcomes = backend.execute_requests([_Req(good), _Req(bad)])  # type: ignore[list-item]
    assert isinstance(outcomes[0], dict)
    assert isinstance(outcomes[1], KilnError) and outcomes[1].message == "bad row"


def test_execute_raising_fails_the_batch_and_the_worker_lives(backend: PythonBackend) -> None:
    pid = backend.worker.pid
    outcomes = backend.execute_requests([_Req(np.full((1, 1), -1, np.float32))])  # type: ignore[list-item]
    error = outcomes[0]
    assert isinstance(error, KilnError) and error.status is Status.INTERNAL
    assert "model 'double'" in error.message
    assert "ValueError: negative one is not allowed" in error.message
    assert backend.worker.pid == pid
    np.testing.assert_array_equal(
        backend.execute({"IN": np.ones((1, 1), np.float32)}, [])["OUT"], [[2]]
    )


def test_killed_worker_is_restarted(backend: PythonBackend) -> None:
    old = backend.worker.pid
    assert backend.worker.proc is not None
    backend.worker.proc.kill()
    backend.worker.proc.wait()
    with pytest.raises(KilnError, match=r"model 'double'.*(killed|stopped)"):
        backend.execute({"IN": np.ones((1, 1), np.float32)}, ["OUT"])
    out = backend.execute({"IN": np.ones((1, 1), np.float32)}, ["OUT"])
    np.testing.assert_array_equal(out["OUT"], [[2]])
    assert backend.worker.pid != old


def test_initialize_error_is_the_traceback_last_line(tmp_path: Path) -> None:
    config = parse_config_text(CONFIG + 'parameters { key: "fail" value { string_value: "1" } }')
    with pytest.raises(KilnError, match=r"RuntimeError: cannot open weights\.bin$"):
        PythonBackend(config, _model_dir(tmp_path), SPEC)


def test_syntax_error_in_model_py_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=r"initialize failed: .*SyntaxError"):
        PythonBackend(parse_config_text(CONFIG), _model_dir(tmp_path, "def broken(:\n"), SPEC)


AUTO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(8)
        tensor = {"data_type": "TYPE_FP32", "dims": [4]}
        auto_complete_model_config.add_input({"name": "IN", **tensor})
        auto_complete_model_config.add_output({"name": "OUT", **tensor})
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return []
"""


def test_auto_complete_config_runs_in_a_worker(tmp_path: Path) -> None:
    config = ModelConfig(name="auto", backend="python")
    PythonBackend.auto_complete_config(config, _model_dir(tmp_path, AUTO))
    assert config.max_batch_size == 8
    assert [(i.name, list(i.dims)) for i in config.input] == [("IN", [4])]
    assert [o.name for o in config.output] == ["OUT"]
    assert config.HasField("dynamic_batching")


def test_auto_complete_conflict_fails_the_load(tmp_path: Path) -> None:
    config = ModelConfig(name="auto", backend="python", max_batch_size=16)
    with pytest.raises(KilnError, match=r"auto_complete_config failed: .*max_batch_size 16"):
        PythonBackend.auto_complete_config(config, _model_dir(tmp_path, AUTO))


def test_model_without_the_hook_needs_no_worker(tmp_path: Path) -> None:
    config = parse_config_text(CONFIG)
    before = config.SerializeToString()
    PythonBackend.auto_complete_config(config, _model_dir(tmp_path))
    assert config.SerializeToString() == before
