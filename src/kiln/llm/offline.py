"""vLLM's offline API on kiln's engine: ``LLM(model).generate(prompts, SamplingParams(...))``
and ``chat``, ``embed``, ``classify``, in this process, no server (``from kiln.llm import
LLM, SamplingParams`` where a vLLM job has ``from vllm import ...``).

The engine is the one ``kiln serve --model`` runs (its end-of-turn ids, generation_config
defaults and chat template the same), stepped on the caller's thread until every prompt
finished; stop strings, detokenization and the outputs' shapes are vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError, Status
from kiln.core.progress import progress
from kiln.llm import sequence, weight_versions
from kiln.llm.checkpoint import generation_eos_ids, open_checkpoint, sampling_defaults
from kiln.llm.config import EngineConfig, PoolerConfig
from kiln.llm.engine_core import build_engine
from kiln.llm.offline_types import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    ClassificationOutput,
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    SamplingParams,
    ScoringOutput,
    WeightVersionSpan,
)
from kiln.llm.params import InvalidField, sampling_fields, with_defaults
from kiln.llm.profiler_config import ProfilerConfig, check_session
from kiln.llm.sequence import find_stop, token_by_token
from kiln.llm.tokenizer import IncrementalDetokenizer, Tokenizer, template_source

if TYPE_CHECKING:
    import torch

    from kiln.llm.engine import RequestOutput as StepOutput


Prompt = str | list[int] | dict[str, Any]
#: SamplingParams' fields read as a request's (kiln.llm.params.sampling_fields)
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "min_tokens",
             "allowed_token_ids")  # fmt: skip


class LLM(weight_versions.OfflineWeightVersions):
    """A model in this process, as vLLM's ``LLM``: a Hugging Face folder or a ``.gguf``
    file, with vLLM's engine arguments (``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``seed``, ``runner="pooling"`` for embeddings, ...). Runs on GPU 0 when torch sees one."""

    def __init__(
        self,
        model: str | Path,
        *,
        tokenizer: str | Path | None = None,
        chat_template: str | None = None,
        generation_config: str = "auto",
        runner: str = "generate",
        device: str | None = None,
        **engine_args: Any,
    ) -> None:
        import torch

        path = Path(model)
        if not path.exists():
            raise KilnError(
                f"model '{model}': no such folder or .gguf file (kiln reads local "
                "checkpoints; fetch a hub model first)",
                Status.INVALID_ARG,
            )
        engine_args.pop("trust_remote_code", None)  # kiln runs no code from a checkpoint
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - names)
        if unknown:
            raise TypeError(f"LLM() got engine arguments kiln does not have: {unknown}")
        profiling = engine_args.get("profiler_config")
        if profiling is not None and not isinstance(profiling, ProfilerConfig):
            engine_args["profiler_config"] = ProfilerConfig.parse(profiling)
        config = EngineConfig(**engine_args)
        config.runner = runner
        if runner == "pooling" and "pooler_config" not in engine_args:
            config.pooler_config = PoolerConfig()
        config.device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        self.tokenizer = Tokenizer.load(Path(tokenizer) if tokenizer else path, chat_template or "")
        generation = (
            {} if generation_config == "vllm" else open_checkpoint(path).generation_config()
        )
        #: request fields' defaults from generation_config.json (vLLM's ``auto``)
        self.defaults = sampling_defaults(generation)
        extra_eos = (self.tokenizer.eos_token_id, *generation_eos_ids(generation))
        self.engine = build_engine(path, self.tokenizer, config, extra_eos)
        self._ids = 0

    def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """vLLM's: record the next steps into a trace (``profiler_config`` must be set);
        ``profile_prefix`` starts the trace files' names."""
        prefix, delay, limit = check_session(profile_prefix, delay_iterations, max_iterations)
        self.engine.call("start_profile", (prefix, delay, limit))

    def stop_profile(self) -> list[str]:
        """End the session; the files it wrote into ``torch_profiler_dir``."""
        files = self.engine.call("stop_profile", ())
        return [str(f) for f in files] if isinstance(files, list) else []

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json values, else vLLM's defaults."""
        known = {f.name for f in fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.defaults.items() if k in known})

    # ---- generation ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Every prompt (a text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids":
        ...}``) run to its end, batched by the engine; the outputs in the prompts' order."""
        items = self._prompts(prompts, add_special_tokens=True)
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered by the model's chat
        template (or ``chat_template``, vLLM's argument), then generated as ``generate``
        does."""
        conversations: list[Any] = (
            list(messages) if messages and isinstance(messages[0], list) else [messages]
        )
        items: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt, continue_final_message,
                chat_template_kwargs, template_source(chat_template) if chat_template else None,
            )  # fmt: skip
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if self.engine.config.runner != "generate":
            raise ValueError(
                "generate() and chat() need a generating model; this one pools (use embed() "
                "or classify())"
            )
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        plist = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(plist) != len(items):
            raise ValueError(
                f"{len(plist)} sampling_params for {len(items)} prompts: give one, or one each"
            )
        runs = []
        for (text, ids), params in zip(items, plist, strict=True):
            engine_params = self._engine_params(params, len(ids))
            self._ids += 1
            run = _Run(f"{self._ids}", text, ids, params, engine_params, self.tokenizer)
            self.engine.add_request(run.request_id, ids, engine_params)
            runs.append(run)
        by_id = {run.request_id: run for run in runs}
        with progress(len(runs), "Processed prompts", use_tqdm) as advance:
            while self.engine.has_work():
                for out in self.engine.step():
                    run = by_id[out.request_id]
                    if run.take(out, self.engine):
                        advance()
                for rid, error in self.engine.failed:
                    raise KilnError(f"request {rid} failed: {error}", Status.INTERNAL)
        return [run.output() for run in runs]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``beam_search``: each prompt's best ``params.beam_width`` beams. Every
        step runs all prompts' live beams as one-token requests in one engine batch
        (``concurrency_limit``: at most this many prompts searched at once)."""
        from kiln.llm.beam_search import BeamSearch

        if lora_request is not None:
            raise ValueError("beam_search() with a LoRA adapter is not supported by kiln")
        if params.structured_outputs is not None:
            raise ValueError("beam_search() with structured_outputs is not supported by kiln")
        if self.engine.config.runner != "generate":
            raise ValueError("beam_search() needs a generating model; this one pools")
        width, length_penalty = params.beam_width, params.length_penalty
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {width!r}")
        if not -10 <= length_penalty <= 10:
            raise ValueError(f"length_penalty must be in [-10, 10], got {length_penalty}")
        if not self.engine.config.enable_prefix_caching:
            raise ValueError(
                "beam_search() needs the prefix cache (enable_prefix_caching=True): without "
                "it every step recomputes every beam from the prompt's start"
            )
        limit = self.engine.config.max_logprobs
        if limit != -1 and 2 * width > limit:
            raise ValueError(
                f"beam_width {width} ranks {2 * width} candidates a beam each step, more than "
                f"max_logprobs ({limit}): raise max_logprobs or lower beam_width"
            )
        items = self._prompts(prompts, add_special_tokens=True)
        step = sequence.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                       logprobs=2 * width)  # fmt: skip
        searches = []
        for _, ids in items:
            self.engine.check_request(len(ids), replace(step, max_tokens=params.max_tokens))
            search = BeamSearch(
                len(ids),
                width,
                params.max_tokens,
                eos_token_ids=self.engine.args.eos_token_ids,
                ignore_eos=params.ignore_eos,
                length_penalty=length_penalty,
                include_stop_str_in_output=True,  # vLLM's offline beams keep their EOS
            )
            searches.append(search)
        group = concurrency_limit or len(searches)
        starts = range(0, len(searches), group)
        # at most max_tokens steps a group (fewer when every beam ended or was settled)
        with progress(params.max_tokens * len(starts), "Beam search steps", use_tqdm) as advance:
            for start in starts:
                batch = list(range(start, min(start + group, len(searches))))
                while live := [i for i in batch if not searches[i].done()]:
                    self._beam_step([(items[i][1], searches[i]) for i in live], step)
                    advance()
        outputs = []
        for (_, ids), search in zip(items, searches, strict=True):
            beams = []
            for beam in search.best():
                tokens = ids + beam.tokens
                logprobs = [
                    {e.token_id: Logprob(e.logprob), **{t: Logprob(lp) for t, lp in e.top}}
                    for e in beam.logprobs
                ]
                text = self.tokenizer.decode(tokens, params.skip_special_tokens)
                beams.append(BeamSearchSequence(tokens, logprobs, beam.cum_logprob, text,
                                                beam.finish_reason, beam.stop_reason))  # fmt: skip
            outputs.append(BeamSearchOutput(beams))
        return outputs

    def _beam_step(
        self, searches: list[tuple[list[int], Any]], params: sequence.SamplingParams
    ) -> None:
        """One step of these searches: their live beams as one engine batch."""
        wanted: dict[str, Any] = {}
        for p, (prompt, search) in enumerate(searches):
            for b, ids in enumerate(search.prompts(prompt)):
                self._ids += 1
                rid = f"beam-{self._ids}"
                self.engine.add_request(rid, ids, params)
                wanted[rid] = (p, b)
        dists: list[list[Any]] = [[None] * len(s.live) for _, s in searches]
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished and out.logprobs:
                    p, b = wanted[out.request_id]
                    dists[p][b] = out.logprobs[0]
            for rid, error in self.engine.failed:
                raise KilnError(f"request {rid} failed: {error}", Status.INTERNAL)
        for (_, search), found in zip(searches, dists, strict=True):
            search.advance(found)

    def _engine_params(self, params: SamplingParams, prompt_len: int) -> sequence.SamplingParams:
        """vLLM's fields checked as a request's are, the model's defaults under them."""
        body = {k: getattr(params, k) for k in _SAMPLING if getattr(params, k) is not None}
        if params.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
        try:
            kwargs = sampling_fields(with_defaults(body, self.defaults))
        except InvalidField as exc:
            raise ValueError(exc.message) from None
        room = self.engine.config.max_model_len - prompt_len
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        out = sequence.SamplingParams(
            max_tokens=max_tokens, logprobs=params.logprobs, n=params.n, **kwargs
        )
        self.engine.check_request(prompt_len, out)
        return out

    def _prompts(
        self, prompts: Prompt | Sequence[Prompt], add_special_tokens: bool
    ) -> list[tuple[str | None, list[int]]]:
        one = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        listed: list[Any] = [prompts] if one else list(prompts)
        if not listed:
            raise ValueError("no prompts")
        out: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(listed):
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            if isinstance(p, str) and p:
                out.append((p, self.tokenizer.encode(p, add_special_tokens=add_special_tokens)))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(f"prompt {i} must be a non-empty text or list of token ids")
        return out

    # ---- pooling ------------------------------------------------------------------------
    def embed(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (a model loaded with ``runner="pooling"``), pooled and
        normalized by its pooler config, as ``/v1/embeddings`` answers."""
        from kiln.llm.pooling import finish

        self._pooling("embed")
        vectors, items = self._pool(prompts, use_tqdm)
        # resolved when the engine was built (None would be the default: true)
        normalize = self.engine.config.pooler_config.normalize is not False
        return [
            PoolingRequestOutput(str(i), ids, EmbeddingOutput(finish(v, None, normalize).tolist()))
            for i, (v, (_, ids)) in enumerate(zip(vectors, items, strict=True))
        ]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        pooling_task: str = "token_embed",
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``encode``: with ``pooling_task="token_embed"`` each prompt's token
        vectors [tokens, hidden] (normalized by the pooler config); ``token_classify`` (a
        token classifier's) each token's label probabilities [tokens, labels]; ``embed``
        and ``classify`` as ``embed()`` and ``classify()``, their data as tensors."""
        import torch

        from kiln.llm.pooling import finish

        if pooling_task == "embed":
            done = self.embed(prompts, use_tqdm)
            for out in done:
                out.outputs = PoolingOutput(torch.tensor(out.outputs.embedding))
            return done
        if pooling_task == "classify":
            done = self.classify(prompts, use_tqdm)
            for out in done:
                out.outputs = PoolingOutput(torch.tensor(out.outputs.probs))
            return done
        if pooling_task == "token_classify":  # each token's label probabilities
            self._pooling("token_classify")
            flat, items = self._pool(prompts, use_tqdm, tokens=True)
            one = len(self.engine.args.token_labels) == 1
            probs = flat.sigmoid() if one else flat.softmax(-1)
            parts = probs.split_with_sizes([len(ids) for _, ids in items])
            return [
                PoolingRequestOutput(str(i), ids, PoolingOutput(part))
                for i, (part, (_, ids)) in enumerate(zip(parts, items, strict=True))
            ]
        if pooling_task != "token_embed":
            raise ValueError(
                "pooling_task must be token_embed, token_classify, embed or classify, got "
                f"{pooling_task!r}"
            )
        self._pooling("embed")
        flat, items = self._pool(prompts, use_tqdm, tokens=True)
        normalize = self.engine.config.pooler_config.normalize is not False
        parts = flat.split_with_sizes([len(ids) for _, ids in items])
        return [
            PoolingRequestOutput(str(i), ids, PoolingOutput(finish(part, None, normalize)))
            for i, (part, (_, ids)) in enumerate(zip(parts, items, strict=True))
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (a ``*ForSequenceClassification`` model):
        softmax of its logits, a one-class model's sigmoid."""
        self._pooling("classify")
        logits, items = self._pool(prompts, use_tqdm)
        probs = logits.sigmoid() if self.engine.args.num_labels == 1 else logits.softmax(-1)
        return [
            PoolingRequestOutput(str(i), ids, ClassificationOutput(row.tolist()))
            for i, (row, (_, ids)) in enumerate(zip(probs, items, strict=True))
        ]

    def score(
        self, text_1: str | list[str], text_2: str | list[str], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """vLLM's: each pair's score, one ``text_1`` against every ``text_2`` or pair by
        pair. A one-class classifier scores each pair as one input (a cross-encoder: the
        sigmoid of its logit); an embedding model the cosine of the two texts' vectors."""
        import torch.nn.functional as F

        left = [text_1] if isinstance(text_1, str) else list(text_1)
        right = [text_2] if isinstance(text_2, str) else list(text_2)
        if not left or not right or len(left) not in (1, len(right)):
            raise ValueError(
                f"score() pairs one text_1 with every text_2, or N with N; got {len(left)} "
                f"and {len(right)}"
            )
        pairs = [(left[0 if len(left) == 1 else i], r) for i, r in enumerate(right)]
        if self.engine.args.num_labels == 1:
            self._pooling("classify")
            types = self.engine.args.token_types
            ids = [self.tokenizer.encode_pair(a, b, types) for a, b in pairs]
            logits, _ = self._pool(ids, use_tqdm)
            values = logits[:, 0].sigmoid().tolist()
        else:
            self._pooling("embed")
            vectors, _ = self._pool([p for pair in pairs for p in pair], use_tqdm)
            a, b = F.normalize(vectors[0::2], dim=-1), F.normalize(vectors[1::2], dim=-1)
            values = (a * b).sum(-1).tolist()
            ids = [[] for _ in pairs]
        return [
            PoolingRequestOutput(str(i), pair_ids, ScoringOutput(value))
            for i, (value, pair_ids) in enumerate(zip(values, ids, strict=True))
        ]

    def _pooling(self, task: str) -> None:
        args = self.engine.args
        if args.is_token_classifier != (task == "token_classify"):
            kind = "a token classifier" if args.is_token_classifier else "no token classifier"
            raise ValueError(f"{task}() needs a model that can {task}; this one is {kind}")
        if task == "token_classify":
            return
        classifier = bool(self.engine.args.num_labels)
        if self.engine.config.runner != "pooling" or classifier != (task == "classify"):
            runner = self.engine.config.runner
            kind = "a sequence classifier" if classifier else f"served with runner '{runner}'"
            raise ValueError(f"{task}() needs a model that can {task}; this one is {kind}")

    def _pool(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool, tokens: bool = False
    ) -> tuple[torch.Tensor, list[tuple[str | None, list[int]]]]:
        import torch

        items = self._prompts(prompts, add_special_tokens=True)
        limit = self.engine.config.max_model_len
        budget = self.engine.config.max_num_batched_tokens
        rows: list[torch.Tensor] = []
        with progress(len(items), "Processed prompts", use_tqdm) as advance:
            at = 0
            while at < len(items):
                batch: list[list[int]] = []
                taken = 0
                while at < len(items) and (not batch or taken + len(items[at][1]) <= budget):
                    ids = items[at][1]
                    if len(ids) > limit:
                        raise ValueError(f"prompt {at} has {len(ids)} tokens, past {limit}")
                    batch.append(ids)
                    taken += len(ids)
                    at += 1
                rows.append(self.engine.pool(batch, tokens))
                for _ in batch:
                    advance()
        return torch.cat(rows), items


class _Run:
    """One prompt's samples as the steps produce them: text, stop strings, finish."""

    def __init__(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
        engine_params: sequence.SamplingParams, tokenizer: Tokenizer,
    ) -> None:  # fmt: skip
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, ids
        self.params, self.engine_params = params, engine_params
        self.stops = params.stops()
        #: text a stop string may straddle: a token's search starts this far back
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.samples = [
            _Sample(IncrementalDetokenizer(tokenizer, params.skip_special_tokens, ids))
            for _ in range(engine_params.n)
        ]
        self.left = engine_params.n

    def take(self, out: StepOutput, engine: Any) -> bool:
        """One step's output of a sample; True once every sample has finished."""
        sample = self.samples[out.index]
        if sample.reason is not None:
            return False  # a stop string ended it; its abort is on the way
        if out.weight_version_starts is not None:
            sample.weight_starts = out.weight_version_starts
        keep_stop = self.params.include_stop_str_in_output
        drop = out.stop_token_id is not None and not keep_stop
        for ids, entries, count, last in token_by_token(out, drop):
            if drop and last:
                sample.ids.append(out.new_token_ids[-1])
            else:
                sample.ids.extend(ids)
            sample.entries.extend(entries)
            before = len(sample.text)
            sample.text += sample.detok.add(ids, final=last)
            found = None
            if self.stops and count > self.engine_params.min_tokens:
                found = find_stop(sample.text, self.stops, max(before - self.hold, 0))
            if found is not None:
                at, stop = found
                sample.text = sample.text[: at + (len(stop) if keep_stop else 0)]
                sample.reason, sample.stop_reason = "stop", stop
                if not out.finished:
                    engine.abort(self.request_id, out.index, "stop")
                break
        if sample.reason is None and out.finished:
            sample.reason = out.finish_reason
            stop_ids = self.engine_params.stop_token_ids
            if out.stop_token_id is not None and out.stop_token_id in stop_ids:
                sample.stop_reason = out.stop_token_id
        if sample.reason is None:
            return False
        self.left -= 1
        return self.left == 0

    def output(self) -> RequestOutput:
        outputs = []
        for index, s in enumerate(self.samples):
            logprobs = None
            cumulative = None
            if self.params.logprobs is not None:
                logprobs = [
                    {e.token_id: Logprob(e.logprob), **{t: Logprob(lp) for t, lp in e.top}}
                    for e in s.entries
                ]
                cumulative = sum(e.logprob for e in s.entries)
            spans = weight_versions.spans(s.weight_starts, len(s.ids))
            versions = None if spans is None else [WeightVersionSpan(**v) for v in spans]
            outputs.append(CompletionOutput(index, s.text, s.ids, cumulative, logprobs,
                                            s.reason, s.stop_reason, versions))  # fmt: skip
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outputs)


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    text: str = ""
    ids: list[int] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)
    reason: str | None = None
    stop_reason: str | int | None = None
    weight_starts: list[tuple[str, int]] | None = None
