"""A generation prepared: its prompt checked, a chat's rendered by the chat template, each
prompt tokenized with its sampling parameters, the server's defaults applied (and
``/tokenize``'s and ``/detokenize``'s work, which is the same tokenizing)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kiln.core.errors import KilnError
from kiln.frontends.openai import reasoning, tools
from kiln.frontends.openai.chat_input import (
    chat_messages,
    chat_template_options,
    with_server_kwargs,
)
from kiln.frontends.openai.content import content_text, for_template
from kiln.frontends.openai.endpoint import generator_named
from kiln.frontends.openai.generation_request import (
    GenerationRequest,
    chat_request,
    completion_request,
)
from kiln.frontends.openai.protocol import (
    MAX_CHARS_PER_TOKEN,
    OpenAIError,
    check_prompt_chars,
    detokenize_ids,
    flag,
)
from kiln.frontends.openai.reasoning import ReasoningParser
from kiln.llm.engine_client import EngineClient
from kiln.llm.params import InvalidField, with_defaults
from kiln.llm.sequence import SamplingParams
from kiln.server.server import Server


def detokenized(llm: EngineClient, body: dict[str, Any]) -> str:
    """As vLLM's ``/detokenize``: the text of every token, special ones included."""
    return llm.tokenizer.decode(detokenize_ids(body, llm.vocab_size), False)


def precheck_prompt(llm: EngineClient | None, body: dict[str, Any]) -> None:
    """Refuse a completion prompt that cannot fit the model's context from its size alone,
    before the work in proportion to it (checking each token id, tokenizing)."""
    raw = body.get("prompt")
    if llm is None or not isinstance(raw, str | list):
        return  # completion_request names the field
    limit = llm.max_model_len
    prompts = raw if isinstance(raw, list) and raw and isinstance(raw[0], str | list) else [raw]
    truncating = body.get("truncate_prompt_tokens") is not None
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), limit, "prompt")
        elif isinstance(prompt, list) and not truncating and len(prompt) >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, the prompt "
                f"has {len(prompt)} tokens, leaving no room to generate. Please reduce the "
                "prompt.",
                param="prompt",
                code="context_length_exceeded",
            )


def chat_prompt(llm: EngineClient, messages: list[dict[str, Any]], template: dict[str, Any]) -> str:
    chars = sum(len(content_text(m["content"])) for m in messages)
    check_prompt_chars(chars, llm.max_model_len, "messages")
    kwargs = with_server_kwargs(llm, template)  # a request's untrusted template: refused
    prompt = llm.tokenizer.apply_chat_template(for_template(llm, messages, template), **kwargs)
    # the template adds what the messages' count missed (tools, documents, its variables):
    # the rendered text is checked too, before the tokenizer's work in proportion to it
    check_prompt_chars(len(prompt), llm.max_model_len, "messages")
    return prompt


def with_model_defaults(body: dict[str, Any], llm: EngineClient | None) -> dict[str, Any]:
    """The body with the serving version's generation_config.json defaults filled in (not
    for beam search, which ranks by the model's logprobs alone: its penalties would be
    refused as the client's)."""
    if llm is None or body.get("use_beam_search") is True:
        return body
    return with_defaults(body, llm.sampling_defaults)


def _prompt_ids(
    llm: EngineClient, req: GenerationRequest, prompt: str | list[int], bos: bool
) -> list[int]:
    """``bos``: the tokenizer's special tokens (BOS) are added to a text prompt (vLLM's
    ``add_special_tokens``)."""
    vocab = llm.vocab_size
    if isinstance(prompt, list):
        ids = prompt
        if any(not 0 <= t < vocab for t in ids):
            raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    else:
        ids = llm.tokenizer.encode(prompt, add_special_tokens=bos)
    keep = req.truncate_prompt_tokens
    if keep is not None:
        limit = llm.max_model_len
        keep = limit if keep == -1 else keep
        if keep > limit:
            raise OpenAIError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({limit})",
                param="truncate_prompt_tokens",
            )
        ids = ids[-keep:]  # vLLM keeps the prompt's end: the text right before the answer
    return ids


def _check_bad_words(llm: EngineClient, words: tuple[str, ...]) -> None:
    """``bad_words`` are tokenized like a prompt: their text together is bounded as a
    prompt's is (longer, no output could hold them), before the tokenizer's work."""
    chars = sum(len(w) for w in words)
    limit = llm.max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise OpenAIError(
            f"'bad_words' hold {chars} characters, more than {limit} ({MAX_CHARS_PER_TOKEN} "
            f"per token of the model's context, {llm.max_model_len}): no output could hold them",
            param="bad_words",
        )


