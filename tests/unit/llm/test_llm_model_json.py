"""``backend: "vllm"``: ``1/model.json`` (vLLM engine arguments) read into kiln's engine
settings, every argument kiln lacks refused by name; the vLLM backend's tensors
auto-completed into the config as Triton's vLLM backend completes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format

from kiln.config.model_config_pb2 import DataType, ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.llm import model_json
from kiln.llm.triton_tensors import auto_complete
from kiln.repository.manager import RepositoryManager
from kiln.server.runtime import runtime_factory


def _write(tmp_path: Path, args: dict[str, Any]) -> Path:
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True, exist_ok=True)
    (tmp_path / "hf").mkdir(exist_ok=True)
    (version / "model.json").write_text(json.dumps(args))
    return version


def test_engine_arguments_honoured(tmp_path: Path) -> None:
    version = _write(
        tmp_path,
        {
            "model": str(tmp_path / "hf"),
            "dtype": "half",
            "max_model_len": "128",  # Triton users write strings too
            "max_num_seqs": 4,
            "max_num_batched_tokens": 512,
            "block_size": 8,
            "num_gpu_blocks_override": 32,
            "enable_prefix_caching": "false",
            "enforce_eager": True,
            "gpu_memory_utilization": 0.9,
            "tensor_parallel_size": 1,
            "disable_log_requests": True,
            "stream_interval": 4,
            "watermark": "0.1",
            "scheduler_reserve_full_isl": False,
            "kv_cache_metrics": "true",  # vLLM's observability switches
            "kv_cache_metrics_sample": 0.5,
            "enable_mfu_metrics": True,
        },
    )
    read = model_json.load("m", version)
    assert read.folder == tmp_path / "hf" and read.tokenizer == tmp_path / "hf"
    e = read.engine
    assert (e.dtype, e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens) == (
        "float16", 128, 4, 512,
    )  # fmt: skip
    assert (e.block_size, e.num_gpu_blocks, e.enable_prefix_caching, e.enforce_eager) == (
        8, 32, False, True,
    )  # fmt: skip
    assert e.stream_interval == 4
    assert (e.watermark, e.scheduler_reserve_full_isl) == (0.1, False)
    o = e.observability
    assert (o.kv_cache_metrics, o.kv_cache_metrics_sample, o.enable_mfu_metrics) == (
        True, 0.5, True,
    )  # fmt: skip


def test_relative_model_path_is_beside_model_json(tmp_path: Path) -> None:
    version = _write(tmp_path, {"model": "../../hf"})
    assert model_json.load("m", version).folder.resolve() == (tmp_path / "hf").resolve()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"swap_space": 4}, "engine argument 'swap_space' is not supported"),
        ({"quantization": "awq"}, "'quantization'"),
        ({"pipeline_parallel_size": 2}, "'pipeline_parallel_size' is 2"),
        ({"tensor_parallel_size": 0}, "'tensor_parallel_size' must be at least 1, got 0"),
        ({"stream_interval": 0}, "'stream_interval' must be at least 1, got 0"),
        ({"trust_remote_code": True}, "'trust_remote_code'"),
        ({"max_num_seqs": "many"}, "'max_num_seqs' must be an integer"),
        ({"gpu_memory_utilization": 1.5}, "'gpu_memory_utilization' must be a number in (0, 1]"),
        ({"dtype": "int4"}, "'dtype' must be auto or one of"),
        ({"enable_prefix_caching": "maybe"}, "'enable_prefix_caching' must be true or false"),
        ({"watermark": 1}, "'watermark' must be a number in [0, 1), got 1"),
        ({"kv_cache_metrics": "on?"}, "'kv_cache_metrics' must be true or false"),
        ({"kv_cache_metrics_sample": 0}, "'kv_cache_metrics_sample' must be a number in (0, 1]"),
        ({"kv_cache_metrics_sample": "nan"}, "'kv_cache_metrics_sample' must be a number"),
        ({"enable_mfu_metrics": 1}, "'enable_mfu_metrics' must be true or false"),
    ],
)
def test_refused_by_name(tmp_path: Path, args: dict[str, Any], named: str) -> None:
    version = _write(tmp_path, {"model": str(tmp_path / "hf"), **args})
    with pytest.raises(KilnError) as info:
        model_json.load("m", version)
    assert info.value.status is Status.INVALID_ARG
    assert "model 'm': model.json: " in info.value.message
    assert named in info.value.message


def test_enable_lora_reads_multi_lora_json(tmp_path: Path) -> None:
    """Triton's vLLM backend: ``enable_lora`` (its examples write the string "true") and the
    LoRA limits in model.json, the adapters by name in ``multi_lora.json`` beside it."""
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "chat").mkdir()
    version = _write(
        tmp_path,
        {"model": str(tmp_path / "hf"), "enable_lora": "true", "max_loras": 2,
         "max_lora_rank": "32", "max_cpu_loras": 4},
    )  # fmt: skip
    lora = {"sql": "../../adapters/sql", "chat": str(tmp_path / "chat")}
    (version / "multi_lora.json").write_text(json.dumps(lora))
    config = model_json.load("m", version).engine.lora_config
    assert config is not None
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (2, 32, 4)
    paths = {m.name: Path(m.path).resolve() for m in config.lora_modules}
    assert paths == {"sql": (tmp_path / "adapters" / "sql").resolve(), "chat": tmp_path / "chat"}
    plain = _write(tmp_path, {"model": str(tmp_path / "hf")})
    assert model_json.load("m", plain).engine.lora_config is None


@pytest.mark.parametrize(
    ("args", "lora", "named"),
    [
        ({"enable_lora": True}, None, "the adapters must be named in"),
        ({"enable_lora": True}, "{nope", "multi_lora.json is not valid JSON"),
        ({"enable_lora": True}, "[]", "multi_lora.json must be a JSON object"),
        ({"enable_lora": True}, '{"x": "/no/such/dir"}', "'multi_lora.json: x' is '/no/such/dir'"),
        ({"max_loras": 2}, None, "'max_loras' needs 'enable_lora': true"),
        ({"enable_lora": "maybe"}, None, "'enable_lora' must be true or false"),
        ({"enable_lora": True, "max_loras": 0}, "{}", "'max_loras' must be at least 1"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, '{"a": "."}',
         "max_cpu_loras (2) must be at least max_loras (4)"),
    ],
)  # fmt: skip
def test_lora_settings_refused_by_name(
    tmp_path: Path, args: dict[str, Any], lora: str | None, named: str
) -> None:
    version = _write(tmp_path, {"model": str(tmp_path / "hf"), **args})
    if lora is not None:
        (version / "multi_lora.json").write_text(lora)
    with pytest.raises(KilnError) as info:
        model_json.load("m", version)
    assert info.value.status is Status.INVALID_ARG
    assert "model 'm': model.json: " in info.value.message
    assert named in info.value.message


def test_hub_id_and_missing_file_explained(tmp_path: Path) -> None:
    version = _write(tmp_path, {"model": "facebook/opt-125m"})
    with pytest.raises(KilnError, match="not a local folder: kiln serves a Hugging Face folder"):
        model_json.load("m", version)
    (version / "model.json").unlink()
    with pytest.raises(KilnError, match=r"backend vllm needs 'model\.json'"):
        model_json.load("m", version)
    (version / "model.json").write_text("{nope")
    with pytest.raises(KilnError, match=r"model\.json: not valid JSON"):
        model_json.load("m", version)


async def test_repository_load_names_the_argument(tmp_path: Path) -> None:
    """The refusal is the model's load error, as the repository index reports it."""
    version = _write(tmp_path, {"model": str(tmp_path / "hf"), "swap_space": 4})
    (version.parent / "config.pbtxt").write_text('backend: "vllm"')
    repo = RepositoryManager([tmp_path], runtime_factory())
    with pytest.raises(KilnError, match="engine argument 'swap_space' is not supported"):
        await repo.load("m")
    index = {e["name"]: e for e in repo.index()}
    assert index["m"]["state"] == "UNAVAILABLE"
    assert "engine argument 'swap_space' is not supported" in index["m"]["reason"]


