"""What a generation request may ask of an engine, checked before it takes a place in the
queue: ``LLMEngine``'s and the engine process's ``EngineView``'s (the server checks there,
the engine again when the request arrives)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.core.errors import KilnError, Status
from kiln.llm.params import INT64_MAX, INT64_MIN, InvalidField

if TYPE_CHECKING:
    from kiln.llm.config import EngineConfig, ModelArgs
    from kiln.llm.lora import LoRARequest
    from kiln.llm.sequence import SamplingParams
    from kiln.llm.structured import GrammarCompiler


class RequestChecks:
    """The checks; the engine supplies its arguments, settings and grammar compiler."""

    args: ModelArgs
    config: EngineConfig
    grammars: GrammarCompiler | None

    def check_request(
        self,
        prompt_len: int,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Refuse what can never be served, before it takes a place in the queue."""
        if self.args.num_labels:
            raise KilnError(
                f"{self.args.architecture.removesuffix('ForCausalLM')} sequence classifier: it "
                "classifies (/classify) and does not generate",
                Status.INVALID_ARG,
            )
        if self.args.is_encoder:
            raise KilnError(
                f"{self.args.architecture} is an encoder: it embeds (/v1/embeddings) and "
                "does not generate",
                Status.INVALID_ARG,
            )
        if lora_request is not None and self.config.lora_config is None:
            raise InvalidField(
                "model", f"LoRA adapter '{lora_request.lora_name}': LoRA is not enabled "
                "for this model (--enable-lora)",
            )  # fmt: skip
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
        self.check_n(params.n)
        self.check_priority(priority)
        vocab = self.args.vocab_size
        # Checked here, before the request joins a batch: a value the step's tensors cannot
        # take would fail the step, and with it every request the step holds.
        outside = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if outside:
            raise InvalidField(
                "logit_bias",
                f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})",
            )
        outside = [t for t in params.allowed_token_ids if not 0 <= t < vocab]
        if outside:
            raise InvalidField(
                "allowed_token_ids",
                f"allowed_token_ids names token id {outside[0]}, outside the vocabulary "
                f"[0, {vocab})",
            )
        outside = [t for t in params.logprob_token_ids if not 0 <= t < vocab]
        if outside:
            raise InvalidField(
                "logprob_token_ids",
                f"logprob_token_ids names token id {outside[0]}, outside the vocabulary "
                f"[0, {vocab})",
            )
        outside = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if outside:
            raise InvalidField(
                "stop_token_ids",
                f"stop_token_ids names token id {outside[0]}, outside the vocabulary [0, {vocab})",
            )
        outside = [t for w in params.bad_words_token_ids for t in w if not 0 <= t < vocab]
        if outside:
            raise InvalidField(
                "bad_words",
                f"bad_words tokenize to token id {outside[0]}, outside the vocabulary [0, {vocab})",
            )
        if params.stream_interval is not None and params.stream_interval < 1:
            raise InvalidField(
                "stream_interval",
                f"stream_interval must be at least 1, got {params.stream_interval}",
            )
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise InvalidField(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens ({params.max_tokens})], "
                f"got {params.min_tokens}",
            )
        most = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for field_, kind, count in (
            ("logprobs", "sample", params.logprobs),
            ("prompt_logprobs", "prompt", params.prompt_logprobs),
        ):
            if count is not None and count > most:  # vLLM's words
                raise InvalidField(
                    field_,
                    f"Requested {kind} logprobs of {count}, which is greater than max allowed: "
                    f"{most} (--max-logprobs)",
                )
            if count is not None and not 0 <= count <= vocab:
                raise InvalidField(
                    field_, f"{field_} must be in [0, {vocab}] (the vocabulary), got {count}"
                )
        seed = params.seed
        if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
            raise InvalidField("seed", f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {seed}")
        spec = params.structured_outputs
        if spec is not None and self.grammars is None:
            raise InvalidField(spec.param, "this model has no tokenizer for structured outputs")
        budget = params.thinking_token_budget
        if budget is not None:
            if budget < 0:
                raise InvalidField(
                    "thinking_token_budget",
                    f"thinking_token_budget must be >= 0 (or -1: unlimited), got {budget}",
                )
            markers = params.reasoning_start + params.reasoning_end
            if not params.reasoning_end or any(not 0 <= t < vocab for t in markers):
                raise InvalidField(
                    "thinking_token_budget",
                    "thinking_token_budget needs the model's reasoning markers: serve it with "
                    "--reasoning-parser",
                )
            if self.config.speculative_config is not None:
                raise InvalidField(
                    "thinking_token_budget",
                    "thinking_token_budget is not supported with speculative decoding",
                )

    def check_n(self, n: int) -> None:
        # the n samples of a request run together: they must fit in one running batch
        if not 1 <= n <= self.config.max_num_seqs:
            raise KilnError(
                f"n must be between 1 and max_num_seqs ({self.config.max_num_seqs}), got {n}",
                Status.INVALID_ARG,
            )

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise KilnError(
                f"priority {priority} was given but priority scheduling is not enabled: the "
                f"model's scheduling_policy is '{self.config.scheduling_policy}' (set the "
                "parameter scheduling_policy to 'priority' to use request priorities)",
                Status.INVALID_ARG,
            )
