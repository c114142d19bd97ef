"""``vllm serve`` flags that have nothing to map onto in kiln, so that a vLLM command line
runs unchanged where it can and fails naming the flag where it cannot.

Accepted (hidden from ``--help``, listed in docs/llm.md): flags for what kiln does anyway or
has no counterpart of (a hub's revisions, uvicorn's own logs). Refused: flags that ask for
something kiln does not do (pipeline or data parallelism, CPU offload, ...),
unless their value asks for nothing (``--pipeline-parallel-size 1``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)

#: flags with a value kiln accepts and needs nothing from: why
ACCEPTED_VALUES = {
    "--max-log-len": "kiln logs no prompts",
    "--download-dir": "kiln reads local checkpoints only: nothing is downloaded",
    "--revision": "a local folder has one revision",
    "--tokenizer-revision": "a local folder has one revision",
    "--code-revision": "kiln runs no code from a checkpoint",
    "--hf-token": "kiln reads no hub",
    "--max-parallel-loading-workers": "kiln loads one shard at a time",
    "--optimization-level": "kiln compiles no torch graphs (--enforce-eager turns its CUDA "
    "graphs off)",
    "--compilation-config": "kiln compiles no torch graphs (--enforce-eager turns its CUDA "
    "graphs off)",
    "--max-cudagraph-capture-size": "kiln captures its decode batch sizes itself",
    "--cudagraph-capture-sizes": "kiln captures its decode batch sizes itself",
    "--performance-mode": "kiln's engine has one mode",
    "--collect-detailed-traces": "kiln's traces (--trace-config) carry their own spans",
    "--show-hidden-metrics-for-version": "kiln's metrics are listed in docs/metrics.md",
    "--disable-access-log-for-endpoints": "kiln's HTTP server writes no access log",
    "--safetensors-load-strategy": "kiln maps safetensors files itself",
    "--safetensors-prefetch-block-size": "kiln maps safetensors files itself",
    "--safetensors-prefetch-num-threads": "kiln maps safetensors files itself",
    "--pt-load-map-location": "kiln reads safetensors and GGUF, never pickled tensors",
    "--ignore-patterns": "kiln reads local checkpoints only: nothing is downloaded",
    "--prefix-caching-hash-algo": "kiln's prefix cache hashes blocks its own way",
}
#: switches kiln accepts: why
ACCEPTED_SWITCHES = {
    "--disable-uvicorn-access-log": "kiln's HTTP server writes no access log",
    "--disable-fastapi-docs": "kiln serves no /docs pages",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details",
    "--enable-server-load-tracking": "GET /load answers always",
    "--enable-log-requests": "kiln logs no request contents (--trace-config traces them)",
    "--enable-log-outputs": "kiln logs no outputs (--trace-config level=TENSORS traces them)",
    "--enable-log-deltas": "kiln logs no outputs (--trace-config level=TENSORS traces them)",
    "--async-scheduling": "kiln's scheduler has no synchronous and asynchronous modes",
    "--disable-cascade-attn": "kiln has no cascade attention",
    "--enable-flashinfer-autotune": "kiln runs no FlashInfer kernels",
    "--disable-custom-all-reduce": "kiln has no custom all-reduce kernel",
    "--aggregate-engine-logging": "kiln logs no periodic stats (/metrics and the dashboard "
    "have them)",
    "--enable-logging-iteration-details": "kiln logs no periodic stats (/metrics and the "
    "dashboard have them)",
    "--log-error-stack": "kiln logs a request's failure as it always does",
    "--cudagraph-metrics": "vLLM logs a CUDA-graph table with it and exports no series; kiln "
    "logs no periodic stats",
    "--use-tqdm-on-load": "nothing to do",
    "--enable-offline-docs": "kiln serves no /docs pages",
    "--allow-deprecated-quantization": "kiln's quantization formats are not deprecated",
    "--fail-on-environ-validation": "kiln reads no VLLM_* variables but its own few",
    "--enable-sleep-mode": "kiln's engine can always sleep: VLLM_SERVER_DEV_MODE=1 opens /sleep "
    "and /wake_up (docs/llm.md, Development and RL control)",
}
#: flags with a value, accepted only with the values that ask for nothing kiln lacks
LIMITED_VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    "--pipeline-parallel-size": (("1",), "one machine: --tensor-parallel-size splits a model"),
    "--data-parallel-size": (("1",), "run one kiln per replica (docs/scaling.md)"),
    "--api-server-count": (("1",), "one server process"),
    "--cpu-offload-gb": (("0",), "weights stay on the device"),
    "--load-format": (("auto", "safetensors", "gguf"), "kiln reads safetensors and GGUF"),
    "--tokenizer-mode": (("auto", "hf"), "kiln runs the tokenizer.json tokenizer"),
    "--logprobs-mode": (("raw_logprobs",), "logprobs are the model's raw distribution"),
    "--distributed-executor-backend": (("mp", "uni"), "kiln's workers are processes"),
    "--root-path": (("", "/"), "serve under a path prefix with the proxy's rewrite"),
    "--kv-transfer-config": ((), "no disaggregated prefill"),
    "--limit-mm-per-prompt": ((), "kiln serves text"),
    "--hf-overrides": (("{}",), "edit config.json instead"),
    "--model-impl": (("auto", "vllm"), "kiln runs its own implementation of each model"),
    "--config-format": (("auto", "hf"), "kiln reads config.json"),
    "--lora-dtype": (("auto",), "adapters run in the model's dtype"),
    "--guided-decoding-backend": (
        ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"),
        "kiln's one grammar engine (llguidance) serves every backend's constraints",
    ),
}
#: switches that ask for something kiln does not do
REFUSED_SWITCHES = {
    "--enable-expert-parallel": "experts run on each tensor-parallel rank",
    "--skip-tokenizer-init": "the OpenAI routes need the tokenizer",
    "--headless": "kiln serves its API in the engine's server",
    "--disable-sliding-window": "a model's sliding window is part of its attention in kiln",
}


#: vLLM's short spellings of the flags above
SHORT = {"--pipeline-parallel-size": "-pp", "--data-parallel-size": "-dp",
         "--api-server-count": "-asc", "--compilation-config": "-cc"}  # fmt: skip


def _opt_name(flag: str) -> str:
    return "vllm_" + flag.removeprefix("--").replace("-", "_")


def _names(flag: str) -> tuple[str, ...]:
    return (flag, SHORT[flag]) if flag in SHORT else (flag,)


#: vLLM's structured-outputs backends: kiln's llguidance serves the constraints of each
_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def _check_structured_config(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """``--structured-outputs-config '{"backend": "xgrammar"}'``: any of vLLM's backends
    (kiln has one grammar engine); other keys are refused by name."""
    if value is None:
        return
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object")
    backend = parsed.pop("backend", "auto")
    if backend not in _BACKENDS:
        raise click.BadParameter(
            f"backend {backend!r} is not one of vLLM's ({', '.join(_BACKENDS)})"
        )
    if parsed:
        raise click.BadParameter(
            f"vLLM's structured-outputs options {sorted(parsed)} are not supported by kiln"
        )
    log.info("vLLM's --structured-outputs-config backend %s: kiln's llguidance serves it", backend)


def _check_value(
    ctx: click.Context, param: click.Parameter, value: str | tuple[str, ...] | None
) -> None:
    if value is None or value == ():
        return
    if isinstance(value, tuple):
        value = " ".join(value)
    flag = param.opts[0]
    if flag in ACCEPTED_VALUES:
        log.info("vLLM's %s %s: accepted, nothing to do (%s)", flag, value, ACCEPTED_VALUES[flag])
        return
    allowed, why = LIMITED_VALUES[flag]
    if value.strip() not in allowed:
        takes = f" (kiln takes {', '.join(repr(a) for a in allowed)})" if allowed else ""
        raise click.BadParameter(f"vLLM's {flag} {value!r} is not supported by kiln{takes}: {why}")


def _check_switch(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value:
        return
    flag = param.opts[0]
    if flag in REFUSED_SWITCHES:
        raise click.BadParameter(
            f"vLLM's {flag} is not supported by kiln: {REFUSED_SWITCHES[flag]}"
        )
    log.info("vLLM's %s: accepted, nothing to do (%s)", flag, ACCEPTED_SWITCHES[flag])


def vllm_flags(func: F) -> F:
    """The flags above, hidden, on ``kiln serve``."""
    for flag in (*ACCEPTED_VALUES, *LIMITED_VALUES):
        several = flag in ("--cudagraph-capture-sizes", "--ignore-patterns")
        func = click.option(*_names(flag), _opt_name(flag), default=None, hidden=True,
                            multiple=several, expose_value=False,
                            callback=_check_value)(func)  # fmt: skip
    func = click.option("--structured-outputs-config", "vllm_structured_outputs_config",
                        default=None, hidden=True, expose_value=False,
                        callback=_check_structured_config)(func)  # fmt: skip
    for flag in (*ACCEPTED_SWITCHES, *REFUSED_SWITCHES):
        func = click.option(flag, _opt_name(flag), is_flag=True, default=False, hidden=True,
                            expose_value=False, callback=_check_switch)(func)  # fmt: skip
    return func
