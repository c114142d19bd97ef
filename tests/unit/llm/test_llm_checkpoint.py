"""Checkpoints and engine settings: vLLM's keys as config.pbtxt parameters, dtype ``auto``,
the KV cache's default size, which files hold the weights, generation_config.json, BOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from google.protobuf import text_format

from kiln.backends.base import InstanceSpec
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError
from kiln.llm.backend import LLMBackend, engine_config
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from tests.llm_models import build_tiny_llm


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


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    from kiln.llm.sequence import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], params)[0]


def test_the_index_decides_which_files_hold_the_weights(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tests.llm_models import reference_generate

    folder = _copy(llama, tmp_path / "mistral-layout")
    tensors = load_file(str(folder / "model.safetensors"))
    # Mistral's repositories ship the same weights again under their own names
    renamed = {
        k.replace("model.layers.", "layers.").replace("self_attn.", "attention."): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(folder / "consolidated.safetensors"))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = reference_generate(llama, [1, 2, 3], 6)
    assert _greedy(LLMEngine(folder, EngineConfig(num_gpu_blocks=16)), [1, 2, 3], 6) == expected
    # without an index, the Hugging Face files are taken over consolidated.safetensors
    (folder / "model.safetensors.index.json").unlink()
    assert _greedy(LLMEngine(folder, EngineConfig(num_gpu_blocks=16)), [1, 2, 3], 6) == expected
    # an index naming a file that is not there is a clear error
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KilnError, match="names files missing"):
        LLMEngine(folder, EngineConfig(num_gpu_blocks=16))


def _backend(folder: Path, **params: str) -> LLMBackend:
    config = ModelConfig(name="m", backend="llm")
    config.parameters["num_gpu_blocks"].string_value = "16"
    for key, value in params.items():
        config.parameters[key].string_value = value
    spec = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)
    return LLMBackend(config, folder, spec)


def test_generation_config_gives_defaults_and_eos_ids(llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path / "gen")
    generation = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True,
                  "eos_token_id": [7, 9], "max_new_tokens": 5}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(generation))
    backend = _backend(folder)
    assert backend.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert {7, 9} <= set(backend.engine.args.eos_token_ids)
    assert backend.max_new_tokens == 5
    backend.close()
    plain = _backend(folder, generation_config="vllm")
    assert plain.sampling_defaults == {} and plain.max_new_tokens is None
    assert 7 not in plain.engine.args.eos_token_ids
    plain.close()
    other = _copy(llama, tmp_path / "other")
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.2}))
    chosen = _backend(folder, generation_config=str(other))
    assert chosen.sampling_defaults == {"repetition_penalty": 1.2}
    chosen.close()
    with pytest.raises(KilnError, match="generation_config must be auto, vllm or a folder"):
        _backend(folder, generation_config=str(tmp_path / "nowhere"))


def test_only_a_sentencepiece_model_says_how_to_convert(llama: Path, tmp_path: Path) -> None:
    from kiln.llm.tokenizer import Tokenizer

    folder = _copy(llama, tmp_path / "sp")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"\x0a")
    with pytest.raises(KilnError, match=r"tokenizer.model but no tokenizer.json.*save_pretrained"):
        Tokenizer.load(folder)


def test_the_post_processor_decides_bos(llama: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from kiln.llm.tokenizer import Tokenizer

    folder = _copy(llama, tmp_path / "bos")
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    bos = hf.token_to_id("<s>")
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    hf.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.load(folder)
    plain = tok.encode("hello world")
    assert bos not in plain
    assert tok.encode("hello world", add_special_tokens=True) == [bos, *plain]
