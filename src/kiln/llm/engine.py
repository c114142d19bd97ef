"""The synchronous engine: admit requests, run steps, report new tokens per request."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kiln.core.errors import KilnError, Status
from kiln.llm import weight_versions
from kiln.llm.block_manager import BlockManager
from kiln.llm.checkpoint import (
    DenseLayer,
    open_checkpoint,
    sentence_transformers_dense,
    sentence_transformers_pooling,
    torch_dtype_name,
)
from kiln.llm.config import EngineConfig, ModelArgs, PoolerConfig
from kiln.llm.draft_model import DraftProposer
from kiln.llm.kv_cache_metrics import KVCacheResidency
from kiln.llm.lora import LoRARequest
from kiln.llm.model_runner import resolve_dtype
from kiln.llm.parallel import create_runner
from kiln.llm.perf_metrics import ModelShape, StepContext, quant_method
from kiln.llm.profiler import EngineProfiler, engine_call
from kiln.llm.request_checks import RequestChecks
from kiln.llm.sampler import SampledToken, TokenLogprobs
from kiln.llm.scheduler import Scheduler, SchedulerOutput
from kiln.llm.sequence import RequestState, SamplingParams, Sequence
from kiln.llm.spec_decode import NgramProposer, SpecDecodeStats
from kiln.llm.stats import EngineStats, RequestHistograms
from kiln.llm.structured import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request; its lists are built for it alone (the
    reader side merges later steps into them, kiln.llm.async_engine.OutputCollector)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: one entry per new token when the request asked for logprobs
    logprobs: list[TokenLogprobs] | None = None
    #: which of the request's ``n`` samples (the OpenAI choice ``index``)
    index: int = 0
    #: with ``prompt_logprobs``, on a sample's first output: one entry per prompt token
    #: (the first is None: nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    #: when the request was first scheduled (``time.monotonic()``; its queue time ends)
    first_scheduled_time: float | None = None
    #: the stop token that finished the sample (not a grammar's end nor a stop string)
    stop_token_id: int | None = None
    #: prompt tokens the prefix cache held when the request was first scheduled
    num_cached_tokens: int = 0
    #: (weight version, output token it began at) of the sample, sent when they changed
    #: (its first output, and after a new version: ``kiln.llm.weight_versions``)
    weight_version_starts: list[tuple[str, int]] | None = None


def _holds(ids: list[int], run: tuple[int, ...]) -> bool:
    """Whether ``run`` occurs in ``ids``: ``list.index`` finds each candidate start (a scan
    in C: the engine's thread holds every request while it runs)."""
    at = 0
    try:
        while True:
            at = ids.index(run[0], at)
            if tuple(ids[at : at + len(run)]) == run:
                return True
            at += 1
    except ValueError:
        return False


def _pooler_config(path: Path, args: ModelArgs, asked: PoolerConfig) -> PoolerConfig:
    """``asked`` (vLLM's ``--pooler-config``) with what it leaves open filled by the
    model's defaults: a classifier reads its class logits unnormalized from its last token
    (a decoder's) or its first (an encoder's: ``[CLS]``); an embedding model pools as its
    sentence-transformers ``modules.json`` says, else from ``[CLS]`` (an encoder) or the last
    token (a decoder), L2-normalized."""
    if args.num_labels or args.is_token_classifier:  # (a token classifier reads every row)
        return PoolerConfig("CLS" if args.is_encoder else "LAST", normalize=False)
    st_pooling, st_normalize = sentence_transformers_pooling(path)
    pooling = asked.pooling_type or st_pooling or ("CLS" if args.is_encoder else "LAST")
    normalize = asked.normalize if asked.normalize is not None else st_normalize
    return PoolerConfig(pooling, True if normalize is None else normalize)


class LLMEngine(RequestChecks):
    def __init__(self, path: Path, config: EngineConfig | None = None) -> None:
        """``path``: a Hugging Face folder or a ``.gguf`` file."""
        config = replace(config) if config is not None else EngineConfig()
        config.check()
        self.checkpoint = open_checkpoint(path)
        raw = self.checkpoint.config()
        self.args = ModelArgs.from_dict(raw)
        if self.args.num_labels or self.args.is_encoder:
            # a sequence classifier or an encoder pools (vLLM picks its pooling runner for
            # one); a classifier serves /classify
            config.runner = "pooling"
        asked = config.pooler_config
        if config.runner != "pooling" and (asked.pooling_type or asked.normalize is not None):
            raise KilnError(
                "llm backend: pooling_type, normalize and pooler_config need runner "
                f"'pooling' (the model serves /v1/embeddings); {self.args.architecture} "
                "generates unless told to pool",
                Status.INVALID_ARG,
            )
        config.pooler_config = _pooler_config(path, self.args, config.pooler_config)
        #: a sentence-transformers checkpoint's Dense modules, applied to the pooled
        #: vectors (vLLM's projector); the vectors' width is then the last one's
        self.projector: list[DenseLayer] = []
        plain = not self.args.num_labels and not self.args.is_token_classifier
        if config.runner == "pooling" and plain and Path(path).is_dir():
            self.projector = sentence_transformers_dense(Path(path), self.args.hidden_size)
        if self.projector:
            width = int(self.projector[-1].weight.shape[0])
            self.args = replace(self.args, pooled_size=width)
        config.max_model_len = config.max_model_len or self.args.max_position_embeddings
        config.dtype = resolve_dtype(
            config.dtype, torch_dtype_name(raw), torch.device(config.device)
        )
        windowed = [i for i, w in enumerate(self.args.layer_windows()) if w is not None]
        if windowed:
            # every backend attends within the window; the blocks before it stay allocated
            log.info(
                "llm: %s attends within a %d-token sliding window in %d of %d layers",
                self.args.architecture,
                self.args.sliding_window,
                len(windowed),
                self.args.num_hidden_layers,
            )
        self.runner = create_runner(self.checkpoint, self.args, config)
        # A sequence alone must always fit in the cache, or preemption could never help it.
        config.max_model_len = min(config.max_model_len, self.runner.num_blocks * config.block_size)
        self.config = config
        observe = config.observability
        residency = None
        if observe.kv_cache_metrics:  # vLLM's --kv-cache-metrics
            residency = KVCacheResidency(observe.kv_cache_metrics_sample)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
            residency=residency,
        )  # fmt: skip
        #: vLLM's --enable-mfu-metrics: the model's shapes its estimates read (None: off)
        self.perf: ModelShape | None = None
        if observe.enable_mfu_metrics:
            method = "gguf" if Path(path).suffix == ".gguf" else quant_method(raw)
            self.perf = ModelShape.of(self.args, config.dtype, config.kv_cache_dtype, method,
                                      config.tensor_parallel_size)  # fmt: skip
        self.scheduler = Scheduler(config, self.block_manager)
        spec = config.speculative_config
        self.proposer: NgramProposer | DraftProposer | None = None
        #: vLLM's ``spec_decode_*`` counters (None: no speculative decoding)
        self.spec_stats: SpecDecodeStats | None = None
        if spec is not None:
            if spec.num_speculative_tokens >= config.max_model_len:
                raise KilnError(
                    "llm backend: speculative_config: num_speculative_tokens "
                    f"{spec.num_speculative_tokens} is too large for max_model_len "
                    f"{config.max_model_len}",
                    Status.INVALID_ARG,
                )
            if spec.method == "draft_model":
                assert spec.model is not None
                self.proposer = DraftProposer(
                    Path(spec.model), self.args, config, self.runner.num_blocks
                )
            else:
                self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.stats = EngineStats(RequestHistograms.for_model(config.max_model_len))
        self.stats.kv_residency = residency
        #: samples whose logits held a NaN, until they leave (``vllm:corrupted_requests``)
        self.corrupted: set[int] = set()
        #: the requests the last step failed, with the error (they left the engine)
        self.failed: list[tuple[str, Exception]] = []
        #: vLLM's weight version: the label of the weights the next step runs
        self.weight_version = weight_versions.DEFAULT_VERSION
        if config.seed is not None:  # vLLM's --seed: unseeded requests draw from these
            torch.manual_seed(config.seed)
        #: compiles ``structured_outputs`` for this model's tokenizer; set by whoever owns
        #: the tokenizer (the backend): without it, constrained requests are refused
        self.grammars: GrammarCompiler | None = None
        #: vLLM's worker profiler (``--profiler-config``; None: not enabled)
        self.profiler: EngineProfiler | None = None
        if config.profiler_config is not None:
            name = config.served_model_name or Path(path).stem
            self.profiler = EngineProfiler(config.profiler_config, name, config.device)

    def close(self) -> None:
        """Release what outlives the engine object: a tensor-parallel model's workers."""
        if self.profiler is not None:
            self.profiler.close()
        self.runner.close()

    def call(self, op: str, args: tuple[object, ...] | list[object]) -> object:
        """One of ``profiler.ENGINE_CALLS`` (vLLM's ``/start_profile``, ``/stop_profile``), run
        between two steps on the engine's thread or in its process (``engine_control``)."""
        return engine_call(self.profiler, op, args)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Sequence:
        """Queue a request; with ``params.n > 1`` its other samples wait on the returned
        sequence and are forked from it when its prompt is done. ``lora_request``: the
        adapter it runs with (one ``add_lora`` was given)."""
        self.check_request(len(prompt_token_ids), params, priority, lora_request)
        vocab = self.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise KilnError(f"prompt token ids must be in [0, {vocab})", Status.INVALID_ARG)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(priority, arrival, num_live=params.n)
        eos = self.args.eos_token_ids
        seq = Sequence(request_id, list(prompt_token_ids), params, eos, request=state,
                       lora_request=lora_request)  # fmt: skip
        seq.forks = [
            Sequence(
                request_id,
                list(prompt_token_ids),
                params,
                eos,
                index=i,
                request=state,
                lora_request=lora_request,
            )
            for i in range(1, params.n)
        ]
        for sample in (seq, *seq.forks):
            weight_versions.begin(sample, self.weight_version)
        if params.thinking_token_budget is not None:
            for sample in (seq, *seq.forks):
                sample.start_budget()
        spec = params.structured_outputs
        if spec is not None and self.grammars is not None:
            # the frontend compiled it off the event loop: a cache hit here, unless evicted
            # a thinking model's constraint starts after its reasoning, unless the prompt
            # closed the reasoning already (vLLM's check: the marker in the prompt)
            end = params.reasoning_end
            thinking = bool(end) and not _holds(prompt_token_ids, end)
            for sample in (seq, *seq.forks):
                sample.grammar = self.grammars.matcher(spec)
                sample.thinking = thinking
        self.scheduler.add(seq)
        return seq

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check a PEFT adapter (vLLM's ``add_lora``): a bad one raises, naming
        why; a good one is kept on the host for the requests that name it. Any thread."""
        if self.runner.lora is None:
            if self.config.lora_config is not None:  # a sleep (level 2) dropped the model
                raise KilnError(
                    f"LoRA adapter '{request.lora_name}': the engine is asleep without its "
                    "weights; wake it (POST /wake_up) before loading an adapter",
                    Status.UNAVAILABLE,
                )
            raise KilnError(
                f"LoRA adapter '{request.lora_name}': LoRA is not enabled for this model "
                "(--enable-lora)",
                Status.INVALID_ARG,
            )
        self.runner.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (requests already running with it finish with it)."""
        if self.runner.lora is not None:
            self.runner.lora.remove(lora_int_id)

    def loras_in_use(self) -> tuple[str, str]:
        """The adapters of the waiting and of the running requests, each comma separated
        and sorted (vLLM's ``lora_requests_info`` labels). Any thread: it reads copies."""

        def names(seqs: list[Sequence]) -> str:
            found = {s.lora_request.lora_name for s in seqs if s.lora_request is not None}
            return ",".join(sorted(found))

        sched = self.scheduler
        return names(list(sched.waiting)), names(list(sched.running))

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> bool:
        """Abort the request (or its sample ``index`` alone). ``reason`` is the
        ``finished_reason`` it counts under: ``stop`` when a stop string ended it."""
        removed = self.scheduler.abort(request_id, index)
        now = time.monotonic()
        for seq in removed:
            self._retire(seq, now, reason)
        return bool(removed)

    def _retire(self, seq: Sequence, now: float, reason: str | None = None) -> None:
        """A sample left the engine: observe it as vLLM observes a finished request."""
        stats, h = self.stats, self.stats.histograms
        reason = reason or seq.finish_reason or "abort"
        stats.request_success[reason] = stats.request_success.get(reason, 0) + 1
        if seq.seq_id in self.corrupted:  # counted as it finishes, once, as vLLM's
            self.corrupted.discard(seq.seq_id)
            stats.num_corrupted_reqs += 1
        state = seq.request
        generated = seq.num_output_tokens
        h.e2e_request_latency.observe(now - state.arrival_time)
        h.prompt_tokens.observe(seq.num_prompt_tokens)
        h.generation_tokens.observe(generated)
        h.params_max_tokens.observe(seq.params.max_tokens)
        h.num_preemptions.observe(seq.num_preemptions)
        scheduled = state.first_scheduled_time
        if scheduled is not None:
            h.queue_time.observe(scheduled - state.arrival_time)
            h.prefill_kv_computed_tokens.observe(seq.num_prompt_tokens - state.num_cached_tokens)
        first, last = seq.first_token_time, seq.last_token_time
        if scheduled is not None and first is not None and last is not None:
            h.prefill_time.observe(first - scheduled)
            h.decode_time.observe(last - first)
            h.inference_time.observe(last - scheduled)
            if generated > 1:
                h.time_per_output_token.observe((last - first) / (generated - 1))
        state.max_output_tokens = max(state.max_output_tokens, generated)
        state.num_live -= 1
        if state.num_live == 0:  # the request's last sample has left the engine
            h.params_n.observe(seq.params.n)
            h.max_num_generation_tokens.observe(state.max_output_tokens)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        profiler = self.profiler
        if profiler is None or not profiler.active:
            return self._step()
        steps = self.stats.num_steps
        with profiler.annotate("kiln::step"):
            results = self._step()
        if self.stats.num_steps != steps:  # a step that ran the model
            profiler.step()
        return results

    def _step(self) -> list[RequestOutput]:
        self.failed = []
        out = self.scheduler.schedule()
        if not out.seqs:
            return []
        now = time.monotonic()
        for seq in out.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
                # admission has just given it its prefix-cache hits, nothing more yet
                seq.request.num_cached_tokens = seq.num_computed_tokens
        if self.proposer is not None:
            self._propose(out)
        sampled = self._run(out)
        if self.perf is not None:
            self._estimate(out)
        now = time.monotonic()
        self.stats.num_steps += 1
        self.stats.max_step_tokens = max(self.stats.max_step_tokens, out.total_tokens)
        self.stats.histograms.iteration_tokens.observe(out.total_tokens)
        results: list[RequestOutput] = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            token = sampled.get(seq.seq_id)
            if seq.spec_token_ids:
                drafts = len(seq.spec_token_ids)
                accepted = len(token.accepted) if token is not None else 0
                # the rejected drafts' K/V is stale: those slots are rewritten next step
                n -= drafts - accepted
                seq.spec_token_ids, seq.spec_probs = [], None
                # blocks that only rejected drafts reached go back to the pool
                self.block_manager.trim(seq, seq.num_tokens + accepted + 1)
                if self.spec_stats is not None and token is not None:
                    self.spec_stats.observe(drafts, accepted)
            seq.num_computed_tokens += n
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            self.block_manager.cache_blocks(seq)
            if token is None:
                continue  # a prompt chunk: nothing to report yet
            if seq.num_output_tokens == 0 and seq.index == 0:
                self.stats.num_prompt_tokens += seq.num_prompt_tokens
                self.stats.num_prompt_tokens_cached += seq.request.num_cached_tokens
            samples = [seq, *seq.forks]
            for child in seq.forks:
                self.block_manager.fork(seq, child)
                child.prompt_logprobs = seq.prompt_logprobs  # one prompt, computed once
                child.num_computed_tokens = seq.num_computed_tokens
                child.status = seq.status
                self.scheduler.running.append(child)
            seq.forks = []
            for sample in samples:
                results.append(self._append(sample, sampled[sample.seq_id], now))
        for seq in self.scheduler.remove_finished():
            self._retire(seq, now)
        return results

    def _estimate(self, out: SchedulerOutput) -> None:
        """vLLM's MFU estimates of the step that ran (before its tokens are counted
        computed: a sequence's context is what it had plus what the step ran)."""
        assert self.perf is not None
        ctx = StepContext()
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if n:
                done = seq.num_computed_tokens
                ctx.add(n, done + n, n > 1 or done < seq.num_prompt_tokens)
        flops, read, write = self.perf.estimate(ctx)
        stats = self.stats
        stats.estimated_flops += flops
        stats.estimated_read_bytes += read
        stats.estimated_write_bytes += write

    def _run(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        """The step's model run. When it raises, each request of the step runs again alone,
        and only those whose own run fails leave the engine (listed in ``failed``, their
        sequences dropped from ``out``): one request's bad input or bug must not fail the
        others that happened to share its batch. A re-run recomputes the same K/V into the
        same slots (and the prompt logprobs not yet known), so it is safe to repeat."""
        try:
            return self.runner.run(out)
        except Exception as exc:
            groups: dict[str, SchedulerOutput] = {}
            for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
                group = groups.setdefault(seq.request_id, SchedulerOutput())
                group.seqs.append(seq)
                group.num_new_tokens.append(n)
            if len(groups) == 1:
                self.failed = [(next(iter(groups)), exc)]
                sampled: dict[int, SampledToken] = {}
            else:
                log.warning("llm engine: a step of %d requests failed (%s): running each alone",
                            len(groups), exc)  # fmt: skip
                sampled = self._run_alone(groups, out.copies)
        failed = {rid for rid, _ in self.failed}
        kept = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
                if s.request_id not in failed]  # fmt: skip
        out.seqs, out.num_new_tokens = [s for s, _ in kept], [n for _, n in kept]
        now = time.monotonic()
        for rid in failed:
            for seq in self.scheduler.abort(rid):
                self._retire(seq, now, "error")
        return sampled

    def _run_alone(
        self, groups: dict[str, SchedulerOutput], copies: list[tuple[int, int]]
    ) -> dict[int, SampledToken]:
        sampled: dict[int, SampledToken] = {}
        for rid, group in groups.items():
            # its own copy-on-write copies only: another's would overwrite K/V it wrote
            own = {b for s in group.seqs for b in s.block_table}
            group.copies = [c for c in copies if c[1] in own]
            try:
                sampled.update(self.runner.run(group))
            except Exception as exc:
                log.exception("llm engine: request %s failed its step", rid)
                self.failed.append((rid, exc))
        return sampled

    def _propose(self, out: SchedulerOutput) -> None:
        """Draft tokens for the decoding sequences the scheduler gave room for; a sequence
        runs its last token and the drafts found (the slots of those not found stay free)."""
        proposer = self.proposer
        rooms = {
            seq.seq_id: seq.num_computed_tokens + n - seq.num_tokens
            for seq, n in zip(out.seqs, out.num_new_tokens, strict=True)
        }
        if isinstance(proposer, DraftProposer):
            if any(room > 0 for room in rooms.values()):
                try:
                    proposer.propose(out, rooms)
                except Exception:
                    # drafts are optional: the step goes on without them, and the draft
                    # recomputes its K/V from the start (it may be half written)
                    log.exception("llm engine: the draft model failed; no drafts this step")
                    for seq in out.seqs:
                        seq.spec_token_ids, seq.spec_probs = [], None
                        seq.num_draft_computed = 0
        elif proposer is not None:
            for seq in out.seqs:
                if rooms[seq.seq_id] > 0:
                    seq.spec_token_ids = proposer.propose(seq.token_ids, rooms[seq.seq_id])
        for i, seq in enumerate(out.seqs):
            room = rooms[seq.seq_id]
            if room > 0:
                out.num_new_tokens[i] += len(seq.spec_token_ids) - room

    def _append(self, seq: Sequence, sampled: SampledToken, now: float) -> RequestOutput:
        h = self.stats.histograms
        if sampled.num_nans:
            self.corrupted.add(seq.seq_id)
        if seq.last_token_time is not None:
            h.inter_token_latency.observe(now - seq.last_token_time)
        else:
            seq.first_token_time = now
            h.time_to_first_token.observe(now - seq.request.arrival_time)
        seq.last_token_time = now
        tokens: list[int] = []
        # accepted drafts, then the sampled token; a stop inside the run truncates it
        for token in (*sampled.accepted, sampled.token_id):
            seq.append(token)
            tokens.append(token)
            self.stats.num_generation_tokens += 1
            if not seq.is_finished and seq.num_tokens >= self.config.max_model_len:
                seq.finish("length")
            if seq.is_finished:
                break
        return RequestOutput(
            seq.request_id,
            tokens,
            seq.is_finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            logprobs=None if sampled.logprobs is None else [sampled.logprobs],
            index=seq.index,
            prompt_logprobs=list(seq.prompt_logprobs)
            if seq.prompt_logprobs is not None and seq.num_output_tokens == 1
            else None,
            first_scheduled_time=seq.request.first_scheduled_time,
            stop_token_id=seq.stop_token_id,
            num_cached_tokens=seq.request.num_cached_tokens,
            # sent only when they changed: no call per token
            weight_version_starts=self._weight_starts(seq) if seq.weight_versions_changed else None,
        )

    @staticmethod
    def _weight_starts(seq: Sequence) -> list[tuple[str, int]]:
        seq.weight_versions_changed = False
        return list(seq.weight_version_starts)

    def set_weight_version(self, version: str) -> None:
        """vLLM's ``set_weight_version``: the weights are ``version`` from the next step on;
        the sequences in the engine start a span there."""
        self.weight_version = version
        sched = self.scheduler
        for seq in (*sched.running, *sched.waiting):
            for sample in (seq, *seq.forks):
                weight_versions.switch(sample, version)

    def pool(self, prompts: list[list[int]], tokens: bool = False) -> torch.Tensor:
        """The prompts' pooled final hidden states [len(prompts), hidden] (float32), by the
        model's ``pooler_config``, in one forward pass outside the KV cache. ``tokens``
        (vLLM's ``token_embed``): every token's state instead, the prompts' one after
        another [sum of their lengths, hidden]; a token classifier's every token's logits
        [sum of their lengths, labels] (vLLM's ``token_classify``, its only pooling)."""
        pooling = "ALL" if tokens else self.config.pooler_config.pooling_type
        assert pooling is not None, "resolved when the engine was built"
        if tokens and self.args.num_labels:
            raise KilnError(
                "llm backend: a sequence classifier has no per-token embeddings",
                Status.INVALID_ARG,
            )
        if self.args.is_token_classifier and not tokens:
            raise KilnError(
                f"llm backend: {self.args.architecture} classifies every token: it pools "
                "only with task token_classify",
                Status.INVALID_ARG,
            )
        pooled = self.runner.pool(prompts, pooling)
        for layer in self.projector:  # before any normalization, as vLLM's projector
            pooled = layer(pooled)
        self.stats.num_prompt_tokens += sum(len(p) for p in prompts)
        return pooled

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
