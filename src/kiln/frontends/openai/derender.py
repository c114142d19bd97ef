"""vLLM's derender routes (its scale-out API): the token ids that ``/inference/v1/generate``
answered, back in the answer's OpenAI shape (a chat completion, a text completion), as
the model's own chat and completions routes would have answered them: whole, or (``stream:
true``) one streamed chunk per call, the client carrying the decoding state between calls
(``derender_stream``, which holds the routes)."""

from __future__ import annotations

import time
from typing import Any

from kiln.frontends.openai.derender_parse import chat_parsing, original
from kiln.frontends.openai.logprobs import CompletionLogprobs, chat_logprobs
from kiln.frontends.openai.protocol import OpenAIError, flag
from kiln.llm.engine_client import EngineClient
from kiln.llm.sampler import TokenLogprobs
from kiln.llm.tokenizer import IncrementalDetokenizer

#: choices of one generate response, and responses of one completions derender
MAX_CHOICES = 1024
#: top alternatives of one token's logprobs (kiln's and OpenAI's bound on a request's)
MAX_TOP_LOGPROBS = 20


def token_ids(value: Any, where: str, vocab: int, limit: int, empty: bool = False) -> list[int]:
    """Token ids of the vocabulary, counted against the context before each is read."""
    if not isinstance(value, list) or (not value and not empty):
        raise OpenAIError(f"'{where}' must be a non-empty list of token ids", param=where)
    if len(value) > limit:
        raise OpenAIError(
            f"'{where}' holds {len(value)} tokens, more than the model's context ({limit})",
            param=where,
        )
    if not all(type(t) is int and 0 <= t < vocab for t in value):
        raise OpenAIError(f"'{where}' must hold token ids in [0, {vocab})", param=where)
    return value


def _entries(value: Any, where: str, vocab: int, limit: int) -> list[TokenLogprobs] | None:
    """A choice's ``logprobs`` (vLLM's ``GenerateLogProbs``) as kiln's entries."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) else None
    if not isinstance(content, list) or len(content) > limit:
        raise OpenAIError(
            f"'{where}.content' must be a list of at most {limit} tokens", param=where
        )
    out = []
    for e in content:
        top = e.get("top_logprobs", []) if isinstance(e, dict) else None
        if not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS + 1:
            raise OpenAIError(
                f"'{where}' entries must be objects with at most {MAX_TOP_LOGPROBS + 1} "
                "top_logprobs",
                param=where,
            )
        pairs = [_pair(t, where, vocab) for t in (e, *top)]
        (token, logprob), rest = pairs[0], pairs[1:]
        out.append(TokenLogprobs(token, logprob, tuple(p for p in rest if p[0] != token)))
    return out


def _pair(e: Any, where: str, vocab: int) -> tuple[int, float]:
    token = e.get("token_id") if isinstance(e, dict) else None
    logprob = e.get("logprob") if isinstance(e, dict) else None
    if type(token) is not int or not 0 <= token < vocab:
        raise OpenAIError(f"'{where}': token_id must be a token id in [0, {vocab})", param=where)
    if not isinstance(logprob, int | float) or isinstance(logprob, bool):
        raise OpenAIError(f"'{where}': logprob must be a number", param=where)
    return token, float(logprob)


def choices_of(
    llm: EngineClient, response: Any, where: str, chunk: bool = False
) -> list[dict[str, Any]]:
    """A generate response's choices: index, token ids, logprobs, finish and stop reason."""
    if not isinstance(response, dict):
        raise OpenAIError(f"'{where}' must be a generate response object", param=where)
    if response.get("output_mode", "tokens") != "tokens":
        raise OpenAIError(
            f"'{where}.output_mode' must be 'tokens': a text response is already derendered",
            param=f"{where}.output_mode",
        )
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) > MAX_CHOICES:
        raise OpenAIError(
            f"'{where}.choices' must be a list of at most {MAX_CHOICES} choices",
            param=f"{where}.choices",
        )
    vocab, limit = llm.vocab_size, llm.max_model_len
    out = []
    for i, c in enumerate(choices):
        at = f"{where}.choices[{i}]"
        if not isinstance(c, dict):
            raise OpenAIError(f"'{at}' must be an object", param=at)
        index = c.get("index", i)
        reason, stop = c.get("finish_reason", None if chunk else "stop"), c.get("stop_reason")
        if type(index) is not int or not 0 <= index < MAX_CHOICES:
            raise OpenAIError(f"'{at}.index' must be an integer in [0, {MAX_CHOICES})", param=at)
        if not (reason is None or (isinstance(reason, str) and len(reason) <= 64)):
            raise OpenAIError(f"'{at}.finish_reason' must be a short string", param=at)
        if stop is not None and type(stop) is not int and not isinstance(stop, str):
            raise OpenAIError(f"'{at}.stop_reason' must be a string or a token id", param=at)
        out.append(
            {
                "index": index,
                "token_ids": token_ids(
                    c.get("token_ids") or ([] if chunk else None),
                    f"{at}.token_ids",
                    vocab,
                    limit,
                    empty=chunk,
                ),
                "logprobs": _entries(c.get("logprobs"), f"{at}.logprobs", vocab, limit),
                "finish_reason": reason,
                "stop_reason": stop,
            }
        )
    return out


