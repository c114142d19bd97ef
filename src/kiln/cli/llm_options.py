"""``kiln serve --model PATH``: a checkpoint served in one command, with vLLM's engine flags.

Each ``--model`` becomes a repository entry built in memory: ``backend: "llm"`` and the
flags as the ``parameters`` a config.pbtxt would give (``kiln.llm.backend.engine_config``
reads both the same way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kiln.cli.observability_options import OBSERVABILITY_FLAGS, OBSERVABILITY_OPTIONS
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError
from kiln.llm.config import ATTENTION_BACKENDS, REASONING_PARSERS, RUNNERS, TOOL_CALL_PARSERS
from kiln.llm.profiler_config import ProfilerConfig

F = TypeVar("F", bound=Callable[..., Any])

#: flag (its Python name) -> the llm backend's parameter key
ENGINE_FLAGS = {
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory": "kv_cache_memory_bytes",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "enforce_eager": "enforce_eager",
    "scheduling_policy": "scheduling_policy",
    "scheduler_reserve_full_isl": "scheduler_reserve_full_isl",
    "watermark": "watermark",
    "chat_template": "chat_template",
    "generation_config": "generation_config",
    "enable_auto_tool_choice": "enable_auto_tool_choice",
    "tool_call_parser": "tool_call_parser",
    "reasoning_parser": "reasoning_parser",
    "speculative_config": "speculative_config",
    "profiler_config": "profiler_config",
    "quantization": "quantization",
    "kv_cache_dtype": "kv_cache_dtype",
    "enable_lora": "enable_lora",
    "lora_modules": "lora_modules",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "max_cpu_loras": "max_cpu_loras",
    "allowed_lora_paths": "allowed_lora_paths",
    "tensor_parallel_size": "tensor_parallel_size",
    "attention_backend": "attention_backend",
    "enable_multiprocessing": "enable_multiprocessing",
    "stream_interval": "stream_interval",
    "max_logprobs": "max_logprobs",
    "seed": "seed",
    "runner": "runner",
    "convert": "convert",
    "task": "task",
    "pooler_config": "pooler_config",
    "tokenizer": "tokenizer",
    "num_gpu_blocks_override": "num_gpu_blocks",
    "default_chat_template_kwargs": "default_chat_template_kwargs",
    "override_generation_config": "override_generation_config",
    "response_role": "response_role",
    "trust_request_chat_template": "trust_request_chat_template",
    "enable_force_include_usage": "enable_force_include_usage",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "chat_template_content_format": "chat_template_content_format",
    "exclude_tools_when_tool_choice_none": "exclude_tools_when_tool_choice_none",
    "sse_keep_alive_interval": "sse_keep_alive_interval",
    "max_num_queued_reqs": "max_num_queued_reqs",
    "max_num_queued_tokens": "max_num_queued_tokens",
    "enable_tokenizer_info_endpoint": "enable_tokenizer_info_endpoint",
    **OBSERVABILITY_FLAGS,
}

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?[bB])?")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class ByteSize(click.ParamType[int, str | int]):
    """Bytes, as vLLM reads them: ``1073741824``, ``4G`` / ``4GiB`` (powers of 1024),
    ``4g`` (powers of 1000)."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = _SIZE.fullmatch(str(value).strip())
        if match is None:
            self.fail(f"'{value}' is not a size in bytes (e.g. 4G, 512M, 1073741824)", param, ctx)
        number, unit, _ = match.groups()
        scale = 1024 ** ("KMGT".index(unit) + 1) if unit.isupper() else _UNITS[unit]
        return int(float(number) * scale)


