"""A chat derender's parsing: the original ``chat_request``'s tools and the model's
reasoning parser read the derendered text as ``/v1/chat/completions`` reads its own answer
(``reasoning``, ``content``, ``tool_calls``, and ``finish_reason`` ``tool_calls``), whole
or one streamed chunk at a time. vLLM's rule: with a tool or reasoning parser configured,
a chat derender needs ``chat_request`` (plain text would leak the parser's markup), and a
streamed one ``prompt_token_ids`` too.

A streamed derender keeps nothing on the server: each call replays the output so far
(``stream_state.output_token_ids``, decoded chunk by chunk as ``output_chunk_lens`` says)
through fresh readers, then feeds this call's chunk. kiln's readers read the text so far,
whatever its pieces, so the replay feeds it in one piece: a call costs the output's length
once, not once per earlier chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.frontends.openai import reasoning, tools
from kiln.frontends.openai.protocol import OpenAIError, flag
from kiln.frontends.openai.reasoning import ReasoningParser, ReasoningStream
from kiln.frontends.openai.tool_parsers import ToolCallStream
from kiln.llm.engine_client import EngineClient
from kiln.llm.tokenizer import IncrementalDetokenizer

#: the role of a derendered message (vLLM's derender writes the assistant's)
ROLE = "assistant"


def original(body: dict[str, Any], key: str) -> dict[str, Any]:
    """The request ``/render`` was given (``chat_request``, ``completion_request``)."""
    request = body.get(key)
    if request is not None and not isinstance(request, dict):
        raise OpenAIError(f"'{key}' must be the request object /render was given", param=key)
    return request or {}


def parser_configured(llm: EngineClient) -> bool:
    """vLLM's: a reasoning parser, or a tool-call parser with auto tool choice."""
    return llm.reasoning_parser is not None or (
        llm.tool_call_parser is not None and llm.enable_auto_tool_choice
    )


def _reasoning_fields(text: str | None) -> dict[str, str | None]:
    """As chat writes a message's reasoning: vLLM's ``reasoning`` and its older name."""
    return {"reasoning": text, "reasoning_content": text}


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """How a chat derender reads its text, as chat reads the same request's answer."""

    #: the request's tool calling (its parser None: the answer is plain content)
    tools: tools.ToolRequest | None
    reasoning: ReasoningParser | None
    include_reasoning: bool
    #: the request's ``skip_special_tokens``, off where a parser reads special tokens
    skip_special_tokens: bool

    @property
    def active(self) -> bool:
        return self.reasoning is not None or (
            self.tools is not None and self.tools.parser is not None
        )

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's ``message`` and ``finish_reason`` (chat's ``answer_body``)."""
        thought: dict[str, Any] = {}
        content: str | None = text
        if self.reasoning is not None:
            thinking, answer = self.reasoning.split(text)
            content = answer or ""
            thought = _reasoning_fields(thinking) if self.include_reasoning else {}
        if self.tools is not None and self.tools.parser is not None:
            message, reason = tools.tool_message(self.tools, ROLE, content or "", reason)
        else:
            message = {"role": ROLE, "content": content}
        if thought:
            if not message["content"]:  # vLLM's: no answer after (or beside) the thinking
                message["content"] = None
            message = {**message, **thought}
        return message, reason


def _checked(exc: OpenAIError) -> OpenAIError:
    """An error of the chat request's checks, naming ``chat_request``'s field."""
    exc.param = f"chat_request.{exc.param}" if exc.param else "chat_request"
    return exc


def chat_parsing(llm: EngineClient, body: dict[str, Any], stream: bool) -> ChatParsing:
    """The parsing of a chat derender ``body`` (vLLM's checks first)."""
    chat = original(body, "chat_request")
    if parser_configured(llm):
        if not chat:
            raise OpenAIError(
                "chat_request is required when a tool or reasoning parser is configured "
                "because plain detokenization would leak raw parser markup into content",
                param="chat_request",
            )
        if stream and body.get("prompt_token_ids") is None:
            raise OpenAIError(
                "prompt_token_ids is required when a tool or reasoning parser is "
                "configured: a streamed derender decodes each call's output from the "
                "prompt's last tokens",
                param="prompt_token_ids",
            )
    try:
        skip = flag(chat, "skip_special_tokens", True)
        include = flag(chat, "include_reasoning", True)
        calling = tools.tool_request(chat, llm) if chat else None
    except OpenAIError as exc:
        raise _checked(exc) from None
    if calling is not None and calling.parser is not None and calling.parser.needs_special_tokens:
        skip = False
    thinking = None
    if chat and llm.reasoning_parser is not None:
        thinking = ReasoningParser(llm.reasoning_parser)
        if llm.reasoning_parser in reasoning.SPECIAL_MARKERS:
            skip = False  # the markers are control tokens
    return ChatParsing(calling, thinking, include, skip)


class ChatStream:
    """One streamed choice's readers (chat's ``_sse``): text in, a delta's parts out."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.parsing = parsing
        self.thinking: ReasoningStream | None = (
            parsing.reasoning.stream() if parsing.reasoning else None
        )
        self.calls: ToolCallStream | None = parsing.tools.stream() if parsing.tools else None

    def feed(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta's reasoning, ``tool_calls`` and content of ``text`` (``reason`` not
        None: the last piece), and the finish reason as chat rewrites it."""
        final = reason is not None
        delta: dict[str, Any] = {}
        if self.thinking is not None:
            thought, text = self.thinking.feed(text, final=final)
            if thought and self.parsing.include_reasoning:
                delta.update(_reasoning_fields(thought))
        tooling = self.parsing.tools
        if self.calls is not None and tooling is not None:
            text, deltas = self.calls.feed(text, final=final)
            reason = tooling.finish_reason(self.calls.called, reason)
            if deltas:
                delta["tool_calls"] = deltas
        delta["content"] = text or None
        return delta, reason


def replayed(
    llm: EngineClient,
    parsing: ChatParsing,
    prompt_ids: list[int],
    history: list[int],
    chunk_lens: list[int],
    call_ids: list[str],
) -> tuple[ChatStream, IncrementalDetokenizer]:
    """The readers and the detokenizer where the earlier chunks (``history``, in chunks of
    ``chunk_lens``) left them; the tool calls they began keep their ids (``call_ids``)."""
    detok = IncrementalDetokenizer(llm.tokenizer, parsing.skip_special_tokens, prompt_ids)
    pieces, start = [], 0
    for size in chunk_lens:
        pieces.append(detok.add(history[start : start + size]))
        start += size
    stream = ChatStream(parsing)
    stream.feed("".join(pieces), None)
    if stream.calls is not None:
        stream.calls.pin_ids(call_ids)
    return stream, detok
