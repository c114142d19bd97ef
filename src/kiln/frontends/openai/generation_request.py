"""OpenAI request bodies -> checked values: a completions or chat request as a
:class:`GenerationRequest` (its sampling parameters and everything its answer needs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.frontends.openai import generation_fields
from kiln.frontends.openai.content import content_text
from kiln.frontends.openai.protocol import COMPLETION_FIELDS, OpenAIError, check_fields, flag
from kiln.llm.params import InvalidField, integer, sampling_fields
from kiln.llm.sequence import SamplingParams
from kiln.llm.structured import from_request as structured_outputs

if TYPE_CHECKING:
    from kiln.frontends.openai.reasoning import ReasoningParser
    from kiln.frontends.openai.tools import ToolRequest


@dataclass(slots=True)
class GenerationRequest:
    model: str
    #: text or token ids, one engine request each (a completions list; chat: one)
    prompts: list[str | list[int]]
    max_tokens: int | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    #: vLLM's ``stream_options.continuous_usage_stats``: every chunk carries ``usage``
    continuous_usage: bool = False
    echo: bool = False
    #: vLLM's ``prompt_logprobs`` field was asked for: the answer carries it
    prompt_logprobs_field: bool = False
    #: vLLM's request priority: lower runs earlier (``scheduling_policy: priority`` only)
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: the tokenizer's special tokens (BOS) are added to a text prompt (vLLM's field: on
    #: for completions, off for chat, whose template writes its own)
    add_special_tokens: bool = True
    #: vLLM's: logprobs name tokens ``token_id:<id>`` instead of by their text
    return_tokens_as_token_ids: bool = False
    bad_words: tuple[str, ...] = ()
    #: keep the prompt's last this many tokens (vLLM's ``truncate_prompt_tokens``)
    truncate_prompt_tokens: int | None = None
    #: chat: the answer's role, and (vLLM's ``echo``) the last message's text it starts with
    role: str = "assistant"
    chat_echo: str = ""
    #: the client's ``request_id`` (vLLM's): the answer's ``id`` is built from it
    request_id: str | None = None
    #: chat: the template's options (:func:`chat_template_options`)
    template: dict[str, Any] = field(default_factory=dict)
    #: chat: ``tools`` and ``tool_choice`` (kiln.frontends.openai.tools)
    tools: ToolRequest | None = None
    #: chat on a model with a reasoning parser: the answer's ``<think>`` part is split off
    reasoning: ReasoningParser | None = None
    #: vLLM's ``include_reasoning``: false leaves the reasoning out of the answer
    include_reasoning: bool = True
    #: vLLM's ``use_beam_search``: ``n`` beams (kiln.llm.beam_search), ranked with
    #: ``length_penalty``
    beam_search: bool = False
    length_penalty: float = 1.0
    #: False: the choices' text is not made (vLLM's --tokens-only: ``tokens_only.py``)
    detokenize: bool = True


def _common(
    body: dict[str, Any], prompts: list[str | list[int]], max_key: str, chat: bool
) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required and must be a string", param="model")
    try:
        fields = sampling_fields(body)
        max_tokens = integer(body, max_key)
        if max_tokens is None and max_key != "max_tokens":
            max_tokens = integer(body, "max_tokens")
            if max_tokens is not None:  # an error names the field the client sent
                max_key = "max_tokens"
        n = integer(body, "n")
        priority = integer(body, "priority") or 0
        generation_fields.best_of(body, n or 1)
        output = generation_fields.output_fields(body)
        structured = structured_outputs(body)
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    beam, length_penalty = generation_fields.beam_search(body, fields)
    if max_tokens is not None and max_tokens <= 0:
        raise OpenAIError(f"{max_key} must be at least 1, got {max_tokens}", param=max_key)
    if n is not None and n < 1:
        raise OpenAIError(f"n must be at least 1, got {n}", param="n")
    stops = generation_fields.stops(body.get("stop"))
    logprobs = generation_fields.logprobs(body, chat)
    chosen = generation_fields.logprob_token_ids(body, logprobs, beam)
    echo = flag(body, "echo", False)
    stream = flag(body, "stream", False)
    include_usage, continuous_usage = generation_fields.stream_options(
        body.get("stream_options"), stream
    )
    try:
        prompt_logprobs = integer(body, "prompt_logprobs")
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if prompt_logprobs is not None:
        if prompt_logprobs < 0:
            raise OpenAIError(
                f"prompt_logprobs must be >= 0, got {prompt_logprobs}", param="prompt_logprobs"
            )
        if stream:
            raise OpenAIError(
                "prompt_logprobs is answered with the whole response: not with stream",
                param="prompt_logprobs",
            )
    echoed = logprobs if echo and not chat else None
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # the default is settled once the prompt's length is known
        logprobs=logprobs,
        n=n or 1,
        # an echoed prompt gets its logprobs too (completions, whole or streamed)
        prompt_logprobs=max((v for v in (echoed, prompt_logprobs) if v is not None), default=None),
        structured_outputs=structured,
        logprob_token_ids=chosen,
        **fields,
    )
    return GenerationRequest(
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        stop=stops,
        echo=echo,
        prompt_logprobs_field=prompt_logprobs is not None,
        priority=priority,
        add_special_tokens=flag(body, "add_special_tokens", not chat),
        beam_search=beam,
        length_penalty=length_penalty,
        **output,
    )


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The ``prompt`` field as a list of prompts: a string, token ids, or a list of either
    (OpenAI's batch: choice ``index`` = prompt ``i`` * ``n`` + sample ``j``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        prompts = [None]
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) and p) and not _is_token_ids(p):
            where = "'prompt'" if len(prompts) == 1 else f"prompt[{i}]"
            raise OpenAIError(
                f"{where} must be a non-empty string or a list of token ids (or 'prompt' a "
                "list of those)",
                param="prompt",
            )
    return prompts


def completion_request(body: dict[str, Any]) -> GenerationRequest:
    check_fields(body, COMPLETION_FIELDS, "completions")
    return _common(body, completion_prompts(body), "max_tokens", chat=False)


def chat_request(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    rendered_prompt: str,
    template: dict[str, Any],
    response_role: str = "assistant",
) -> GenerationRequest:
    req = _common(body, [rendered_prompt], "max_completion_tokens", chat=True)
    # vLLM's roles: the answer is the server's --response-role (the assistant's) after a
    # generation prompt, else it continues the last message's role; echo starts it with
    # that message when it is ours
    req.role = response_role if template["add_generation_prompt"] else messages[-1]["role"]
    if req.echo and messages[-1]["role"] == req.role:
        req.chat_echo = content_text(messages[-1]["content"])
    req.template = template
    req.include_reasoning = flag(body, "include_reasoning", True)
    return req
