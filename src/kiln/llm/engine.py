"""The synchronous engine: admit requests, run steps, report new tokens per request."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kiln.core.errors import KilnError, Status
from kiln.llm.block_manager import BlockManager
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.model_runner import ModelRunner
from kiln.llm.sampler import TokenLogprobs
from kiln.llm.scheduler import Scheduler
from kiln.llm.sequence import SamplingParams, Sequence


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: one entry per new token when the request asked for logprobs
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    #: the most tokens one step ran (the budget bounds it)
    max_step_tokens: int = 0


class LLMEngine:
    def __init__(self, folder: Path, config: EngineConfig | None = None) -> None:
        config = replace(config) if config is not None else EngineConfig()
        config.check()
        self.args = ModelArgs.load(folder)
        config.max_model_len = config.max_model_len or self.args.max_position_embeddings
        self.runner = ModelRunner(folder, self.args, config)
        # A sequence alone must always fit in the cache, or preemption could never help it.
        config.max_model_len = min(config.max_model_len, self.runner.num_blocks * config.block_size)
        self.config = config
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.stats = EngineStats()

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse what can never be served, before it takes a place in the queue."""
        limit = self.config.max_model_len
        if prompt_len == 0:
            raise KilnError("the prompt is empty", Status.INVALID_ARG)
        if prompt_len >= limit:
            raise KilnError(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens, leaving no room to generate",
                Status.INVALID_ARG,
            )
        if params.max_tokens <= 0:
            raise KilnError(
                f"max_tokens must be at least 1, got {params.max_tokens}", Status.INVALID_ARG
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        self.check_request(len(prompt_token_ids), params)
        vocab = self.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise KilnError(f"prompt token ids must be in [0, {vocab})", Status.INVALID_ARG)
        seq = Sequence(request_id, list(prompt_token_ids), params, self.args.eos_token_ids)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.seqs:
            return []
        sampled = self.runner.run(out)
        self.stats.num_steps += 1
        self.stats.max_step_tokens = max(self.stats.max_step_tokens, out.total_tokens)
        results: list[RequestOutput] = []
        for seq, n, sampled_token in zip(out.seqs, out.num_new_tokens, sampled, strict=True):
            seq.num_computed_tokens += n
            if sampled_token is None:
                continue  # a prompt chunk: nothing to report yet
            token = sampled_token.token_id
            if seq.num_output_tokens == 0:
                self.stats.num_prompt_tokens += seq.num_prompt_tokens
            seq.append(token)
            self.stats.num_generation_tokens += 1
            if not seq.is_finished and seq.num_tokens >= self.config.max_model_len:
                seq.finish("length")
            results.append(
                RequestOutput(
                    seq.request_id,
                    [token],
                    seq.is_finished,
                    seq.finish_reason,
                    seq.num_prompt_tokens,
                    seq.num_output_tokens,
                    None if sampled_token.logprobs is None else [sampled_token.logprobs],
                )
            )
        self.scheduler.remove_finished()
        return results

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (tests, offline use); output token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work():
            for result in self.step():
                outputs[result.request_id].extend(result.new_token_ids)
        return [outputs[rid] for rid in ids]
