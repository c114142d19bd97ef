"""vLLM's ``--tokens-only`` (its Disaggregated Everything server) on the OpenAI routes.

vLLM sets ``skip_tokenizer_init`` with it: the server holds no tokenizer, so a request
whose input is text, or whose answer needs text, fails with a 400 in the renderer's words,
while token ids in and token ids out run. kiln keeps its tokenizer loaded inside (the
engine's EOS and stop tokens, the scale-out checks) and answers as vLLM's server does:

- text in (a chat, Messages or Responses body, a completions text prompt, ``/tokenize``,
  ``/detokenize``, the text derender and pooling routes): 400 :data:`NO_TOKENIZER`;
- ``/v1/completions`` of token ids runs undetokenized (each choice's ``text`` is ""); a
  stop string, ``echo``, logprobs by token text and structured outputs need the tokenizer
  and are refused, each naming its field;
- ``/inference/v1/generate`` never detokenizes (vLLM's ``force_no_detokenize``): stop
  strings and ``output_mode: "text"`` are refused in vLLM's words.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.frontends.openai.endpoint import BodyReader, Handler, read_json
from kiln.frontends.openai.generation_request import GenerationRequest
from kiln.frontends.openai.protocol import OpenAIError
from kiln.server.server import Server

#: vLLM's renderer, asked for its tokenizer under ``skip_tokenizer_init``
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"
#: vLLM's, for a token's text in logprobs without a tokenizer
NO_TOKEN_TEXT = "Unable to get tokenizer because `skip_tokenizer_init=True`"
#: vLLM's sampling-params check, for structured outputs without a tokenizer
NO_GRAMMAR = (
    "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
)
#: vLLM's token-in-token-out server, on stop strings with --tokens-only
NO_STOP = (
    "stop strings are not supported on a --tokens-only server because detokenization is "
    "disabled. Check stop strings on the coordinator, or use stop_token_ids."
)


def no_tokenizer(message: str = NO_TOKENIZER, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, param=param, type_="BadRequestError")


def has_text(value: Any) -> bool:
    """A prompt or input holds text: a string, or a list holding one (token ids are ints,
    or lists of ints)."""
    return isinstance(value, str) or (
        isinstance(value, list) and any(isinstance(v, str) for v in value)
    )


def check_body(kind: str, body: dict[str, Any]) -> None:
    """A route's body on a --tokens-only server. ``kind``: ``text`` (the route needs the
    tokenizer whatever it is sent), ``prompt`` (completions: a text ``prompt``), ``input``
    (embeddings, pooling, classify: a text ``input``)."""
    if kind == "text" or (kind in ("prompt", "input") and has_text(body.get(kind))):
        raise no_tokenizer()


def gated(server: Server, reader: BodyReader, kind: str, handler: Handler) -> Handler:
    """``handler`` with :func:`check_body` before it, when --tokens-only is on."""

    async def checked(request: Request) -> Response:
        if server.options.tokens_only:
            body = await read_json(request, reader)
            request.state.openai_body = body  # the handler reads it again from here
            check_body(kind, body)
        return await handler(request)

    return checked


def invocation_kind(body: dict[str, Any]) -> str:
    """The :func:`check_body` kind of the route ``/invocations`` picks for ``body``."""
    if "messages" in body:
        return "text"
    if "prompt" in body:
        return "prompt"
    if "input" in body:
        return "input"
    return "text"  # score and rerank: text pairs


def check_completion(req: GenerationRequest) -> None:
    """A completions request of token ids, run undetokenized: what would need the text."""
    if req.stop:
        raise no_tokenizer(NO_STOP, "stop")
    if req.echo:
        raise no_tokenizer(param="echo")
    if req.params.logprobs is not None and not req.return_tokens_as_token_ids:
        raise no_tokenizer(NO_TOKEN_TEXT, "logprobs")
    if req.params.structured_outputs is not None:
        raise no_tokenizer(NO_GRAMMAR, "structured_outputs")
    if req.beam_search:
        raise no_tokenizer(param="use_beam_search")  # beams end on stop strings, by text
    if req.bad_words:
        raise no_tokenizer(param="bad_words")  # words are tokenized


def check_generate(body: dict[str, Any]) -> None:
    """vLLM's ``force_no_detokenize`` on a GenerateRequest: its two refusals."""
    params = body.get("sampling_params")
    if isinstance(params, dict) and params.get("stop"):
        raise no_tokenizer(NO_STOP, "sampling_params.stop")
    mode = body.get("output_mode", "tokens")
    if mode is not None and mode != "tokens":
        raise no_tokenizer(
            f"output_mode={mode!r:.100} requires a tokenizer, but this server does not load "
            "one (--tokens-only or --skip-tokenizer-init). Send the request to a server that "
            "loads a tokenizer, or use output_mode='tokens'.",
            "output_mode",
        )
