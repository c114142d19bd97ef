"""The routes that pool or score: OpenAI's embeddings, Cohere's embed, vLLM's pooling,
classify, score and rerank, and vLLM's generative scoring (a generating model's logprobs of
label tokens)."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import Response

from kiln.core.errors import KilnError
from kiln.core.trace import http_slot
from kiln.frontends.openai import classify as classifier
from kiln.frontends.openai import cohere, embeddings, generative_scoring, scores
from kiln.frontends.openai.endpoint import (
    BodyReader,
    engine_named,
    generator_named,
    json_response,
    model_for,
    read_json,
    received,
)
from kiln.frontends.openai.generation import merged, run
from kiln.frontends.openai.protocol import OpenAIError, check_fields
from kiln.frontends.openai.request_ids import request_id
from kiln.llm.sequence import SamplingParams
from kiln.server.server import Server


class PoolingRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader

    async def embed(self, request: Request, pooling: bool = False) -> Response:
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        req = embeddings.embedding_request(body, pooling)
        llm = engine_named(self.server, req.model)
        if llm.lora_request is not None:
            raise OpenAIError("LoRA adapters serve generation, not embeddings", param="model")
        token_classifier = llm.engine.args.is_token_classifier
        if req.task == "token_classify" or (pooling and not req.task and token_classifier):
            classifier.check_token_classifier(llm, req)  # vLLM's /pooling of a token classifier
            prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
            embeddings.check_token_values(llm, prompts, "token_classify")
            rows = await llm.pool(prompts, req.priority, tokens=True)
            tokens = sum(len(p) for p in prompts)
            raw = await asyncio.to_thread(classifier.token_pooling_body, llm, req, rows, tokens)
            return Response(raw, media_type="application/json")
        if req.task == "classify" or (pooling and not req.task and llm.engine.args.num_labels):
            classifier.check_model(llm, req)  # vLLM's /pooling of a classifier
            prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
            logits = await llm.pool(prompts, req.priority)
            tokens = sum(len(p) for p in prompts)
            return json_response(classifier.pooling_body(llm, req, logits, tokens))
        embeddings.check_model(llm, req)
        prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
        every = req.task == "token_embed"
        if every:
            embeddings.check_token_values(llm, prompts, "token_embed")
        vectors = await llm.pool(prompts, req.priority, every)
        tokens = sum(len(p) for p in prompts)
        raw = await asyncio.to_thread(embeddings.response_body, llm, req, vectors, tokens)
        return Response(raw, media_type="application/json")

    async def cohere_embed(self, request: Request) -> Response:
        """Cohere's ``POST /v2/embed``, as vLLM serves it (``cohere.py``)."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        check_fields(body, cohere.FIELDS, "Cohere embed")
        req = cohere.read(body)
        llm = model_for(self.server, {"model": req.model} if req.model else {})
        name = req.model or next(n for n, e in self.server.llm_engines().items() if e is llm)
        embed = cohere.embedding_request(llm, req, name)
        embeddings.check_model(llm, embed)
        prompts = await asyncio.to_thread(embeddings.token_ids, llm, embed)
        cohere.check_lengths(req, prompts)
        vectors = await llm.pool(prompts, embed.priority)
        tokens = sum(len(p) for p in prompts)
        raw = await asyncio.to_thread(cohere.answer, llm, req, embed, vectors, tokens)
        return Response(raw, media_type="application/json")

    async def pool(self, request: Request) -> Response:
        """vLLM's ``/pooling``: an embeddings request, answered in the pooling shape."""
        return await self.embed(request, pooling=True)

    async def _scored(self, request: Request, rerank: bool) -> Response:
        """vLLM's score (pairs of texts) or rerank (a query, documents) on a pooling model:
        every text embedded in one pooling call, each pair scored by its cosine."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        req = scores.rerank_request(body) if rerank else scores.score_request(body)
        llm = engine_named(self.server, req.model)
        if llm.lora_request is not None:
            raise OpenAIError("LoRA adapters serve generation, not scores", param="model")
        scores.check_model(llm, req, "Rerank" if rerank else "Score")
        if llm.engine.args.num_labels:  # a cross-encoder: each pair one input
            pairs = await asyncio.to_thread(scores.pair_ids, llm, req)
            values = scores.cross_scores(await llm.pool(pairs, req.priority))
            tokens = sum(len(p) for p in pairs)
        else:
            left, right = await asyncio.to_thread(scores.token_ids, llm, req)
            vectors = await llm.pool(left + right, req.priority)
            values = scores.cosines(vectors, len(left))
            tokens = scores.pair_tokens(left, right)
        answer = scores.rerank_body if rerank else scores.score_body
        return json_response(answer(req, values, tokens))

    async def classify(self, request: Request) -> Response:
        """vLLM's ``/classify``: a sequence classifier's class probabilities per input."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        req, activation = classifier.classify_request(body)
        llm = engine_named(self.server, req.model)
        if llm.lora_request is not None:
            raise OpenAIError("LoRA adapters serve generation, not classification", param="model")
        classifier.check_model(llm, req)
        prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
        logits = await llm.pool(prompts, req.priority)
        tokens = sum(len(p) for p in prompts)
        return json_response(classifier.response_body(llm, req, logits, tokens, activation))

    async def score(self, request: Request) -> Response:
        return await self._scored(request, rerank=False)

    async def rerank(self, request: Request) -> Response:
        return await self._scored(request, rerank=True)

    async def score_generatively(self, request: Request) -> Response:
        """vLLM's ``POST /generative_scoring`` (``generative_scoring.py``)."""
        body = await read_json(request, self.reader)
        check_fields(body, generative_scoring.FIELDS, "generative scoring")
        req = generative_scoring.read(body)
        llm = generator_named(self.server, req.model, "Generative Scoring", body)
        embeddings.check_queue(llm, req.priority, len(req.items), "{} items", "items")
        prompts = await asyncio.to_thread(generative_scoring.prompts, llm, req)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=0,
            logprob_token_ids=tuple(req.labels),
            cache_salt=req.cache_salt,
        )
        rid = f"generative-scoring-{request_id(req.request_id)}"
        logprobs: list[list[float]] = [[] for _ in prompts]
        completion = 0
        streams = [run(llm, ids, params, (), req.priority, rid) for ids in prompts]
        try:
            async with contextlib.aclosing(merged(streams, 1)) as deltas:
                async for d in deltas:
                    for entry in d.logprobs:  # the one token's: the sampled one, the labels
                        listed = dict(entry.top)
                        logprobs[d.index] = [listed[t] for t in req.labels]
                    if d.finish_reason is not None:
                        completion += d.completion_tokens
        except KilnError as exc:
            raise OpenAIError.from_kiln(exc) from None
        scores = [generative_scoring.score(lps, req.apply_softmax) for lps in logprobs]
        prompt_tokens = sum(len(ids) for ids in prompts)
        return json_response(
            generative_scoring.body(rid, req.model, scores, prompt_tokens, completion)
        )