def test_auto_complete_as_triton_vllm_backend() -> None:
    config = text_format.Parse(
        'backend: "vllm" input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]',
        ModelConfig(),
    )
    auto_complete(config)
    inputs = {t.name: (t.data_type, list(t.dims), t.optional) for t in config.input}
    assert inputs["text_input"] == (DataType.TYPE_STRING, [1], False)  # kept as given
    assert inputs["stream"] == (DataType.TYPE_BOOL, [1], True)
    assert inputs["sampling_parameters"] == (DataType.TYPE_STRING, [1], True)
    assert inputs["return_num_output_tokens"] == (DataType.TYPE_BOOL, [1], True)
    outputs = {t.name: (t.data_type, list(t.dims)) for t in config.output}
    assert outputs == {
        "text_output": (DataType.TYPE_STRING, [-1]),
        "finish_reason": (DataType.TYPE_STRING, [-1]),
        "cumulative_logprob": (DataType.TYPE_FP32, [-1]),
        "num_input_tokens": (DataType.TYPE_UINT32, [1]),
        "num_output_tokens": (DataType.TYPE_UINT32, [-1]),
    }
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    # a policy the config sets is kept: decoupled false answers one whole response
    kept = text_format.Parse("model_transaction_policy { decoupled: false }", ModelConfig())
    auto_complete(kept)
    assert not kept.model_transaction_policy.decoupled
