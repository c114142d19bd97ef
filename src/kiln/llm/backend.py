"""``backend: "llm"``: a Hugging Face folder served by kiln's engine.

The version folder (``<repository>/<model>/1/``), or the ``model_path`` parameter, is a
Hugging Face folder (``config.json``, ``*.safetensors``, the tokenizer files) or a ``.gguf``
file. Requests come through the OpenAI frontend (``/v1/*``), Triton's generate extension
(``/v2/models/{m}/generate``), or core (KServe v2 ``infer`` and gRPC ``ModelStreamInfer``)
with Triton's vLLM-backend tensors (``triton_tensors.py``).

``backend: "vllm"``: a Triton vLLM-backend folder, whose ``1/model.json`` holds vLLM engine
arguments (``model_json.py``), served by the same engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from contextlib import aclosing
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kiln.backends.base import (
    Backend,
    BackendRequest,
    InstanceSpec,
    RequestOutcome,
    count_parameter,
    parameter,
)
from kiln.backends.gpus import torch_gpu_count
from kiln.config.model_config_pb2 import ModelConfig, ModelInstanceGroup
from kiln.core.errors import KilnError, Status
from kiln.llm import model_json, triton_tensors
from kiln.llm.async_engine import AsyncEngine
from kiln.llm.checkpoint import (
    FolderCheckpoint,
    generation_eos_ids,
    open_checkpoint,
    sampling_defaults,
    task_instructions,
)
from kiln.llm.config import REASONING_PARSERS, TOOL_CALL_PARSERS, EngineConfig, PoolerConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.engine_core import EngineInit, build_engine
from kiln.llm.engine_messages import Counts, counts
from kiln.llm.engine_proc import EngineProcClient
from kiln.llm.lora import LoRARegistry, LoRARequest, check_allowed_path, lora_config
from kiln.llm.observability import ObservabilityConfig
from kiln.llm.params import InvalidField, sampling_fields
from kiln.llm.parser_metrics import ToolParserInvocations
from kiln.llm.profiler_config import ProfilerConfig
from kiln.llm.spec_config import SpeculativeConfig
from kiln.llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_INT_PARAMETERS = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_gpu_blocks",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_waiting",
    "tensor_parallel_size",
    "stream_interval",
    "max_logprobs",
    "seed",
)
#: vLLM's spellings of the dtypes
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
#: the engine in its own process unless a model or the environment says otherwise
DEFAULT_MULTIPROCESSING = True
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def engine_config(config: ModelConfig, instance: InstanceSpec) -> EngineConfig:
    out = EngineConfig()
    numbers = ((_INT_PARAMETERS, int, "an integer"),
               (("gpu_memory_utilization", "watermark"), float, "a number"))  # fmt: skip
    for keys, convert, kind in numbers:
        for key in keys:
            raw = parameter(config, key)
            if raw is None:
                continue
            try:
                setattr(out, key, convert(raw))
            except ValueError:
                raise KilnError(
                    f"model '{config.name}': parameter {key} must be {kind}, got '{raw}'",
                    Status.INVALID_ARG,
                ) from None
    dtype = (parameter(config, "dtype") or out.dtype).strip().lower()
    out.dtype = _DTYPE_ALIASES.get(dtype, dtype)
    for key in ("chat_template", "generation_config"):
        raw = parameter(config, key)
        if raw:
            setattr(out, key, raw)
    for key in ("enable_prefix_caching", "enforce_eager", "scheduler_reserve_full_isl",
                "batch_invariant"):  # fmt: skip
        if parameter(config, key) is not None:
            setattr(out, key, flag_parameter(config, key))
    backend = parameter(config, "attention_backend")
    if backend is not None:
        out.attention_backend = backend.strip().lower()
    sizes = parameter(config, "cuda_graph_sizes")
    if sizes is not None:
        try:
            out.cuda_graph_sizes = tuple(int(s) for s in sizes.replace(",", " ").split())
        except ValueError:
            raise KilnError(
                f"model '{config.name}': parameter cuda_graph_sizes must be integers "
                f"separated by commas or spaces, got '{sizes}'",
                Status.INVALID_ARG,
            ) from None
    quantization = parameter(config, "quantization")
    if quantization is not None:
        out.quantization = quantization.strip().lower() or "auto"
    kv_dtype = parameter(config, "kv_cache_dtype")
    if kv_dtype is not None:
        out.kv_cache_dtype = kv_dtype.strip().lower() or "auto"
    policy = parameter(config, "scheduling_policy")
    if policy is not None:
        out.scheduling_policy = policy.strip().lower()
    for key, parse in (("speculative_config", SpeculativeConfig.from_json),
                       ("profiler_config", ProfilerConfig.parse)):  # fmt: skip
        raw = parameter(config, key)
        if raw:
            try:
                setattr(out, key, parse(raw))
            except KilnError as exc:
                message = str(exc).removeprefix("llm backend: ")
                raise KilnError(f"model '{config.name}': {message}", Status.INVALID_ARG) from None
    # vLLM's admission limits (None: off; 0 refuses every request, as vLLM's does)
    out.max_num_queued_reqs = count_parameter(config, "max_num_queued_reqs", "requests")
    out.max_num_queued_tokens = count_parameter(config, "max_num_queued_tokens", "tokens")
    out.device = _device(config, instance)
    _pooling(config, out)
    out.lora_config = lora_config(lambda key: parameter(config, key), config.name)
    out.observability = ObservabilityConfig.from_parameters(
        lambda key: parameter(config, key), config.name
    )
    return out


def _pooling(config: ModelConfig, out: EngineConfig) -> None:
    """vLLM's ``--runner pooling`` (or its older ``--task embed``, or ``--convert embed``)
    and ``--pooler-config``, as parameters: ``runner``, ``task``, ``convert``,
    ``pooler_config`` (its JSON), or ``pooling_type`` and ``normalize`` one by one."""
    name = config.name
    runner = (parameter(config, "runner") or "generate").strip().lower()
    if runner == "auto":  # vLLM's default: a classifier or an encoder pools all the same
        runner = "generate"
    for key, value in (("task", "embed"), ("convert", "embed")):
        raw = parameter(config, key)
        if raw is None:
            continue
        raw = raw.strip().lower()
        if raw == value:
            runner = "pooling"
        elif raw not in ("generate", "auto", "none"):
            raise KilnError(
                f"model '{name}': parameter {key} '{raw}' is not supported by kiln "
                f"('{value}' for embeddings, or 'generate')",
                Status.INVALID_ARG,
            )
    out.runner = runner
    pooler = parameter(config, "pooler_config") or parameter(config, "override_pooler_config")
    pooler_config = PoolerConfig.from_json(pooler) if pooler else PoolerConfig()
    pooling_type = parameter(config, "pooling_type")
    normalize = parameter(config, "normalize")
    if normalize is not None and _BOOLEANS.get(normalize.strip().lower()) is None:
        raise KilnError(
            f"model '{name}': parameter normalize must be true or false, got '{normalize}'",
            Status.INVALID_ARG,
        )
    out.pooler_config = PoolerConfig(
        pooling_type.strip().upper() if pooling_type else pooler_config.pooling_type,
        pooler_config.normalize if normalize is None else _BOOLEANS[normalize.strip().lower()],
    )


def flag_parameter(config: ModelConfig, key: str) -> bool:
    """A true/false parameter (false when unset)."""
    raw = parameter(config, key)
    return False if raw is None else _boolean(config, raw, f"parameter {key}")


def _boolean(config: ModelConfig, raw: str, source: str) -> bool:
    value = _BOOLEANS.get(raw.strip().lower())
    if value is None:
        raise KilnError(
            f"model '{config.name}': {source} must be true or false, got '{raw}'",
            Status.INVALID_ARG,
        )
    return value


def json_object(config: ModelConfig, key: str) -> dict[str, Any]:
    """A parameter holding a JSON object ({} when unset)."""
    raw = parameter(config, key)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise KilnError(
            f"model '{config.name}': parameter {key} is not JSON: {exc}", Status.INVALID_ARG
        ) from None
    if not isinstance(value, dict):
        raise KilnError(
            f"model '{config.name}': parameter {key} must be a JSON object, got {raw[:80]!r}",
            Status.INVALID_ARG,
        )
    return value


#: vLLM's ``--chat-template-content-format`` choices
CONTENT_FORMATS = ("auto", "string", "openai")


def content_format(config: ModelConfig) -> str:
    """Parameter ``chat_template_content_format``: how a chat message's ``content`` is
    given to the template (``auto``: as the template reads it)."""
    raw = (parameter(config, "chat_template_content_format") or "auto").strip().lower()
    if raw not in CONTENT_FORMATS:
        raise KilnError(
            f"model '{config.name}': parameter chat_template_content_format must be one of "
            f"{', '.join(CONTENT_FORMATS)}, got '{raw[:80]}'",
            Status.INVALID_ARG,
        )
    return raw


def keep_alive_interval(config: ModelConfig) -> float:
    """Parameter ``sse_keep_alive_interval``: seconds (0: off)."""
    raw = parameter(config, "sse_keep_alive_interval")
    if raw is None or not raw.strip():
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise KilnError(
            f"model '{config.name}': parameter sse_keep_alive_interval must be a non-negative "
            f"number of seconds (0: off), got '{raw[:80]}'",
            Status.INVALID_ARG,
        )
    return value


def tool_calling(config: ModelConfig) -> tuple[bool, str | None]:
    """Parameters ``enable_auto_tool_choice`` and ``tool_call_parser``, checked as vLLM
    checks its flags: auto tool choice needs a parser."""
    enabled = flag_parameter(config, "enable_auto_tool_choice")
    parser = _parser(config, "tool_call_parser", TOOL_CALL_PARSERS)
    if enabled and parser is None:
        raise KilnError(
            f"model '{config.name}': enable_auto_tool_choice needs tool_call_parser "
            f"(--tool-call-parser {'|'.join(TOOL_CALL_PARSERS)})",
            Status.INVALID_ARG,
        )
    return enabled, parser


def reasoning_parser(config: ModelConfig) -> str | None:
    """Parameter ``reasoning_parser`` (vLLM's ``--reasoning-parser``): the format the
    OpenAI frontend splits a thinking model's answer by."""
    return _parser(config, "reasoning_parser", REASONING_PARSERS)


def _parser(config: ModelConfig, key: str, names: tuple[str, ...]) -> str | None:
    """Parameter ``key``: one of ``names`` (a parser kiln has), or unset."""
    raw = parameter(config, key)
    name = raw.strip() if raw else None
    if name is not None and name not in names:
        raise KilnError(
            f"model '{config.name}': {key} '{name}' is not one kiln has ({', '.join(names)})",
            Status.INVALID_ARG,
        )
    return name


def enable_multiprocessing(config: ModelConfig) -> bool:
    """Parameter ``enable_multiprocessing`` (``kiln serve --[no-]enable-multiprocessing``):
    the engine in its own process (vLLM V1's EngineCore) or on a thread of the server's.
    Unset: vLLM's switch, the environment's ``VLLM_ENABLE_V1_MULTIPROCESSING`` (``0``: a
    thread), else on (docs/design/llm-engine-process.md has the measurement)."""
    raw = parameter(config, "enable_multiprocessing")
    source = "parameter enable_multiprocessing"
    if raw is None:
        raw = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        source = "VLLM_ENABLE_V1_MULTIPROCESSING"
    if raw is None:
        return DEFAULT_MULTIPROCESSING
    return _boolean(config, raw, source)


def _threads() -> int:
    """The engine process's intra-op threads: ``OMP_NUM_THREADS`` when set, else one per
    CPU (0)."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    return int(raw) if raw.isdigit() else 0


def _device(config: ModelConfig, instance: InstanceSpec) -> str:
    """The instance's device; ``KIND_MODEL`` (the model decides, as Triton's vLLM backend's
    sample config asks): GPU 0 when torch sees one."""
    if instance.kind == "gpu":
        return f"cuda:{instance.device_id}"
    kinds = {g.kind for g in config.instance_group}
    if ModelInstanceGroup.KIND_MODEL in kinds and torch_gpu_count():
        return "cuda:0"
    return "cpu"


class LLMBackend(Backend):
    name = "llm"
    platforms: ClassVar[tuple[str, ...]] = ()
    #: One engine serves the model (the routes use the first instance): a ``KIND_GPU``
    #: group without ``gpus`` runs on GPU 0 alone, not on every GPU.
    spread_over_gpus: ClassVar[bool] = False
    #: requests reach the engine unmerged, each with its response sink (decoupled)
    wants_requests: ClassVar[bool] = True
    #: KServe ``infer`` gets the whole output as one response even though the model
    #: streams on ``ModelStreamInfer`` (Triton would refuse it; a vLLM client may send it)
    infer_when_decoupled: ClassVar[bool] = True
    #: the engine runs the requests started on it at once (continuous batching)
    runs_concurrently: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        super().__init__(config, version_dir, instance)
        if instance.total_instances > 1:
            # Each instance would load the weights and reserve its KV cache, and the
            # routes serve from the first: the others would hold memory for nothing.
            raise KilnError(
                f"model '{config.name}': the llm backend runs one engine per model, and "
                f"instance_group asks for {instance.total_instances} instances; set one "
                "instance (count: 1, one GPU in gpus), and serve the same weights under "
                "another model name for a second engine",
                Status.INVALID_ARG,
            )
        folder, tokenizer, settings = self._settings(config, version_dir, instance)
        settings.served_model_name = config.name  # named by a tensor-parallel worker's errors
        #: vLLM's ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (the frontend's)
        self.enable_auto_tool_choice, self.tool_call_parser = tool_calling(config)
        #: ``vllm:tool_call_parser_invocations`` (None: no parser, no family, as vLLM)
        self.tool_parser_invocations = ToolParserInvocations() if self.tool_call_parser else None
        #: vLLM's ``--reasoning-parser`` (the frontend's too)
        self.reasoning_parser = reasoning_parser(config)
        #: vLLM's ``--default-chat-template-kwargs``: the template's variables a request's
        #: ``chat_template_kwargs`` (or ``reasoning_effort``) may override
        self.default_chat_template_kwargs = json_object(config, "default_chat_template_kwargs")
        #: vLLM's ``--response-role``: a chat answer's role after the generation prompt
        self.response_role = (parameter(config, "response_role") or "assistant").strip()
        #: an embedding model's prefixes by task (Cohere's ``input_type``)
        self.task_instructions = task_instructions(folder)
        #: vLLM's ``--trust-request-chat-template``: a request's chat_template is rendered
        self.trust_request_chat_template = flag_parameter(config, "trust_request_chat_template")
        #: vLLM's ``--enable-force-include-usage`` and ``--return-tokens-as-token-ids``
        self.force_include_usage = flag_parameter(config, "enable_force_include_usage")
        self.return_tokens_as_token_ids = flag_parameter(config, "return_tokens_as_token_ids")
        #: vLLM's ``--chat-template-content-format``: ``auto``, ``string`` or ``openai``
        self.chat_template_content_format = content_format(config)
        #: vLLM's ``--exclude-tools-when-tool-choice-none``: ``tool_choice: none`` renders
        #: the prompt without the tools
        self.exclude_tools_when_tool_choice_none = flag_parameter(
            config, "exclude_tools_when_tool_choice_none"
        )
        #: vLLM's ``--sse-keep-alive-interval``: seconds of an idle stream before a comment
        self.sse_keep_alive_interval = keep_alive_interval(config)
        #: vLLM's ``--enable-tokenizer-info-endpoint``: ``GET /tokenizer_info`` answers
        self.enable_tokenizer_info_endpoint = flag_parameter(
            config, "enable_tokenizer_info_endpoint"
        )
        # the tokenizer first: its errors come before minutes of weight loading
        self.tokenizer = Tokenizer.load(tokenizer, settings.chat_template)
        generation = self._generation_config(settings.generation_config, folder)
        # vLLM's --override-generation-config: over the checkpoint's (auto) or alone (vllm)
        override = json_object(config, "override_generation_config")
        try:
            sampling_fields(sampling_defaults(override))
        except InvalidField as exc:
            raise KilnError(
                f"model '{config.name}': override_generation_config: {exc.message}",
                Status.INVALID_ARG,
            ) from None
        generation = {**generation, **override}
        #: request fields' defaults from generation_config.json (vLLM's ``auto``)
        self.sampling_defaults = sampling_defaults(generation)
        #: generation_config.json's ``max_new_tokens``: vLLM bounds every request's
        #: ``max_tokens`` by it (given or defaulted)
        limit = generation.get("max_new_tokens")
        self.max_new_tokens = limit if isinstance(limit, int) and limit > 0 else None
        if self.sampling_defaults or self.max_new_tokens:
            log.info(
                "model '%s': default sampling values from generation_config.json: %s, "
                "max_new_tokens %s (--generation-config vllm to use the engine's)",
                config.name,
                self.sampling_defaults,
                self.max_new_tokens,
            )
        # chat models often end turns with the tokenizer's eos or generation_config's
        # eos ids, not config.json's
        extra_eos = (self.tokenizer.eos_token_id, *generation_eos_ids(generation))
        #: the engine process (None: the engine runs on a thread of this process)
        self.engine_proc: EngineProcClient | None = None
        self.async_engine: AsyncEngine | EngineProcClient
        self.engine: LLMEngine
        if enable_multiprocessing(config):
            init = EngineInit(config.name, folder, tokenizer, settings, extra_eos, _threads())
            self.engine_proc = EngineProcClient(init, self.tokenizer)
            self.engine = self.engine_proc.view
            self.async_engine = self.engine_proc
        else:
            self.engine = build_engine(folder, self.tokenizer, settings, extra_eos)
            self.async_engine = AsyncEngine(self.engine, config.name)
        #: the adapters served by name (vLLM's ``--lora-modules``; None: no ``enable_lora``)
        self.loras: LoRARegistry | None = None
        lora = self.engine.config.lora_config
        if lora is not None:
            self.loras = LoRARegistry()
            try:
                for module in lora.lora_modules:
                    self.add_lora(module.name, module.path, module.base_model_name)
            except BaseException:
                self.async_engine.close()
                raise
        # as many requests started at once as the engine holds (running and waiting)
        self.pipeline_depth = self.engine.config.max_num_seqs + self.engine.config.max_waiting

    def add_lora(
        self, name: str, path: str, base: str | None = None, runtime: bool = False
    ) -> LoRARequest:
        """Check and load a PEFT adapter and serve it as ``name``; ``runtime``: a client's
        ``/v1/load_lora_adapter``, whose folder must lie in ``allowed_lora_paths``."""
        model = self.config.name
        lora = self.engine.config.lora_config
        if self.loras is None or lora is None:
            raise KilnError(
                f"model '{model}': LoRA is not enabled (--enable-lora)", Status.INVALID_ARG
            )
        if name == model or not name.strip():
            raise KilnError(
                f"LoRA adapter name '{name}' is the base model's or empty", Status.INVALID_ARG
            )
        self.loras.check_new(name)
        if runtime:
            path = str(check_allowed_path(path, lora.allowed_paths))
        if base is not None and base != model:
            raise KilnError(
                f"LoRA adapter '{name}': its base_model_name is '{base}', but it would be "
                f"served on model '{model}'",
                Status.INVALID_ARG,
            )
        request = LoRARegistry.new_request(name, path, base or model)
        (self.engine_proc or self.engine).add_lora(request)
        self.loras.add(request)
        log.info("model '%s': LoRA adapter '%s' from %s", model, name, path)
        return request

    def remove_lora(self, name: str) -> None:
        if self.loras is None:
            raise KilnError(
                f"model '{self.config.name}': LoRA is not enabled (--enable-lora)",
                Status.INVALID_ARG,
            )
        request = self.loras.remove(name)
        (self.engine_proc or self.engine).remove_lora(request.lora_int_id)

    @classmethod
    def _settings(
        cls, config: ModelConfig, version_dir: Path, instance: InstanceSpec
    ) -> tuple[Path, Path, EngineConfig]:
        """The weights' folder, the tokenizer's (vLLM's ``--tokenizer``: another folder),
        and the engine's settings."""
        folder = Path(parameter(config, "model_path", "") or version_dir)
        given = parameter(config, "tokenizer", "")
        tokenizer = Path(given) if given else folder  # a .gguf file holds its own
        if given and not tokenizer.is_dir():
            raise KilnError(
                f"model '{config.name}': parameter tokenizer '{tokenizer}' is not a folder "
                "(kiln reads local tokenizers: tokenizer.json and tokenizer_config.json)",
                Status.INVALID_ARG,
            )
        return folder, tokenizer, engine_config(config, instance)

    @classmethod
    def auto_complete_config(cls, config: ModelConfig, version_dir: Path) -> None:
        triton_tensors.auto_complete(config)

    def _generation_config(self, mode: str, folder: Path) -> dict[str, Any]:
        if mode == "vllm":
            return {}
        if mode == "auto":
            return open_checkpoint(folder).generation_config()
        path = Path(mode) / "generation_config.json"
        if not path.is_file():
            raise KilnError(
                f"model '{self.config.name}': generation_config must be auto, vllm or a "
                f"folder holding generation_config.json; {path} does not exist",
                Status.INVALID_ARG,
            )
        return FolderCheckpoint(Path(mode)).generation_config()

    @classmethod
    def gpu_count(cls) -> int:
        return torch_gpu_count()

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        raise KilnError(  # requests come one by one (start_requests), never merged
            f"model '{self.config.name}' takes requests one by one", Status.INTERNAL
        )

    def start_requests(
        self, requests: list[BackendRequest]
    ) -> asyncio.Future[list[RequestOutcome]]:
        """On the loop: each request runs as its own task, its tokens streamed from the
        engine's thread; the future resolves once every one has answered."""
        loop = asyncio.get_running_loop()
        tasks = []
        for request in requests:
            task = loop.create_task(self._serve(request))
            add = getattr(request, "add_cancel_callback", None)
            if add is not None:  # the client went away: the engine aborts the sequence
                add(task.cancel)
            tasks.append(task)
        return asyncio.gather(*tasks)

    async def _serve(self, request: BackendRequest) -> RequestOutcome:
        sink = request.sink
        try:
            req = await asyncio.to_thread(
                triton_tensors.parse, self, request.inputs, request.parameters, sink is not None
            )
            whole: dict[str, np.ndarray] = {}
            async with aclosing(triton_tensors.generate(self, req)) as responses:
                async for outputs, final in responses:
                    if sink is None:
                        whole = outputs
                    else:
                        sink.send(outputs, final, None)
            return whole
        except KilnError as exc:
            return exc
        except asyncio.CancelledError:
            return KilnError(f"model '{self.config.name}': request cancelled", Status.CANCELLED)

    def engine_counts(self) -> Counts:
        """The scheduler's and block manager's figures for the ``vllm:*`` gauges."""
        if self.engine_proc is not None:
            return self.engine_proc.view.counts
        return counts(self.engine)

    def close(self) -> None:
        self.async_engine.close()


class VLLMBackend(LLMBackend):
    """``backend: "vllm"``: Triton's vLLM-backend model folder on kiln's engine."""

    name = "vllm"

    @classmethod
    def _settings(
        cls, config: ModelConfig, version_dir: Path, instance: InstanceSpec
    ) -> tuple[Path, Path, EngineConfig]:
        read = model_json.load(config.name, version_dir)
        read.engine.device = _device(config, instance)
        return read.folder, read.tokenizer, read.engine
