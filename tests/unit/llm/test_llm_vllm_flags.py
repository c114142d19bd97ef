"""vLLM's engine flags a command line carries over: ``--seed`` (unseeded requests repeat
from one start to the next) and ``--max-logprobs`` (the bound on a request's logprobs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig, PoolerConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.params import InvalidField
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _sampled(folder: Path, seed: int | None) -> list[int]:
    """Tokens of one unseeded request at temperature 1 from a fresh engine."""
    engine = LLMEngine(folder, EngineConfig(block_size=4, seed=seed))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_seed_makes_unseeded_requests_repeat_from_one_start_to_the_next(folder: Path) -> None:
    import torch

    first = _sampled(folder, 7)
    torch.manual_seed(12345)  # whatever drew from the generators meanwhile
    assert _sampled(folder, 7) == first
    assert _sampled(folder, 8) != first


def test_max_logprobs_bounds_a_requests_logprobs(folder: Path) -> None:
    from kiln.cli.llm_options import served_models

    engine = LLMEngine(folder, EngineConfig())  # vLLM's default: 20
    engine.check_request(3, SamplingParams(logprobs=20, prompt_logprobs=20))
    with pytest.raises(InvalidField, match=r"sample logprobs of 21, .* max allowed: 20") as info:
        engine.check_request(3, SamplingParams(logprobs=21))
    assert info.value.field == "logprobs"
    with pytest.raises(InvalidField, match="prompt logprobs of 21") as info:
        engine.check_request(3, SamplingParams(prompt_logprobs=21))
    assert info.value.field == "prompt_logprobs"
    wider = LLMEngine(folder, EngineConfig(max_logprobs=50))
    wider.check_request(3, SamplingParams(logprobs=50))
    everything = LLMEngine(folder, EngineConfig(max_logprobs=-1))
    vocab = everything.args.vocab_size
    everything.check_request(3, SamplingParams(logprobs=vocab))
    with pytest.raises(InvalidField, match=f"max allowed: {vocab} "):
        everything.check_request(3, SamplingParams(logprobs=vocab + 1))
    with pytest.raises(KilnError, match=r"max_logprobs must be -1 .* got -2"):
        EngineConfig(max_logprobs=-2).check()
    (config,) = served_models((folder,), ("tiny",), {"max_logprobs": 5, "seed": 3})
    assert config.parameters["max_logprobs"].string_value == "5"
    assert config.parameters["seed"].string_value == "3"


def _engine_config(folder: Path, **flags: object) -> EngineConfig:
    from kiln.backends.base import InstanceSpec
    from kiln.cli.llm_options import served_models
    from kiln.llm.backend import engine_config

    (config,) = served_models((folder,), ("m",), flags)
    spec = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)
    return engine_config(config, spec)


def test_pooling_flags_serve_a_language_model_as_an_embedding_model(
    folder: Path, tmp_path: Path
) -> None:
    from tests.llm_models import build_tiny_encoder

    # vLLM's --runner pooling (or --convert embed, or the older --task embed) and
    # --pooler-config: the same parameters a config.pbtxt gives
    config = _engine_config(folder, runner="pooling", pooler_config='{"pooling_type": "MEAN"}')
    assert config.runner == "pooling" and config.pooler_config.pooling_type == "MEAN"
    assert _engine_config(folder, convert="embed").runner == "pooling"
    assert _engine_config(folder, task="embed").runner == "pooling"
    assert _engine_config(folder, runner="auto").runner == "generate"
    engine = LLMEngine(folder, config)
    assert engine.config.pooler_config.pooling_type == "MEAN"
    assert engine.config.pooler_config.normalize is True  # the model's default
    # a pooler config for a model that generates is refused, naming what to set
    generating = _engine_config(folder, pooler_config='{"normalize": false}')
    with pytest.raises(KilnError, match="need runner 'pooling'"):
        LLMEngine(folder, generating)
    # an encoder pools without being told: its pooler config needs no --runner
    encoder = build_tiny_encoder(tmp_path / "bert")
    asked = _engine_config(encoder, pooler_config='{"pooling_type": "MEAN"}')
    assert LLMEngine(encoder, asked).config.pooler_config == PoolerConfig("MEAN", True)


def test_json_and_tokenizer_parameters_are_checked(tmp_path: Path) -> None:
    """config.pbtxt's spellings of vLLM's --default-chat-template-kwargs,
    --override-generation-config and --tokenizer: refused by name when malformed."""
    from kiln.backends.base import InstanceSpec
    from kiln.config.model_config_pb2 import ModelConfig
    from kiln.llm.backend import LLMBackend, json_object

    config = ModelConfig(name="m", backend="llm")
    assert json_object(config, "default_chat_template_kwargs") == {}
    config.parameters["default_chat_template_kwargs"].string_value = '{"a": 1}'
    assert json_object(config, "default_chat_template_kwargs") == {"a": 1}
    for bad, why in (("[1]", "JSON object"), ("{nope", "not JSON")):
        config.parameters["override_generation_config"].string_value = bad
        with pytest.raises(KilnError, match=why):
            json_object(config, "override_generation_config")
    config.parameters["tokenizer"].string_value = str(tmp_path / "missing")
    with pytest.raises(KilnError, match=r"parameter tokenizer .* is not a folder"):
        LLMBackend._settings(config, tmp_path, InstanceSpec("m_0", "cpu", 0, 0, 1))


def test_frontend_and_admission_parameters_are_checked(tmp_path: Path) -> None:
    """config.pbtxt's spellings of --chat-template-content-format,
    --sse-keep-alive-interval, --max-num-queued-reqs and --max-num-queued-tokens: read, and
    refused by name when malformed."""
    from kiln.backends.base import InstanceSpec
    from kiln.config.model_config_pb2 import ModelConfig
    from kiln.llm.backend import content_format, engine_config, keep_alive_interval

    config = ModelConfig(name="m", backend="llm")
    instance = InstanceSpec("m_0", "cpu", 0, 0, 1)
    assert (content_format(config), keep_alive_interval(config)) == ("auto", 0.0)
    settings = engine_config(config, instance)
    assert (settings.max_num_queued_reqs, settings.max_num_queued_tokens) == (None, None)
    for key, value in (("chat_template_content_format", " OpenAI "),
                       ("sse_keep_alive_interval", "2.5"), ("max_num_queued_reqs", "0"),
                       ("max_num_queued_tokens", "8192")):  # fmt: skip
        config.parameters[key].string_value = value
    assert (content_format(config), keep_alive_interval(config)) == ("openai", 2.5)
    settings = engine_config(config, instance)
    assert (settings.max_num_queued_reqs, settings.max_num_queued_tokens) == (0, 8192)
    for key, bad in (("chat_template_content_format", "jinja"),
                     ("sse_keep_alive_interval", "-1"), ("sse_keep_alive_interval", "inf"),
                     ("sse_keep_alive_interval", "nan"), ("max_num_queued_reqs", "-2"),
                     ("max_num_queued_tokens", "lots")):  # fmt: skip
        broken = ModelConfig(name="m", backend="llm")
        broken.parameters[key].string_value = bad
        with pytest.raises(KilnError, match=f"model 'm': parameter {key}"):
            content_format(broken)
            keep_alive_interval(broken)
            engine_config(broken, instance)