class TokenCount(click.ParamType[int, str | int]):
    """A count of tokens, as vLLM reads one: ``32768``, ``32k`` (powers of 1000, decimals
    allowed: ``25.6k``), ``32K`` (powers of 1024); with ``auto`` set, ``auto`` and ``-1``
    leave the choice to kiln (None)."""

    name = "tokens"

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int):
            number = value
        else:
            text = str(value).strip()
            if self.auto and text in ("auto", "-1"):
                return None
            match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text)
            if match is None:
                self.fail(f"'{value}' is not a count of tokens (e.g. 4096, 32k, 32K)", param, ctx)
            digits, unit = match.groups()
            if unit.isupper():
                if "." in digits:
                    self.fail(f"'{value}': no decimals with {unit} (powers of 1024)", param, ctx)
                number = int(digits) * 1024 ** ("KMGT".index(unit) + 1)
            else:
                number = int(float(digits) * _UNITS[unit])
        if number < 1:
            self.fail(f"'{value}' is not a positive count of tokens", param, ctx)
        return number


def _json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A flag holding a JSON object, checked when the command line is read."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"must be a JSON object, got {value[:80]!r}")
    return value


def _profiler_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """vLLM's --profiler-config, checked when the command line is read."""
    if value is None:
        return None
    try:
        ProfilerConfig.parse(value)
    except KilnError as exc:
        raise click.BadParameter(
            exc.message.removeprefix("llm backend: profiler_config: ")
        ) from None
    return value


def llm_options(func: F) -> F:
    options = [
        click.option(
            "--model",
            "models",
            multiple=True,
            type=click.Path(exists=True, path_type=Path),
            help="Serve this checkpoint with the llm backend: a Hugging Face folder or a "
            ".gguf file; may repeat. No config.pbtxt needed (docs/llm.md).",
        ),
        click.option(
            "--served-model-name",
            "served_model_names",
            multiple=True,
            help="The API name of each --model, in order [default: the folder's name or "
            "the file's stem].",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "bfloat16", "float16", "float32", "half", "float"]),
            default=None,
            help="Weights and KV cache dtype [default: auto: the checkpoint's on GPU, "
            "float32 on the CPU].",
        ),
        click.option(
            "--max-model-len",
            type=TokenCount(auto=True),
            default=None,
            help="Context length, prompt and output (32k, 32K as vLLM reads them) [default: "
            "auto: the model's].",
        ),
        click.option(
            "--gpu-memory-utilization",
            "--device-memory-utilization",
            type=click.FloatRange(0, 1, min_open=True),
            default=None,
            help="Share of the GPU's memory for weights, activations and KV cache; the KV "
            "cache gets what a profiling pass leaves [default: 0.9].",
        ),
        click.option(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",
            "kv_cache_memory",
            type=ByteSize(),
            default=None,
            help="KV cache size (4G, 512M, bytes) instead of sizing it from the device "
            "[CPU default: 4 GiB or a quarter of free memory, at most what max_num_seqs "
            "full-length sequences fill; logged].",
        ),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=None),
        click.option("--max-num-batched-tokens", type=TokenCount(), default=None),
        click.option("--block-size", type=click.IntRange(min=1), default=None),
        click.option(
            "--enable-prefix-caching/--no-enable-prefix-caching", default=None, show_default=False
        ),
        click.option("--enforce-eager", is_flag=True, default=None),
        click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default=None),
        click.option(
            "--scheduler-reserve-full-isl/--no-scheduler-reserve-full-isl",
            default=None,
            help="Admit a waiting request only when the KV cache holds its whole prompt, not "
            "only its first chunk [default: on, as vLLM's].",
        ),
        click.option(
            "--watermark",
            type=click.FloatRange(0, 1, max_open=True),
            default=None,
            help="Share of KV blocks a waiting or preempted request must leave free to join "
            "a running batch: headroom against preemption thrash [default: 0].",
        ),
        click.option(
            "--max-logprobs",
            type=click.IntRange(min=-1),
            default=None,
            help="The most top alternatives per token a request's logprobs or "
            "prompt_logprobs may ask for; -1: the whole vocabulary [default: 20].",
        ),
        click.option(
            "--max-num-queued-reqs",
            type=click.IntRange(min=0),
            default=None,
            help="Requests in flight (waiting or running; n samples count n) beyond which "
            "a new one is refused with 503, for a client to retry elsewhere [default: "
            "none: kiln's queue of max_num_seqs + 1024].",
        ),
        click.option(
            "--max-num-queued-tokens",
            type=click.IntRange(min=0),
            default=None,
            help="A new request is refused with 503 while requests not yet past prefill "
            "hold this many prompt tokens (a TTFT bound) [default: none].",
        ),
        click.option(
            "--sse-keep-alive-interval",
            type=click.FloatRange(min=0),
            default=None,
            metavar="SECONDS",
            help="A completions or chat stream idle this long (queued, in prefill, between "
            "tokens) sends an SSE comment ': keep-alive', so proxies keep it open "
            "[default: 0: off].",
        ),
        click.option(
            "--enable-scale-out",
            is_flag=True,
            default=False,
            help="Serve vLLM's scale-out API: /v1/*/render, /inference/v1/generate (token "
            "ids in and out), /v1/*/derender and /inference/v1/abort_requests, which ends "
            "any client's generation by id (403 otherwise, as vLLM's).",
        ),
        click.option(
            "--tokens-only",
            is_flag=True,
            default=False,
            help="vLLM's Disaggregated Everything server: the scale-out API whatever "
            "--enable-scale-out says, generate never detokenizes, text in or out is "
            "refused as with vLLM's --skip-tokenizer-init (400), and the legacy POST "
            "/abort_requests is served.",
        ),
        click.option(
            "--enable-tokenizer-info-endpoint",
            is_flag=True,
            default=None,
            help="Serve GET /tokenizer_info: the tokenizer's configuration and chat "
            "template (exposes the template).",
        ),
        click.option(
            "--seed",
            type=int,
            default=None,
            help="Seed torch's generators when the engine starts: requests without a seed "
            "of their own sample the same from one start to the next.",
        ),
        click.option(
            "--stream-interval",
            type=click.IntRange(min=1),
            default=None,
            help="A stream's tokens go out in runs of this many (its first token at once): "
            "fewer events and socket writes per token, for throughput over smoothness "
            "[default: 1].",
        ),
        click.option(
            "--chat-template",
            default=None,
            help="A Jinja chat template, or a file holding one, replacing the model's.",
        ),
        click.option(
            "--default-chat-template-kwargs",
            default=None,
            callback=_json_object,
            metavar="JSON",
            help="The chat template's variables unless a request sets them: "
            "'{\"enable_thinking\": false}'.",
        ),
        click.option(
            "--chat-template-content-format",
            type=click.Choice(["auto", "string", "openai"]),
            default=None,
            help="A chat message's content as the template gets it: string (text parts "
            'joined by newlines) or openai (a list of {"type": "text", "text": ...}) '
            "[default: auto: openai when the template loops over a message's content].",
        ),
        click.option(
            "--exclude-tools-when-tool-choice-none",
            is_flag=True,
            default=None,
            help="tool_choice none: the tools are left out of the prompt (else the "
            "template lists them, and the model is only kept from calling them).",
        ),
        click.option(
            "--trust-request-chat-template",
            is_flag=True,
            default=None,
            help="Requests may bring their own chat_template (rendered in a sandbox; off: "
            "a 400). Only for clients you trust: a template runs loops of their choosing.",
        ),
        click.option(
            "--enable-force-include-usage",
            is_flag=True,
            default=None,
            help="Every stream's last chunk carries usage, whatever its stream_options.",
        ),
        click.option(
            "--return-tokens-as-token-ids",
            is_flag=True,
            default=None,
            help="Logprobs name tokens token_id:<id> unless a request says otherwise.",
        ),
        click.option(
            "--response-role",
            default=None,
            help="A chat answer's role after the generation prompt [default: assistant].",
        ),
        click.option(
            "--tokenizer",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            default=None,
            help="A folder holding the tokenizer, when not the checkpoint's.",
        ),
        click.option(
            "--num-gpu-blocks-override",
            type=click.IntRange(min=1),
            default=None,
            help="KV cache blocks, instead of sizing the cache from memory.",
        ),
        click.option(
            "--override-generation-config",
            default=None,
            callback=_json_object,
            metavar="JSON",
            help="Sampling defaults over generation_config.json's (or alone with "
            "--generation-config vllm): '{\"temperature\": 0.5}'.",
        ),
        click.option(
            "--generation-config",
            default=None,
            help="auto: default sampling values from the model's generation_config.json; "
            "vllm: the engine's; or a folder holding a generation_config.json "
            "[default: auto].",
        ),
        click.option(
            "--enable-auto-tool-choice",
            is_flag=True,
            default=None,
            help="tool_choice auto: the model's tool calls are read from its text with "
            "--tool-call-parser (docs/llm.md, Tool calling).",
        ),
        click.option(
            "--tool-call-parser",
            type=click.Choice(list(TOOL_CALL_PARSERS)),
            default=None,
            help="The model family's tool-call format, as vLLM names it.",
        ),
        click.option(
            "--reasoning-parser",
            type=click.Choice(list(REASONING_PARSERS)),
            default=None,
            help="A thinking model's format: chat answers carry its <think> part as "
            "'reasoning' (docs/llm.md, Reasoning outputs).",
        ),
        click.option(
            "--speculative-config",
            "-sc",
            default=None,
            help='Speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1} '
            'or {"model": DRAFT_FOLDER, "num_speculative_tokens": 4} (docs/llm.md).',
        ),
        click.option(
            "--profiler-config",
            default=None,
            callback=_profiler_config,
            help='vLLM\'s profiler: {"profiler": "torch", "torch_profiler_dir": DIR} serves '
            "POST /start_profile and /stop_profile, which record the engine's steps into a "
            "torch.profiler trace in DIR (docs/llm.md, Profiling).",
        ),
        click.option(
            "--quantization",
            "-q",
            default=None,
            help="The checkpoint's quantization method (fp8, compressed-tensors, awq, gptq, "
            "gguf); must match its quantization_config [default: detected from it].",
        ),
        click.option(
            "--kv-cache-dtype",
            type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
            default=None,
            help="KV cache dtype: auto (the model's) or fp8, halving (bf16) or quartering "
            "(float32) its memory per token; read by the torch attention backend.",
        ),
        click.option(
            "--enable-lora",
            is_flag=True,
            default=None,
            help="Serve LoRA adapters: a request's model names one (docs/llm.md, LoRA).",
        ),
        click.option(
            "--lora-modules",
            multiple=True,
            metavar="NAME=PATH|JSON",
            help='A PEFT adapter folder served as NAME, or vLLM\'s JSON {"name": ..., '
            '"path": ..., "base_model_name": ...}; may repeat.',
        ),
        click.option(
            "--max-loras",
            type=click.IntRange(min=1),
            default=None,
            help="Adapters in one batch (device slots) [default: 1].",
        ),
        click.option(
            "--max-lora-rank",
            type=click.IntRange(min=1),
            default=None,
            help="The largest adapter rank; a larger one is refused [default: 16].",
        ),
        click.option(
            "--max-cpu-loras",
            type=click.IntRange(min=1),
            default=None,
            help="Adapters kept in host memory (others are read again when used) "
            "[default: --max-loras].",
        ),
        click.option(
            "--allowed-lora-path",
            "allowed_lora_paths",
            multiple=True,
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            help="A folder /v1/load_lora_adapter may read adapters from (with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); may repeat [default: none].",
        ),
        click.option(
            "--tensor-parallel-size",
            "-tp",
            type=click.IntRange(min=1),
            default=None,
            help="Split the weights and KV heads over this many ranks (one process each; "
            "GPUs cuda:0..N-1, or gloo on the CPU) [default: 1] (docs/scaling.md).",
        ),
        click.option(
            "--attention-backend",
            type=click.Choice(list(ATTENTION_BACKENDS), case_sensitive=False),
            default=None,
            help="auto, torch, cpu, flex or triton (on CUDA: flex compiled by torch, or "
            "kiln's Triton kernels for decodes, norms, SiLU-mul and RoPE) [default: auto: "
            "flex on CUDA; triton, faster there, is opt-in] (docs/llm.md).",
        ),
        click.option(
            "--runner",
            type=click.Choice(["auto", *RUNNERS]),
            default=None,
            help="pooling: the model serves /v1/embeddings (and /pooling, /score, "
            "/rerank) instead of generating [default: auto: generate, except for a "
            "classifier or an encoder, which pool] (docs/llm.md, Embeddings).",
        ),
        click.option(
            "--convert",
            type=click.Choice(["auto", "none", "embed"]),
            default=None,
            help="embed: a language model served as an embedding model (vLLM's "
            "--convert embed; the same as --runner pooling).",
        ),
        click.option(
            "--task", default=None, hidden=True, help="vLLM's older spelling: embed, generate"
        ),
        click.option(
            "--pooler-config",
            "--override-pooler-config",
            "pooler_config",
            default=None,
            help='How a pooling model pools, as vLLM\'s JSON: {"pooling_type": "MEAN", '
            '"normalize": false} (LAST, MEAN or CLS) [default: the model\'s].',
        ),
        click.option(
            "--enable-multiprocessing/--no-enable-multiprocessing",
            default=None,
            show_default=False,
            help="The engine in its own process (vLLM V1's EngineCore) or on a thread of "
            "the server's [default: VLLM_ENABLE_V1_MULTIPROCESSING, else on].",
        ),
        *OBSERVABILITY_OPTIONS,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def served_aliases(models: tuple[Path, ...], names: tuple[str, ...]) -> dict[str, str]:
    """vLLM's ``--served-model-name a b c`` for one model: it answers to ``b`` and ``c``
    too (alias -> ``a``)."""
    if len(models) != 1 or len(names) < 2:
        return {}
    if len(set(names)) != len(names):
        raise click.BadParameter(
            f"'{next(n for n in names if names.count(n) > 1)}' is given twice",
            param_hint="--served-model-name",
        )
    return {alias: names[0] for alias in names[1:]}


def served_models(
    models: tuple[Path, ...], names: tuple[str, ...], settings: dict[str, Any]
) -> list[ModelConfig]:
    """One in-memory llm config per ``--model``; ``settings``: the engine flags' values. One
    model may have several names, as in vLLM (the first its name, :func:`served_aliases`)."""
    if len(models) == 1:
        names = names[:1]
    if len(names) > len(models):
        raise click.BadParameter(
            f"{len(names)} names for {len(models)} --model: one name per --model (several "
            "names, as vLLM's, for a single --model only)",
            param_hint="--served-model-name",
        )
    given = {k: v for k, v in settings.items() if k in ENGINE_FLAGS and v not in (None, ())}
    if given and not models:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
        raise click.BadParameter(
            f"{flags} apply to --model checkpoints; a config.pbtxt takes them as parameters"
        )
    configs = []
    for i, path in enumerate(models):
        path = path.resolve()
        if path.is_file() and path.suffix != ".gguf":
            raise click.BadParameter(
                f"'{path}' is a file but not a .gguf file", param_hint="--model"
            )
        name = names[i] if i < len(names) else (path.stem if path.is_file() else path.name)
        config = ModelConfig(name=name, backend="llm")
        config.parameters["model_path"].string_value = str(path)
        for key, value in given.items():
            if isinstance(value, Path):
                value = value.resolve()
            if isinstance(value, tuple):  # a repeated flag: a JSON list (paths resolved)
                value = json.dumps([str(Path(v).resolve()) if isinstance(v, Path) else v
                                    for v in value])  # fmt: skip
            text = str(value).lower() if isinstance(value, bool) else str(value)
            config.parameters[ENGINE_FLAGS[key]].string_value = text
        configs.append(config)
    seen = [c.name for c in configs]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise click.BadParameter(
            f"two models named {duplicates[0]}: give --served-model-name for each",
            param_hint="--model",
        )
    return configs