def prompt_tokens(value: Any, where: str) -> int:
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value < 1 << 40:
        raise OpenAIError(f"'{where}' must be a token count", param=where)
    return value


def prompt_ids(
    llm: EngineClient, given: Any, response: dict[str, Any], where: str, own: str
) -> list[int]:
    """The prompt's token ids an output is decoded after (vLLM's seed): the derender
    request's (``where``), else the generate response's own (``own``: generate's
    ``prompt_token_ids``, with ``return_token_ids``), else none."""
    vocab, limit = llm.vocab_size, llm.max_model_len
    if given is not None:
        return token_ids(given, where, vocab, limit, empty=True)
    carried = response.get("prompt_token_ids")
    if carried is not None:
        return token_ids(carried, own, vocab, limit, empty=True)
    return []


def decoded(llm: EngineClient, ids: list[int], skip: bool, prompt: list[int]) -> str:
    """A whole output's text, decoded in its prompt's context as chat and completions
    decode their own (the prompt's last tokens seed the window)."""
    return IncrementalDetokenizer(llm.tokenizer, skip, prompt).add(ids, final=True)


def derender_chat(llm: EngineClient, body: dict[str, Any], model: str) -> dict[str, Any]:
    """vLLM's ``ChatCompletionResponse`` of a generate response: its text read by the
    request's tool parser and the model's reasoning parser, as chat reads its own answer.
    On a worker thread."""
    parsing = chat_parsing(llm, body, stream=False)
    response = body.get("generate_response")
    parsed = choices_of(llm, response, "generate_response")
    assert isinstance(response, dict)
    seed = prompt_ids(llm, body.get("prompt_token_ids"), response, "prompt_token_ids",
                      "generate_response.prompt_token_ids")  # fmt: skip
    choices = []
    for c in parsed:
        text = decoded(llm, c["token_ids"], parsing.skip_special_tokens, seed)
        message, reason = parsing.message(text, c["finish_reason"])
        entries = c["logprobs"]
        choices.append(
            {
                "index": c["index"],
                "message": message,
                "logprobs": None if entries is None else chat_logprobs(llm.tokenizer, entries),
                "finish_reason": reason,
                "stop_reason": c["stop_reason"],
            }
        )
    prompt = prompt_tokens(body.get("prompt_tokens"), "prompt_tokens")
    completion = sum(len(c["token_ids"]) for c in parsed)
    return {
        "id": str(response.get("request_id", ""))[:1024],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt, completion),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def derender_completion(llm: EngineClient, body: dict[str, Any], model: str) -> dict[str, Any]:
    """vLLM's ``CompletionResponse`` of generate responses (one per rendered prompt),
    choices numbered in order across them. On a worker thread."""
    skip = flag(original(body, "completion_request"), "skip_special_tokens", True)
    responses = body.get("generate_responses")
    if not isinstance(responses, list) or not responses or len(responses) > MAX_CHOICES:
        raise OpenAIError(
            f"'generate_responses' must be a list of 1 to {MAX_CHOICES} generate responses",
            param="generate_responses",
        )
    counts = body.get("prompt_tokens")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(responses)):
        raise OpenAIError(
            "'prompt_tokens' must hold one count per generate response", param="prompt_tokens"
        )
    seeds = body.get("prompt_token_ids")
    if seeds is not None and (not isinstance(seeds, list) or len(seeds) != len(responses)):
        raise OpenAIError(
            "'prompt_token_ids' must hold one list per generate response",
            param="prompt_token_ids",
        )
    for i, ids in enumerate(seeds or ()):  # all counted before any output is decoded
        if ids is not None:
            token_ids(ids, f"prompt_token_ids[{i}]", llm.vocab_size, llm.max_model_len, empty=True)
    choices: list[dict[str, Any]] = []
    prompt = completion = 0
    for r, response in enumerate(responses):
        where = f"generate_responses[{r}]"
        parsed = choices_of(llm, response, where)
        given = None if seeds is None else seeds[r]
        seed = prompt_ids(llm, given, response, f"prompt_token_ids[{r}]",
                          f"{where}.prompt_token_ids")  # fmt: skip
        for c in parsed:
            entries = c["logprobs"]
            choices.append(
                {
                    "index": len(choices),
                    "text": decoded(llm, c["token_ids"], skip, seed),
                    "logprobs": None
                    if entries is None
                    else CompletionLogprobs(llm.tokenizer)(entries),
                    "finish_reason": c["finish_reason"],
                    "stop_reason": c["stop_reason"],
                    "prompt_logprobs": None,
                }
            )
            completion += len(c["token_ids"])
        if counts is not None:
            prompt += prompt_tokens(counts[r], f"prompt_tokens[{r}]")
    first = responses[0]
    return {
        "id": str(first.get("request_id", ""))[:1024] if isinstance(first, dict) else "",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt, completion),
        "kv_transfer_params": None,
    }


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }
