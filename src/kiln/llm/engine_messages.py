"""What the server process and the engine process (``engine_core.py``) say to each other.

msgpack through msgspec, one frame per message on a socketpair: the server sends every
request, abort, pooling job and LoRA load pending at that moment in one ``Commands`` frame;
the engine answers each step with one ``Step`` frame carrying every request's new tokens
(and, when they changed, its counters and the LoRA loads' answers). Nothing is pickled per
request or per token; the start-up handshake alone pickles the engine's settings, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

# at run time: msgspec reads ``Step``'s annotations (this imports torch, as both sides do)
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.kv_cache_metrics import RESIDENCY_HISTOGRAMS
from kiln.llm.lora import LoRARequest
from kiln.llm.stats import HISTOGRAMS, EngineStats, Histogram

if TYPE_CHECKING:
    from kiln.llm.sequence import SamplingParams
    from kiln.llm.spec_decode import SpecDecodeStats


# ---- server -> engine --------------------------------------------------------------------
class LoRA(msgspec.Struct, array_like=True):
    """A ``LoRARequest``: the adapter a request runs with, or one to load. Its folder was
    checked against ``allowed_lora_paths`` by the server when it was registered."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: list[int]
    #: ``SamplingParams`` as msgspec's builtins (``params_from`` rebuilds it)
    params: dict[str, Any]
    priority: int
    arrival_time: float
    #: the adapter it runs with (the engine reads the folder again if it has not got it,
    #: e.g. after a restart of the engine process)
    lora: LoRA | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    index: int | None = None
    reason: str = "abort"


class Pool(msgspec.Struct, tag=True, array_like=True):
    job_id: int
    priority: int
    prompts: list[list[int]]
    #: every token's state (``token_embed``) instead of one pooled row per prompt
    tokens: bool = False


class CancelPool(msgspec.Struct, tag=True, array_like=True):
    job_id: int


class LoadLoRA(msgspec.Struct, tag=True, array_like=True):
    """vLLM's ``add_lora``: read and check the adapter; answered by a ``LoRALoaded``."""

    token: int
    lora: LoRA


class UnloadLoRA(msgspec.Struct, tag=True, array_like=True):
    lora_int_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Control(msgspec.Struct, tag=True, array_like=True):
    """A development-mode operation (``engine_control``); answered by a ``ControlDone``."""

    token: int
    op: str
    args: dict[str, Any]


Command = Add | Abort | Pool | CancelPool | LoadLoRA | UnloadLoRA | Shutdown | Control


class Commands(msgspec.Struct, array_like=True):
    commands: list[Command]


# ---- engine -> server --------------------------------------------------------------------
class Counts(msgspec.Struct, array_like=True):
    """The scheduler's and block manager's figures the ``vllm:*`` gauges read."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_blocks: int = 0
    #: the adapters of the waiting and the running requests, comma separated (vLLM's
    #: ``lora_requests_info`` labels; empty without LoRA)
    waiting_loras: str = ""
    running_loras: str = ""


class Snapshot(msgspec.Struct, array_like=True):
    """The engine's counters and histograms, as the metrics collector reads them."""

    counts: Counts
    num_steps: int
    num_prompt_tokens: int
    num_prompt_tokens_cached: int
    num_generation_tokens: int
    max_step_tokens: int
    request_success: dict[str, int]
    #: per ``HISTOGRAMS`` entry: (bucket counts, sum, count)
    histograms: list[tuple[list[int], float, int]]
    #: (drafts, draft tokens, accepted tokens, accepted per position), with spec decoding
    spec: tuple[int, int, int, list[int]] | None = None
    #: with --kv-cache-metrics: per ``RESIDENCY_HISTOGRAMS`` entry, as ``histograms``
    residency: list[tuple[list[int], float, int]] | None = None
    #: --enable-mfu-metrics: (FLOPs, bytes read, bytes written) so far, per GPU
    perf: tuple[int, int, int] = (0, 0, 0)
    num_corrupted_reqs: int = 0


class Failed(msgspec.Struct, array_like=True):
    """A request the engine dropped: it could not be added, or its model run failed."""

    request_id: str
    message: str
    status: str  # a ``Status`` name


class Pooled(msgspec.Struct, array_like=True):
    job_id: int
    #: float32 rows, C order: [len(prompts), hidden] (``tokens``: [sum of the prompts'
    #: lengths, hidden]); empty with ``error``
    data: bytes = b""
    rows: int = 0
    error: str = ""


class LoRALoaded(msgspec.Struct, array_like=True):
    """A ``LoadLoRA``'s answer: empty ``message`` when the adapter was read and kept."""

    token: int
    message: str = ""
    status: str = ""  # a ``Status`` name, with ``message``


class ControlDone(msgspec.Struct, array_like=True):
    """A ``Control``'s answer: its result, or (``message``) why it was refused."""

    token: int
    result: dict[str, Any] = {}
    message: str = ""
    status: str = ""  # a ``Status`` name, with ``message``


class Step(msgspec.Struct, array_like=True):
    outputs: list[RequestOutput]
    failed: list[Failed] = []
    pooled: list[Pooled] = []
    snapshot: Snapshot | None = None
    loras: list[LoRALoaded] = []
    controls: list[ControlDone] = []


# ---- helpers -------------------------------------------------------------------------------
def params_to(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(params)
    return out


def params_from(raw: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` from ``params_to``'s dict (msgspec cannot resolve its
    annotations, which name types imported only for type checking)."""
    from kiln.llm.sequence import SamplingParams
    from kiln.llm.structured import StructuredOutputsParams

    so = raw.get("structured_outputs")
    return SamplingParams(
        **{
            **raw,
            "stop_token_ids": tuple(raw.get("stop_token_ids", ())),
            "allowed_token_ids": tuple(raw.get("allowed_token_ids", ())),
            "reasoning_end": tuple(raw.get("reasoning_end", ())),
            "reasoning_start": tuple(raw.get("reasoning_start", ())),
            "logprob_token_ids": tuple(raw.get("logprob_token_ids", ())),
            "logit_bias": tuple((int(t), float(b)) for t, b in raw.get("logit_bias", ())),
            "bad_words_token_ids": tuple(tuple(w) for w in raw.get("bad_words_token_ids", ())),
            "structured_outputs": None if so is None else StructuredOutputsParams(**so),
        }
    )


def lora_to(request: LoRARequest) -> LoRA:
    return LoRA(request.lora_name, request.lora_int_id, request.lora_path,
                request.base_model_name)  # fmt: skip


def lora_from(lora: LoRA | None) -> LoRARequest | None:
    if lora is None:
        return None
    return LoRARequest(lora.lora_name, lora.lora_int_id, lora.lora_path, lora.base_model_name)


def counts(engine: LLMEngine) -> Counts:
    sched, blocks = engine.scheduler, engine.block_manager
    waiting, running = engine.loras_in_use() if engine.config.lora_config is not None else ("", "")
    return Counts(
        len(sched.running),
        len(sched.waiting),
        sched.num_preemptions,
        blocks.usage(),
        blocks.stats.queries,
        blocks.stats.hits,
        blocks.num_blocks,
        waiting,
        running,
    )


def _read(h: Histogram) -> tuple[list[int], float, int]:
    with h.lock:
        return list(h.counts), h.total, h.count


def _write(h: Histogram, figures: tuple[list[int], float, int]) -> None:
    bucket_counts, total, count = figures
    with h.lock:
        h.counts, h.total, h.count = list(bucket_counts), total, count


def snapshot(engine: LLMEngine) -> Snapshot:
    stats = engine.stats
    hists = [_read(getattr(stats.histograms, attr)) for _, _, attr in HISTOGRAMS]
    kv = stats.kv_residency
    residency = None
    if kv is not None:
        residency = [_read(getattr(kv, attr)) for _, _, attr in RESIDENCY_HISTOGRAMS]
    spec = engine.spec_stats
    spec_counts = None
    if spec is not None:
        spec_counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                       list(spec.accepted_per_pos))  # fmt: skip
    return Snapshot(
        counts(engine),
        stats.num_steps,
        stats.num_prompt_tokens,
        stats.num_prompt_tokens_cached,
        stats.num_generation_tokens,
        stats.max_step_tokens,
        dict(stats.request_success),
        hists,
        spec_counts,
        residency,
        (stats.estimated_flops, stats.estimated_read_bytes, stats.estimated_write_bytes),
        stats.num_corrupted_reqs,
    )


def apply_snapshot(snap: Snapshot, stats: EngineStats, spec: SpecDecodeStats | None) -> None:
    """Copy the engine process's figures into the server's mirror of them."""
    stats.num_steps = snap.num_steps
    stats.num_prompt_tokens = snap.num_prompt_tokens
    stats.num_prompt_tokens_cached = snap.num_prompt_tokens_cached
    stats.num_generation_tokens = snap.num_generation_tokens
    stats.max_step_tokens = snap.max_step_tokens
    stats.request_success = dict(snap.request_success)
    for (_, _, attr), figures in zip(HISTOGRAMS, snap.histograms, strict=True):
        _write(getattr(stats.histograms, attr), figures)
    kv = stats.kv_residency
    if kv is not None and snap.residency is not None:
        for (_, _, attr), figures in zip(RESIDENCY_HISTOGRAMS, snap.residency, strict=True):
            _write(getattr(kv, attr), figures)
    stats.estimated_flops, stats.estimated_read_bytes, stats.estimated_write_bytes = snap.perf
    stats.num_corrupted_reqs = snap.num_corrupted_reqs
    if spec is not None and snap.spec is not None:
        spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens = snap.spec[:3]
        spec.accepted_per_pos = list(snap.spec[3])


ENCODER = msgspec.msgpack.Encoder()
COMMANDS = msgspec.msgpack.Decoder(Commands)
STEP = msgspec.msgpack.Decoder(Step)
