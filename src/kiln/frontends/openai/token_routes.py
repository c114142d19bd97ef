"""vLLM's token routes: ``/tokenize``, ``/detokenize`` and ``GET /tokenizer_info``."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from kiln.frontends.openai.endpoint import BodyReader, json_response, model_for, read_json
from kiln.frontends.openai.preparation import detokenized, tokenized
from kiln.frontends.openai.protocol import TOKENIZE_FIELDS, OpenAIError, check_fields
from kiln.frontends.openai.tokenizer_info import tokenizer_info
from kiln.frontends.openai.tokens_only import no_tokenizer
from kiln.server.server import Server


class TokenRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, self.reader)
        check_fields(body, TOKENIZE_FIELDS, "tokenize")
        llm = model_for(self.server, body)
        return json_response(await asyncio.to_thread(tokenized, llm, body))

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.reader)
        llm = model_for(self.server, body)
        # checked and decoded off the event loop: a body holds millions of ids
        text = await asyncio.to_thread(detokenized, llm, body)
        return json_response({"prompt": text})

    async def get_tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: the models served with
        ``--enable-tokenizer-info-endpoint`` (``?model=`` names one when several are);
        without any, the route is not there (404, as vLLM's)."""
        shown = {
            n: m for n, m in self.server.llm_engines().items() if m.enable_tokenizer_info_endpoint
        }
        if not shown:
            return json_response({"detail": "Not Found"}, 404)
        if self.server.options.tokens_only:
            raise no_tokenizer()  # vLLM's --tokens-only loads no tokenizer to show
        name = request.query_params.get("model")
        if name is None:
            if len(shown) > 1:
                raise OpenAIError(
                    f"'model' is required: {len(shown)} models serve /tokenizer_info "
                    "(GET /tokenizer_info?model=NAME)",
                    param="model",
                )
            llm = next(iter(shown.values()))
        elif name in shown:
            llm = shown[name]
        else:
            raise OpenAIError(
                f"The model '{name[:200]}' does not exist or is not served with "
                "--enable-tokenizer-info-endpoint",
                404,
                param="model",
                code="model_not_found",
            )
        return json_response(tokenizer_info(llm.tokenizer))
