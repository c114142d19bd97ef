"""Checkpoints and engine settings: vLLM's keys as config.pbtxt parameters, dtype ``auto``,
the KV cache's default size, which files hold the weights, generation_config.json, BOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from google.protobuf import text_format  # noqa: E402

from kiln.backends.base import InstanceSpec  # noqa: E402
from kiln.config.model_config_pb2 import ModelConfig  # noqa: E402
from kiln.core.errors import KilnError  # noqa: E402
from kiln.llm.backend import engine_config  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _config(params: dict[str, str]) -> EngineConfig:
    text = 'name: "m" backend: "llm" ' + " ".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()
    )
    spec = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)
    config = engine_config(text_format.Parse(text, ModelConfig()), spec)
    config.check()
    return config


def test_vllm_keys_as_config_parameters() -> None:
    default = _config({})
    assert default.dtype == "auto" and default.gpu_memory_utilization == 0.9
    assert default.kv_cache_memory_bytes == 0 and default.generation_config == "auto"
    config = _config(
        {
            "dtype": "half",
            "gpu_memory_utilization": "0.5",
            "generation_config": "vllm",
            "chat_template": "{{ messages }}",
        }
    )
    assert config.dtype == "float16" and config.gpu_memory_utilization == 0.5
    assert config.generation_config == "vllm" and config.chat_template == "{{ messages }}"
    with pytest.raises(KilnError, match="gpu_memory_utilization must be a number"):
        _config({"gpu_memory_utilization": "most"})
    with pytest.raises(KilnError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        _config({"gpu_memory_utilization": "1.5"})
    with pytest.raises(KilnError, match="dtype must be one of auto, float32"):
        _config({"dtype": "int8"})


def test_dtype_auto_is_float32_on_the_cpu(llama: Path, tmp_path: Path) -> None:
    # a bfloat16 checkpoint: kiln's CPU kernels are float32, so auto serves float32
    config = json.loads((llama / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    folder = tmp_path / "bf16"
    folder.mkdir()
    for f in llama.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(folder, EngineConfig(num_gpu_blocks=8))
    assert engine.config.dtype == "float32"
    assert engine.runner.kv_cache.dtype.is_floating_point and engine.runner.dtype.itemsize == 4


def test_cpu_kv_cache_default_is_what_the_sequences_can_fill(llama: Path) -> None:
    engine = LLMEngine(llama, EngineConfig(max_num_seqs=2, block_size=4))
    # 2 sequences of max_position_embeddings (256) tokens, no more (4 GiB would be wasted)
    tokens = engine.runner.num_blocks * 4
    assert 2 * 256 <= tokens <= 2 * 256 + 8
    assert engine.config.max_model_len == 256
    sized = LLMEngine(llama, EngineConfig(kv_cache_memory_bytes=1 << 20, block_size=4))
    assert sized.runner.num_blocks == (1 << 20) // sized.runner.block_bytes
