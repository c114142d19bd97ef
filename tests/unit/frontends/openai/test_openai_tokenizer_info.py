"""vLLM's ``/tokenizer_info`` body: tokenizer_config.json, its paths left out, its token
objects as text, the class named, and the chat template in use."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kiln.frontends.openai.tokenizer_info import DEFAULT_CLASS, tokenizer_info


def _tokenizer(config: dict[str, Any], template: str | None = None) -> Any:
    return SimpleNamespace(config=config, bos_token="<s>", eos_token="</s>",
                           chat_template=template)  # fmt: skip


def test_the_config_as_vllm_shows_it() -> None:
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "vocab_file": "/secret/path/vocab.json",
        "merges_file": "/secret/path/merges.txt",
        "bos_token": {"content": "<s>", "lstrip": False, "special": True, "__type": "AddedToken"},
        "eos_token": "</s>",
        "added_tokens_decoder": {"0": {"content": "<unk>", "special": True, "normalized": False}},
        "model_max_length": 2048,
        "extra": {"content": "plain data"},  # not a token: kept as it is
    }
    info = tokenizer_info(_tokenizer(config, "{{ messages }}"))
    assert "vocab_file" not in info and "merges_file" not in info
    assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>"
    assert info["added_tokens_decoder"] == {"0": "<unk>"}
    assert info["tokenizer_class"] == "LlamaTokenizerFast"
    assert info["model_max_length"] == 2048 and info["extra"] == {"content": "plain data"}
    assert info["chat_template"] == "{{ messages }}"
    assert config["vocab_file"] == "/secret/path/vocab.json"  # the tokenizer's left alone


def test_a_bare_tokenizer_still_names_its_class_and_tokens() -> None:
    info = tokenizer_info(_tokenizer({}))
    assert info == {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": DEFAULT_CLASS}
