"""Tool-call parsers, by vLLM's ``--tool-call-parser`` names: each turns a model family's
tool-call text into OpenAI's ``tool_calls``, whole or as streamed deltas."""

from __future__ import annotations

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolCallStream, ToolParser
from kiln.frontends.openai.tool_parsers.forced import NamedCall, RequiredCalls
from kiln.frontends.openai.tool_parsers.hermes import HermesParser
from kiln.frontends.openai.tool_parsers.llama3_json import Llama3JsonParser
from kiln.frontends.openai.tool_parsers.mistral import MistralParser
from kiln.frontends.openai.tool_parsers.phi4_mini import Phi4MiniJsonParser
from kiln.frontends.openai.tool_parsers.pythonic import PythonicParser
from kiln.frontends.openai.tool_parsers.qwen3_xml import Qwen3XmlParser

__all__ = [
    "PARSERS",
    "NamedCall",
    "Parsed",
    "PartialCall",
    "RequiredCalls",
    "ToolCallStream",
    "ToolParser",
]

PARSERS: dict[str, type[ToolParser]] = {
    **{p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser,
                           Phi4MiniJsonParser, Qwen3XmlParser)},
    # vLLM's other names of the same formats
    "qwen3_coder": Qwen3XmlParser,
    "qwen3_json": HermesParser,
}  # fmt: skip
