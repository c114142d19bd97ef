"""Server: the repository, the loaded runtimes and server-wide state.

Frontends translate wire formats into calls on this object and never touch a backend.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.backends import host
from kiln.backends.registry import LLM_BACKENDS
from kiln.cache import open_cache
from kiln.cache.config import CacheConfig
from kiln.config.loader import config_to_json
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.signature import check_request_limits
from kiln.core.activity import Activity
from kiln.core.classification import classify, requested_count
from kiln.core.errors import KilnError, Status, invalid_arg, not_found
from kiln.core.limits import check_parameters
from kiln.core.settings import LogSettings, TraceSettings
from kiln.core.shm import MAX_REGIONS, SharedMemoryManager
from kiln.core.trace import Tracer
from kiln.core.trace_otel import OtelOptions
from kiln.core.types import InferenceRequest, InferenceResponse
from kiln.llm.engine_client import EngineClient, FinishedHook
from kiln.repository.load_files import DEFAULT_LOAD_FILE_BYTES, check_files
from kiln.repository.manager import RepositoryManager
from kiln.repository.poll import RepositoryPoller
from kiln.repository.safety import check_model_name
from kiln.repository.source import RepositoryError, RepositorySource
from kiln.scheduling.rate_limit import RateLimiter, ResourceOverride
from kiln.server.rollout import CLIENT_STATUSES, ModelRollout, Rollouts
from kiln.server.rollout_policy import check_config
from kiln.server.runtime import ModelRuntime, runtime_factory

log = logging.getLogger(__name__)


class ControlMode(enum.Enum):
    NONE = "none"
    EXPLICIT = "explicit"
    POLL = "poll"


# Exactly what kiln implements; grows with each protocol extension that lands.
EXTENSIONS = [
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "system_shared_memory",
    "classification",
    "sequence",
    "trace",
    "logging",
]


@dataclass
class ServerOptions:
    model_repositories: list[Path | RepositorySource]  # a folder, or a bucket (s3://)
    model_control_mode: ControlMode = ControlMode.NONE
    load_models: list[str] = field(default_factory=list)
    strict_readiness: bool = True
    exit_timeout_secs: float = 30.0
    max_request_bytes: int = 64 * 1024 * 1024
    repository_poll_secs: float = 15.0
    cache: CacheConfig | None = None  # --cache-config; None: no response cache at all
    max_input_tensors: int = 0  # --max-input-tensors; 0: no limit (Triton has none)
    max_tensor_elements: int = 0  # --max-tensor-elements; 0: no limit
    auto_complete_config: bool = True  # False: --disable-auto-complete-config
    rate_limit: bool = False  # --rate-limit=execution_count
    rate_limit_resources: list[ResourceOverride] = field(default_factory=list)
    # --trace-config / --trace-file ...: the starting global trace settings
    trace: TraceSettings = field(default_factory=TraceSettings)
    trace_otel: OtelOptions | None = None  # mode=opentelemetry: the exporter's options
    max_shm_regions: int = MAX_REGIONS  # --max-shm-regions
    #: --max-load-file-bytes: decoded ``file:`` load contents held at once (0: no limit)
    max_load_file_bytes: int = DEFAULT_LOAD_FILE_BYTES
    allow_shm_other_owners: bool = False  # --allow-shm-other-owners
    #: ``kiln serve --model``: llm configs built in memory (``model_path`` names each)
    served_models: list[ModelConfig] = field(default_factory=list)
    #: vLLM's several ``--served-model-name`` for one model: other name -> the model's
    llm_aliases: dict[str, str] = field(default_factory=dict)
    #: vLLM's ``--enable-scale-out``: render, generate (token ids), derender and abort are
    #: served (403 otherwise)
    enable_scale_out: bool = False
    #: vLLM's ``--tokens-only``: the scale-out API whatever ``enable_scale_out`` says,
    #: generate never detokenizes, and the OpenAI routes answer as vLLM's do without a
    #: tokenizer (``skip_tokenizer_init``: text in or out is a 400); kiln's tokenizer stays
    #: loaded inside (stop tokens, EOS, the scale-out checks)
    tokens_only: bool = False
    #: seeds the rollouts' weighted draws and shadow sampling (None: from the OS); tests
    rollout_seed: int | None = None
    #: Triton's --exit-on-error: a model named at start that fails to load stops the server
    exit_on_error: bool = False
    #: Triton's --http-header-forward-pattern / --grpc-header-forward-pattern: headers whose
    #: name matches become string request parameters (kiln.core.header_forward)
    http_header_forward_pattern: str = ""
    grpc_header_forward_pattern: str = ""


class Server:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.response_cache = open_cache(options.cache) if options.cache else None
        self._opened = False
        self.failed_at_start: dict[str, str] = {}
        self.tracer = Tracer(options.trace, options.trace_otel)
        # Requests in flight across every model, counted by the runtimes: a backend reads it
        # to tell a lone request from a busy server (inline calls, busy-polling a worker).
        self.activity = Activity()
        limiter = RateLimiter(options.rate_limit_resources) if options.rate_limit else None
        self.repository = RepositoryManager(
            options.model_repositories,
            runtime_factory(self.response_cache, limiter, self.tracer, self.activity),
            drain_timeout=options.exit_timeout_secs,
            auto_complete=options.auto_complete_config,
            served=options.served_models,
            config_check=check_config,
            max_load_file_bytes=options.max_load_file_bytes,
        )
        # weighted splits, shadows and canaries between versions (server/rollout.py)
        self.rollouts = Rollouts(random.Random(options.rollout_seed))
        self.rollouts.llm_generate = self._llm_shadow
        self.shm = SharedMemoryManager(
            max_regions=options.max_shm_regions,
            allow_other_owners=options.allow_shm_other_owners,
        )
        self.poller: RepositoryPoller | None = None
        if options.model_control_mode is ControlMode.POLL:
            self.poller = RepositoryPoller(self.repository, options.repository_poll_secs)
        self.live = True
        self.shutting_down = False
        self.started = False
        self.log_settings = LogSettings()

    # ---- lifecycle -------------------------------------------------------------------
    async def open(self) -> None:
        """Reach what the server needs before any model loads: a shared response cache
        that cannot be reached raises ``CacheConfigError`` naming it (once is enough)."""
        if self.response_cache is not None and not self._opened:
            await self.response_cache.open()
            self._opened = True

    async def start(self) -> None:
        # Python models call other models (BLS) through this server's infer: injected into
        # the backends layer, which never imports the server.
        host.install(self.infer, asyncio.get_running_loop(), self.infer_stream, self)
        await self.open()
        mode = self.options.model_control_mode
        if mode in (ControlMode.NONE, ControlMode.POLL) or "*" in self.options.load_models:
            try:  # a bucket's listing: network I/O
                await asyncio.get_running_loop().run_in_executor(None, self.repository.refresh)
            except RepositoryError as exc:  # reached at start-up by the CLI; gone since
                log.error("%s", exc)
            names = self.repository.model_names()
        else:
            # a --model checkpoint is served from the start in every mode: it was named
            names = list(dict.fromkeys([*self.options.load_models, *self.repository.served]))
        if self.poller is not None:
            await self.poller.snapshot()  # changes made during the initial load are seen
        #: models named at start that failed to load, with the reasons (--exit-on-error)
        self.failed_at_start = await self.repository.load_many(names)
        self.started = True
        if self.poller is not None:
            self.poller.start()

    async def stop(self) -> None:
        self.shutting_down = True
        if self.poller is not None:
            await self.poller.stop()
        self.rollouts.stop()
        await self.repository.unload_all()
        if self.response_cache is not None:
            await self.response_cache.close()
        host.uninstall(self.infer)
        self.shm.close()
        self.tracer.close()  # traces still pending go to their files

    @property
    def ready(self) -> bool:
        if not self.started or self.shutting_down:
            return False
        return self.repository.all_ready() if self.options.strict_readiness else True

    # ---- metadata --------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {"name": "kiln", "version": __version__, "extensions": list(EXTENSIONS)}

    def model(self, name: str, version: str = "") -> ModelRuntime:
        return self.repository.get(name, version)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.repository.get(name, version).ready
        except KilnError:
            return False

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        rt = self.model(name, version)
        entry = self.repository.entries[name]
        sig = rt.signature
        return {
            "name": name,
            "versions": [str(v) for v in sorted(entry.versions)],
            "platform": rt.config.platform or rt.config.backend,
            "inputs": [
                {
                    "name": s.name,
                    "datatype": s.datatype.value,
                    "shape": s.full_shape(sig.max_batch_size),
                }
                for s in sig.inputs.values()
            ],
            "outputs": [
                {
                    "name": s.name,
                    "datatype": s.datatype.value,
                    "shape": s.full_shape(sig.max_batch_size),
                }
                for s in sig.outputs.values()
            ],
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return config_to_json(self.model(name, version).config)

    # ---- inference -------------------------------------------------------------------
    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        if self.shutting_down:
            raise KilnError("server is shutting down", Status.UNAVAILABLE)
        runtime, rollout = self._route(
            request.model_name, request.model_version, request.parameters
        )
        return await self._infer_on(runtime, rollout, request)

    async def _infer_on(
        self, runtime: ModelRuntime, rollout: ModelRollout | None, request: InferenceRequest
    ) -> InferenceResponse:
        self._admit(request)
        counts = {
            o.name: n for o in request.outputs if (n := requested_count(o.name, o.parameters))
        }
        if rollout is None:
            response = await runtime.infer(request)
        else:
            response = await self._infer_rollout(runtime, rollout, request)
        if counts:
            batching = runtime.signature.max_batch_size > 0
            response.outputs = [
                classify(out, counts[out.name], batching, runtime.labels.get(out.name, []))
                if out.name in counts
                else out
                for out in response.outputs
            ]
        return response

    # ---- rollouts --------------------------------------------------------------------
    def _route(
        self, name: str, version: str, parameters: Mapping[str, Any]
    ) -> tuple[ModelRuntime, ModelRollout | None]:
        """The runtime a request gets: the version it names, else its model's rollout
        split's choice, else the latest ready version (as before rollouts)."""
        if not version:
            entry = self.repository.entries.get(name)
            if entry is not None and entry.versions:
                rollout = self.rollouts.sync(name, entry.config, entry.versions, self._shadow)
                if rollout is not None:
                    versions = entry.versions
                    chosen = rollout.pick(parameters, lambda v: v in versions and versions[v].ready)
                    if chosen is not None:
                        return versions[chosen], rollout
        return self.repository.get(name, version), None

    async def _infer_rollout(
        self, runtime: ModelRuntime, rollout: ModelRollout, request: InferenceRequest
    ) -> InferenceResponse:
        """``runtime.infer``, timed for the canary's guard and copied to the shadow."""
        t0 = time.perf_counter()
        try:
            response = await runtime.infer(request)
        except KilnError as exc:
            if rollout.guarded and exc.status not in CLIENT_STATUSES:
                rollout.record(runtime.version, time.perf_counter() - t0, False)
            raise
        except Exception:
            if rollout.guarded:
                rollout.record(runtime.version, time.perf_counter() - t0, False)
            raise
        secs = time.perf_counter() - t0
        if rollout.guarded:
            rollout.record(runtime.version, secs, True)
        rollout.offer_shadow(request, runtime.version, response, secs)
        return response

    async def _shadow(self, request: InferenceRequest) -> InferenceResponse:
        """A shadow copy's inference: admitted already with its original."""
        runtime = self.repository.get(request.model_name, request.model_version)
        return await runtime.infer(request)

    def rollout(self, name: str) -> dict[str, Any]:
        """The model's rollout (``{}``: none)."""
        entry = self.repository.entries.get(name)
        if entry is None or not entry.versions:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        rollout = self.rollouts.sync(name, entry.config, entry.versions, self._shadow)
        return rollout.to_json() if rollout is not None else {}

    def set_rollout(self, name: str, fields: Any) -> dict[str, Any]:
        """Replace the model's rollout policy (``{}``: none); a bad policy: 400, and the
        previous one keeps serving."""
        entry = self.repository.entries.get(name)
        if entry is None or not entry.versions:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if not isinstance(fields, dict):
            raise invalid_arg(f"rollout of model '{name}': the body must be a JSON object")
        self.rollouts.sync(name, entry.config, entry.versions, self._shadow)
        ready = [v for v, r in entry.versions.items() if r.ready]
        rollout = self.rollouts.set_policy(name, fields, ready, self._shadow)
        return rollout.to_json() if rollout is not None else {}

    def _admit(self, request: InferenceRequest) -> None:
        """What every request must satisfy whatever its frontend, before any scheduling."""
        opts = self.options
        check_request_limits(request, opts.max_input_tensors, opts.max_tensor_elements)
        check_parameters(request)

    async def infer_stream(
        self, request: InferenceRequest, window: int = 0
    ) -> AsyncIterator[InferenceResponse]:
        """The responses of one request as they come: 0..N for a decoupled model, else 1.
        ``window`` > 0: a model that can pause sends no more while that many wait untaken
        (``core/stream.py``)."""
        if self.shutting_down:
            raise KilnError("server is shutting down", Status.UNAVAILABLE)
        runtime, rollout = self._route(
            request.model_name, request.model_version, request.parameters
        )
        if not runtime.decoupled:
            yield await self._infer_on(
                runtime, rollout, request
            )  # classification, as infer  # classification and the rest, as infer does
            return
        self._admit(request)
        async for response in runtime.infer_stream(request, window):
            yield response

    # ---- llm engines -----------------------------------------------------------------
    def llm_engine(
        self, name: str, version: str = "", parameters: Mapping[str, Any] | None = None
    ) -> EngineClient:
        """An LLM model's engine, resolved as ``infer`` resolves a model (the same errors:
        unknown, not ready, unloading; the rollout split when no version is named, sticky
        on ``parameters``); its requests count, trace and drain as infer's. A model of
        another backend: 400."""
        if self.shutting_down:
            raise KilnError("server is shutting down", Status.UNAVAILABLE)
        name = self.llm_name(name)
        runtime, rollout = self._route(name, version, parameters or {})
        client = runtime.llm_engine()
        if rollout is not None and rollout.policy.shadow is not None:
            # its finished generations are repeated on the shadow version (compared token
            # by token); the hook reads the model's rollout at each call, so a policy
            # changed or removed later takes effect at once
            client.on_finished = self._llm_observer(name, runtime.version)
        return client

    def llm_name(self, name: str) -> str:
        """The model a request's name means: itself, or the model an alias names."""
        return self.options.llm_aliases.get(name, name)

    def _llm_observer(self, name: str, version: int) -> FinishedHook:
        def observe(
            prompt: list[int], params: Any, tokens: dict[int, list[int]], secs: float
        ) -> None:
            rollout = self.rollouts.models.get(name)
            if rollout is not None:
                rollout.offer_llm_shadow(version, list(prompt), params, tokens, secs)

        return observe

    async def _llm_shadow(
        self, name: str, version: int, prompt: list[int], params: Any
    ) -> dict[int, list[int]]:
        """An LLM shadow copy: the same prompt and sampling on ``version``; each sample's
        output token ids."""
        client = self.repository.get(name, str(version)).llm_engine()
        tokens: dict[int, list[int]] = {}
        async for out in client.generate(prompt, params, f"shadow-{uuid.uuid4().hex}"):
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
        return tokens

    def llm_engines(self) -> dict[str, EngineClient]:
        """The ready LLM models' engines, by name (each model's latest ready version)."""
        found: dict[str, EngineClient] = {}
        for runtime in sorted(self.repository.runtimes(), key=lambda r: r.version):
            if runtime.ready and runtime.config.backend in LLM_BACKENDS:
                try:
                    found[runtime.name] = runtime.llm_engine()
                except KilnError:
                    continue  # unloaded meanwhile
        return found

    def is_decoupled(self, name: str, version: str = "") -> bool:
        return self.repository.get(name, version).decoupled

    # ---- statistics ------------------------------------------------------------------
    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            entry = self.repository.entries.get(name)
            if entry is None or not entry.versions:
                raise not_found(f"requested model '{name}' is not available")
            runtimes = (
                [self.repository.get(name, version)]
                if version
                else [r for _, r in sorted(entry.versions.items())]
            )
        else:
            runtimes = self.repository.runtimes()
        return {"model_stats": [r.stats.to_json(r.name, r.version_str) for r in runtimes]}

    # ---- trace / log settings --------------------------------------------------------
    def trace_settings(
        self, model: str = "", updates: dict[str, list[str]] | None = None
    ) -> dict[str, list[str]]:
        """Read (and with ``updates``, change) the global or one model's trace settings."""
        if model and model not in self.repository.entries:
            check_model_name(model)
            if model not in self.repository.model_names():
                raise not_found(f"Request for unknown model: '{model}' is not found")
        return self.tracer.update(model, updates) if updates else self.tracer.get(model)

    # ---- repository ------------------------------------------------------------------
    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self.repository.index(ready_only)

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        check_model_name(name)  # a bad name is the precise error, whatever the mode
        if self.options.model_control_mode is not ControlMode.EXPLICIT:
            raise KilnError(
                "explicit model load / unload is not allowed if polling is enabled"
                if self.options.model_control_mode is ControlMode.POLL
                else "explicit model load / unload is not allowed: start kiln with "
                "--model-control-mode=explicit",
                Status.UNAVAILABLE,
            )
        parameters = _control_parameters(name, "load", parameters)
        config = parameters.get("config")
        if config is not None and not isinstance(config, (str, bytes)):
            raise invalid_arg("load parameter 'config' must be a JSON string")
        if isinstance(config, bytes):
            config = config.decode("utf-8", "replace")
        files = check_files(name, parameters)
        await self.repository.load(name, config, files or None)

    async def unload_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        check_model_name(name)
        if self.options.model_control_mode is not ControlMode.EXPLICIT:
            raise KilnError(
                "explicit model load / unload is not allowed: start kiln with "
                "--model-control-mode=explicit",
                Status.UNAVAILABLE,
            )
        dependents = _control_parameters(name, "unload", parameters).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise KilnError(
                f"unload of model '{name}': parameter 'unload_dependents' must be a boolean, "
                f"got {dependents!r}",
                Status.INVALID_ARG,
            )
        await self.repository.unload(name, unload_dependents=dependents)
        self.rollouts.drop(name)


def _control_parameters(name: str, action: str, parameters: Any) -> dict[str, Any]:
    """A load's or unload's ``parameters``: an object (None when the request has none)."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise invalid_arg(
            f"{action} of model '{name}': 'parameters' must be a JSON object, got "
            f"{type(parameters).__name__}"
        )
    return parameters
