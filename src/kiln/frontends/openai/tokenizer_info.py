"""vLLM's ``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``): the tokenizer's
configuration, as ``tokenizer_config.json`` holds it, and the chat template the server
renders with.

As vLLM's: the file paths (``vocab_file``, ``merges_file``) are left out, a special token
written as an object (``{"content": "<s>", ...}``, ``added_tokens_decoder``'s entries) is
its text, ``tokenizer_class`` is always there, and ``chat_template`` is the template in use
(``--chat-template``'s, else the checkpoint's). Off unless asked: the template and the
special tokens are the model's, which a deployment may not want to show.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.llm.tokenizer import Tokenizer

__all__ = ["tokenizer_info"]

#: the class a ``tokenizers`` tokenizer loads as in transformers when its config names none
DEFAULT_CLASS = "PreTrainedTokenizerFast"


def _plain(value: Any) -> Any:
    """JSON with each added-token object as its text."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and (
            "__type" in value or {"lstrip", "rstrip", "special", "normalized"} & value.keys()
        ):
            return value["content"]
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def tokenizer_info(tokenizer: Tokenizer) -> dict[str, Any]:
    info: dict[str, Any] = _plain(
        {k: v for k, v in tokenizer.config.items() if k not in ("vocab_file", "merges_file")}
    )
    for key, text in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eos_token)):
        if text and key not in info:  # a .gguf file's, from its metadata
            info[key] = text
    name = info.get("tokenizer_class")
    info["tokenizer_class"] = name if isinstance(name, str) and name else DEFAULT_CLASS
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