def prepare(
    llm: EngineClient, req: GenerationRequest, default_max: int | None, chat: bool = False
) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt's token ids and sampling parameters, the request's checks done. On a
    worker thread: tokenizing takes time in proportion to the prompt, which must not stall
    the event loop."""
    if len(req.prompts) > llm.max_queued:
        raise OpenAIError(
            f"'prompt' holds {len(req.prompts)} prompts, more than the model queues at once "
            f"({llm.max_queued})",
            param="prompt",
        )
    _check_bad_words(llm, req.bad_words)
    bad_words = llm.tokenizer.bad_words_ids(req.bad_words) if req.bad_words else ()
    checks: tuple[tuple[str, Callable[[], object]], ...] = (
        ("n", lambda: llm.check_n(req.params.n)),
        ("priority", lambda: llm.check_priority(req.priority)),
    )
    for param, check in checks:
        try:
            check()
        except KilnError as exc:
            raise OpenAIError(str(exc), param=param) from None
    if req.beam_search:
        _check_beam_search(llm, req)
    prepared = []
    for prompt in req.prompts:
        ids = _prompt_ids(llm, req, prompt, bos=req.add_special_tokens)
        limit = llm.max_model_len
        room = limit - len(ids)
        max_tokens = req.max_tokens or (min(default_max, room) if default_max else room)
        if max_tokens > room and room > 0:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if llm.max_new_tokens:  # generation_config.json's bound, as vLLM applies it
            max_tokens = min(max_tokens, llm.max_new_tokens)
        params = replace(req.params, max_tokens=max(max_tokens, 1), bad_words_token_ids=bad_words)
        try:
            llm.check_request(len(ids), params, req.priority)  # compiles a grammar too
        except InvalidField as exc:
            # chat asks for alternatives with top_logprobs (logprobs is its switch)
            field = "top_logprobs" if chat and exc.field == "logprobs" else exc.field
            raise OpenAIError(str(exc), param=field) from None
        except KilnError as exc:
            raise OpenAIError(str(exc), param="prompt", code="context_length_exceeded") from None
        prepared.append((ids, params))
    return prepared


def server_defaults(llm: EngineClient, req: GenerationRequest, body: dict[str, Any]) -> None:
    """vLLM's server flags over a request: ``--enable-force-include-usage`` (a stream's
    last chunk carries ``usage`` whatever its ``stream_options``) and
    ``--return-tokens-as-token-ids`` (the default of the request's field)."""
    if llm.force_include_usage and req.stream:
        req.include_usage = True
    if body.get("return_tokens_as_token_ids") is None and llm.return_tokens_as_token_ids:
        req.return_tokens_as_token_ids = True


def _check_beam_search(llm: EngineClient, req: GenerationRequest) -> None:
    """What beam search cannot run with, refused before anything is queued: each step asks
    the engine for 2 x ``n`` logprobs a beam (bounded by the model's ``max_logprobs``); each
    step's requests hold their whole sequence, so without the prefix cache a search would
    recompute every beam from its prompt's start at every step (its work growing with the
    square of its length: one request could hold the engine); and a grammar constrains
    sampling, not the logprobs beams are ranked by."""
    if not llm.engine.config.enable_prefix_caching:
        raise OpenAIError(
            "beam search needs the prefix cache, which this model runs without "
            "(--enable-prefix-caching)",
            param="use_beam_search",
        )
    n = req.params.n
    limit = llm.engine.config.max_logprobs
    if limit != -1 and 2 * n > limit:
        raise OpenAIError(
            f"beam search with n = {n} ranks {2 * n} candidates a beam each step, more than "
            f"this model's max_logprobs ({limit}): ask for at most {limit // 2} beams",
            param="n",
        )
    if req.params.structured_outputs is not None:
        raise OpenAIError(
            "beam search does not run with structured outputs (response_format, "
            "structured_outputs, guided_*, or a tool_choice that forces a call)",
            param="use_beam_search",
        )


def tokenized(llm: EngineClient, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered as chat renders
    them. On a worker thread (the template and the tokenizer work in proportion)."""
    limit = llm.max_model_len
    pieces = flag(body, "return_token_strs", False)
    if "messages" in body:
        template = chat_template_options(body)
        listed = tools.check_tools(body)
        if listed:  # as chat renders them (vLLM's /tokenize takes tools too)
            template["template_kwargs"] = {"tools": listed, **template["template_kwargs"]}
        messages = tools.template_messages(chat_messages(body))
        text = chat_prompt(llm, messages, template)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIError("'prompt' (a string) or 'messages' is required", param="prompt")
        check_prompt_chars(len(prompt), limit, "prompt")
        text = prompt
    # vLLM's default: BOS for a prompt, none on top of a chat template's own
    ids = llm.tokenizer.encode(text, flag(body, "add_special_tokens", "messages" not in body))
    return {
        "count": len(ids),
        "max_model_len": limit,
        "tokens": ids,
        "token_strs": llm.tokenizer.token_pieces(ids) if pieces else None,
    }


def thinking_markers(llm: EngineClient, req: GenerationRequest) -> None:
    """With vLLM's ``thinking_token_budget``: the reasoning parser's markers, which the
    engine counts between and forces the end of (without a parser the engine refuses the
    budget, as vLLM does without its reasoning config)."""
    if req.params.thinking_token_budget is None or llm.reasoning_parser is None:
        return
    encode = llm.tokenizer.encode
    parser = ReasoningParser(llm.reasoning_parser)
    start, end = (tuple(encode(text, False)) for text in (parser.start, parser.end))
    req.params = replace(req.params, reasoning_start=start, reasoning_end=end)


async def chat_setup(
    server: Server, body: dict[str, Any], api: str, drawn: EngineClient | None = None
) -> tuple[EngineClient, GenerationRequest, list[tuple[list[int], SamplingParams]]]:
    """A chat completions body, checked, rendered by the chat template and tokenized: the
    model's engine (``drawn``: the one already drawn for the request), the request and
    each prompt's token ids and parameters."""
    messages = chat_messages(body)
    template = chat_template_options(body)
    model = body.get("model")
    # drawn once (a rollout split): the version whose template renders the prompt
    # is the version that generates
    llm = drawn or (generator_named(server, model, api, body) if isinstance(model, str) else None)
    calling = tools.tool_request(body, llm, api) if llm else None
    messages = tools.template_messages(messages)
    # vLLM's --exclude-tools-when-tool-choice-none: tool_choice none renders no tools
    exclude = llm is not None and llm.exclude_tools_when_tool_choice_none
    if calling is not None and not (exclude and calling.choice == "none"):
        # transformers' ``tools=`` (the request's kwargs win)
        template["template_kwargs"] = {"tools": calling.tools, **template["template_kwargs"]}
    # the template renders in proportion to the messages: off the event loop too
    prompt = await asyncio.to_thread(chat_prompt, llm, messages, template) if llm else ""
    role = llm.response_role if llm is not None else "assistant"
    req = chat_request(with_model_defaults(body, llm), messages, prompt, template, role)
    tools.apply(req, calling)
    if llm is None:  # chat_request refused a 'model' that is not a string
        llm = generator_named(server, req.model, api, body)
    server_defaults(llm, req, body)
    thinking_markers(llm, req)
    if llm.reasoning_parser is not None:
        req.reasoning = ReasoningParser(llm.reasoning_parser)
        if llm.reasoning_parser in reasoning.SPECIAL_MARKERS:
            req.skip_special_tokens = False  # the markers are control tokens
        if req.params.structured_outputs is not None:
            # vLLM's rule: the model thinks freely, the constraint holds after </think>
            end = tuple(llm.tokenizer.encode(req.reasoning.end))
            req.params = replace(req.params, reasoning_end=end)
    prepared = await asyncio.to_thread(prepare, llm, req, None, True)
    return llm, req, prepared


async def completion_setup(
    server: Server, body: dict[str, Any]
) -> tuple[EngineClient, GenerationRequest, list[tuple[list[int], SamplingParams]]]:
    """A completions body, checked and tokenized: the model's engine, the request and each
    prompt's token ids and parameters (``/v1/completions`` and its ``/render``)."""
    model = body.get("model")
    drawn = generator_named(server, model, "Completions", body) if isinstance(model, str) else None
    req = completion_request(with_model_defaults(body, drawn))
    precheck_prompt(drawn, body)
    llm = drawn or generator_named(server, req.model, "Completions", body)
    server_defaults(llm, req, body)
    thinking_markers(llm, req)
    # OpenAI's default max_tokens for completions: 16
    prepared = await asyncio.to_thread(prepare, llm, req, 16)
    return llm, req, prepared
