"""``kiln serve`` reads a ``vllm serve`` command line as vLLM's parser does.

Before click parses, :class:`ServeCommand` rewrites the arguments the way vLLM's
``FlexibleArgumentParser`` does: ``--config FILE.yaml`` (its keys become flags; the command
line wins), underscores in flag names (``--max_model_len``), ``-O3``, dotted JSON keys
(``--speculative-config.method ngram``), the ``--spec-*`` shorthands and flags that take
several values (``--lora-modules a=x b=y``). A vLLM flag kiln has no counterpart of is
refused naming it and why, never with click's bare "No such option"; ``--no-X`` of such a
switch asks for nothing and is accepted.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click
import yaml

log = logging.getLogger(__name__)

#: every flag of ``vllm serve --help=all`` (vLLM 0.32), the ``--no-`` forms aside
_NAMES = """
--additional-config --aggregate-engine-logging --all2all-backend --allow-credentials
--allow-deprecated-quantization --allowed-headers --allowed-local-media-path
--allowed-media-domains --allowed-methods --allowed-origins
--anthropic-disabled-thinking-effort --api-key --api-server-count --async-scheduling
--attention-backend --attention-config --aux-output-config --block-size
--chat-template --chat-template-content-format --code-revision --cohere-format
--cohere-is-reasoning-model --collect-detailed-traces --compilation-config --config
--config-format --convert --cp-kv-cache-interleave-size --cpu-distributed-timeout-seconds
--cpu-offload-gb --cpu-offload-params --cudagraph-capture-sizes --cudagraph-metrics
--custom-histogram-buckets --data-parallel-address --data-parallel-backend
--data-parallel-external-lb --data-parallel-hybrid-lb --data-parallel-multi-port-external-lb
--data-parallel-rank --data-parallel-rpc-port --data-parallel-size --data-parallel-size-local
--data-parallel-start-rank --data-parallel-supervisor-port --dbo-decode-token-threshold
--dbo-prefill-token-threshold --dcp-comm-backend --dcp-kv-cache-interleave-size
--dcp-q-replicate --decode-context-parallel-size --default-chat-template-kwargs
--default-mm-loras --device-ids --device-memory-utilization --diffusion-config
--disable-access-log-for-endpoints --disable-cascade-attn --disable-chunked-mm-input
--disable-custom-all-reduce --disable-fastapi-docs --disable-hybrid-kv-cache-manager
--disable-log-stats --disable-nccl-for-dp-synchronization --disable-sliding-window
--disable-uvicorn-access-log --distributed-executor-backend --distributed-timeout-seconds
--download-dir --dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s
--dp-supervisor-probe-timeout-s --dp-sync-interval --dtype --ec-manager-config
--ec-transfer-config --elastic-ep-max-dp-size --enable-auto-tool-choice
--enable-batch-sharded-sampling --enable-chunked-prefill --enable-cumem-allocator
--enable-dbo --enable-elastic-ep --enable-ep-weight-filter --enable-eplb
--enable-expert-parallel --enable-fault-tolerance --enable-flash-late-interaction
--enable-flashinfer-autotune --enable-force-include-usage --enable-hc-sp
--enable-layerwise-nvtx-tracing --enable-log-deltas --enable-log-outputs
--enable-log-requests --enable-logging-iteration-details --enable-lora
--enable-mamba-cache-stochastic-rounding --enable-mamba-shared-prefix-checkpoint
--enable-mfu-metrics --enable-mixed-moe-lora-format --enable-mm-embeds
--enable-moe-shared-loras --enable-nccl-comm-suspend --enable-offline-docs
--enable-per-request-metrics --enable-prefix-caching --enable-prompt-embeds
--enable-prompt-tokens-details --enable-request-id-headers --enable-return-routed-experts
--enable-scale-out --enable-server-load-tracking --enable-shm-tensor-arena
--enable-sleep-mode --enable-ssl-refresh --enable-tokenizer-info-endpoint
--enable-tower-connector-lora --enable-trace-replay --enforce-eager --engram-config
--eplb-config --exclude-tools-when-tool-choice-none --expert-placement-strategy
--fail-on-environ-validation --fault-tolerance-config --fingerprint-mode
--fingerprint-value --fully-sharded-loras --gdn-prefill-backend --generation-config
--gpu-memory-utilization --grpc --grpc-port --guided-decoding-backend
--h11-max-header-count --h11-max-incomplete-event-size --headless --hf-config-path
--hf-overrides --hf-token --host --ignore-patterns --interleave-mm-strings
--io-processor-plugin --ir-op-priority --jit-monitor-mode --jit-monitor-verbose
--kda-decode-backend --kda-prefill-backend --kernel-config --kv-cache-dtype
--kv-cache-dtype-skip-layers --kv-cache-memory-bytes --kv-cache-metrics
--kv-cache-metrics-sample --kv-events-config --kv-offloading-backend --kv-offloading-size
--kv-sharing-fast-prefill --kv-transfer-config --language-model-only
--limit-mm-per-prompt --linear-backend --load-format --log-config-file --log-error-stack
--logging-config --logits-processors --logprobs-mode --long-prefill-token-threshold
--long-prefill-token-threshold-adaptive --lora-dtype --lora-modules --lora-target-modules
--mamba-backend --mamba-block-size --mamba-cache-dtype --mamba-cache-mode
--mamba-cache-philox-rounds --mamba-ssm-cache-dtype --mamba-ssu-algorithm --master-addr
--master-port --max-cpu-loras --max-cudagraph-capture-size --max-log-len
--max-logprobs --max-lora-cls-labels --max-lora-rank --max-loras --max-model-len
--max-num-active-seqs --max-num-batched-tokens --max-num-queued-reqs
--max-num-queued-tokens --max-num-scheduled-tokens --max-num-seqs
--max-parallel-loading-workers --media-io-kwargs --middleware --mm-device-do-normalize
--mm-encoder-attn-backend --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path
--mm-encoder-fp8-scale-save-margin --mm-encoder-fp8-scale-save-path --mm-encoder-only
--mm-encoder-tp-mode --mm-hasher-algorithm --mm-ipc-gpu-memory-gb --mm-processor-cache-gb
--mm-processor-cache-type --mm-processor-device --mm-processor-kwargs
--mm-shm-cache-max-object-size-mb --mm-tensor-ipc --model --model-class-overrides
--model-impl --model-loader-extra-config --moe-backend --nnodes --node-rank --numa-bind
--numa-bind-cpus --numa-bind-nodes --num-gpu-blocks-override --offload-backend
--offload-group-size --offload-num-in-group --offload-params --offload-prefetch-step
--optimization-level --otlp-traces-endpoint --override-generation-config
--per-request-spec-decode-metrics --performance-mode --pipeline-parallel-size --port
--prefill-context-parallel-size --prefill-schedule-interval
--prefix-cache-retention-interval --prefix-caching-hash-algo --prefix-match-unit
--profiler-config --pt-load-map-location --quantization --quantization-config
--ray-workers-use-nsight --reasoning-config --reasoning-parser --reasoning-parser-plugin
--renderer-num-workers --replayssm-buffer-len --response-role
--return-sampling-mask --return-tokens-as-token-ids --revision --root-path --runner
--safetensors-load-strategy --safetensors-prefetch-block-size
--safetensors-prefetch-num-threads --scheduler-cls --scheduler-reserve-full-isl
--scheduling-policy --seed --served-model-name --show-hidden-metrics-for-version
--shutdown-timeout --skip-mm-profiling --skip-tokenizer-init --sleep-mode-offload-cudagraph
--sleep-preserve-parameter-names --sparse-indexer-topk-backend --spec-method --spec-model
--spec-tokens --specialize-active-lora --speculative-config --sse-keep-alive-interval
--ssl-ca-certs --ssl-cert-reqs --ssl-certfile --ssl-ciphers --ssl-keyfile
--stream-interval --structured-outputs-config --swa-bounded-replay --tensor-parallel-size
--tokenizer --tokenizer-mode --tokenizer-revision --tokens-only --tool-call-parser
--tool-parser-plugin --tool-server --tool-strict-level --trust-remote-code
--trust-request-chat-template --trust-request-mm-kwargs --ubatch-size --uds
--use-fp64-gumbel --use-replayssm --use-tqdm-on-load --uvicorn-log-level
--video-pruning-method --video-pruning-rate --watermark --watermark-config
--weight-transfer-config --worker-cls --worker-extension-cls
-ac -asc -cc -dc -dcp -dp -dpa -dpb -dpe -dph -dpl -dpm -dpn -dpp -dpr -ep -n -pcp -pp
-q -r -sc -tp
"""
VLLM_SERVE_FLAGS = frozenset(_NAMES.split())

#: families of vLLM flags kiln has no counterpart of, by name prefix: why
FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        (
            "--data-parallel-",
            "--dp-",
            "-dp",
            "-dpa",
            "-dpb",
            "-dpe",
            "-dph",
            "-dpl",
            "-dpm",
            "-dpn",
            "-dpp",
            "-dpr",
            "--enable-elastic-ep",
            "--elastic-ep-",
            "--disable-nccl-for-dp",
            "--nnodes",
            "-n",
            "--node-rank",
            "-r",
            "--master-",
            "--prefill-schedule-interval",
            "--distributed-timeout",
            "--cpu-distributed-timeout",
            "--enable-fault-tolerance",
            "--fault-tolerance-config",
        ),
        "one engine on one machine per kiln: run one kiln per replica behind a load "
        "balancer (docs/scaling.md)",
    ),
    (
        (
            "--decode-context-parallel",
            "-dcp",
            "--dcp-",
            "--prefill-context-parallel",
            "-pcp",
            "--cp-kv-cache",
        ),
        "no context parallelism: --tensor-parallel-size splits a model",
    ),
    (
        (
            "--enable-eplb",
            "--eplb-",
            "--expert-placement",
            "--all2all-",
            "--enable-ep-",
            "-ep",
            "--enable-return-routed-experts",
            "--moe-backend",
            "--enable-moe-shared-loras",
            "--enable-mixed-moe-lora-format",
        ),
        "experts run on each tensor-parallel rank: no expert parallelism or balancing",
    ),
    (
        (
            "--mamba-",
            "--enable-mamba-",
            "--use-replayssm",
            "--replayssm-",
            "--swa-bounded",
            "--gdn-",
            "--kda-",
            "--linear-backend",
            "--sparse-indexer",
        ),
        "kiln serves attention models (Llama, Qwen3, Gemma, Phi-3, Mixtral families): no "
        "state-space or linear-attention layers",
    ),
    (
        (
            "--mm-",
            "--allowed-local-media-path",
            "--allowed-media-domains",
            "--media-io-",
            "--interleave-mm-strings",
            "--skip-mm-profiling",
            "--enable-mm-embeds",
            "--video-pruning-",
            "--default-mm-loras",
            "--trust-request-mm-kwargs",
            "--disable-chunked-mm-input",
            "--enable-tower-connector-lora",
            "--language-model-only",
            "--enable-prompt-embeds",
            "--diffusion-config",
            "-dc",
            "--io-processor-plugin",
        ),
        "kiln's LLM engine takes text and token ids: no multimodal inputs or embeddings as prompts",
    ),
    (
        (
            "--offload-",
            "--kv-offloading-",
            "--cpu-offload-params",
            "--enable-cumem-allocator",
            "--weight-transfer-config",
        ),
        "weights and KV cache stay on the device: no offloading",
    ),
    (
        ("--sleep-", "--enable-nccl-comm-suspend"),
        "kiln's sleep levels are vLLM's (1: the KV cache freed, a GPU's weights moved to host "
        "memory; 2: the weights dropped, read again from the model files by the wake), with "
        "no other state kept or offloaded (docs/llm.md, Development and RL control)",
    ),
    (
        (
            "--ec-",
            "--kv-events-config",
            "--kv-sharing-fast-prefill",
            "--enable-shm-tensor-arena",
        ),
        "no disaggregated serving (prefill and decode apart, KV or encoder-cache transfer)",
    ),
    (
        (
            "--worker-cls",
            "--worker-extension-cls",
            "--scheduler-cls",
            "--middleware",
            "--logits-processors",
            "--tool-parser-plugin",
            "--reasoning-parser-plugin",
            "--model-class-overrides",
            "--additional-config",
            "--tool-server",
        ),
        "kiln loads no user code into its server (a Python-backend model runs its code in "
        "its own process: docs/python_backend.md)",
    ),
    (
        (
            "--enable-dbo",
            "--dbo-",
            "--ubatch-size",
            "--kernel-config",
            "--ir-op-priority",
            "--attention-config",
            "-ac",
            "--enable-hc-sp",
            "--enable-batch-sharded-sampling",
            "--use-fp64-gumbel",
            "--jit-monitor-",
            "--enable-flash-late-interaction",
            "--disable-hybrid-kv-cache-manager",
            "--specialize-active-lora",
            "--fully-sharded-loras",
            "--lora-target-modules",
            "--max-lora-cls-labels",
        ),
        "a tuning knob of vLLM's own kernels or scheduler that kiln's engine has no counterpart of",
    ),
    (
        (
            "--numa-bind",
            "--device-ids",
            "--ray-workers-use-nsight",
            "--enable-layerwise-nvtx-tracing",
            "--enable-trace-replay",
        ),
        "kiln places its workers itself; its profiler is --profiler-config "
        "(docs/llm.md, Profiling)",
    ),
)


def why_unsupported(flag: str) -> str | None:
    """Why kiln refuses the vLLM flag ``flag``; None when it is not one of vLLM's."""
    if flag not in VLLM_SERVE_FLAGS:
        return None
    for prefixes, why in FAMILIES:
        if any(flag == p or (p.endswith("-") and flag.startswith(p)) for p in prefixes):
            return why
    return "kiln has no counterpart of it"


#: vLLM flags that take several values (``nargs="+"``), each a repeatable option in kiln
_SEVERAL = ("--api-key", "--lora-modules", "--served-model-name", "--cudagraph-capture-sizes",
            "--ignore-patterns")  # fmt: skip
#: vLLM's speculative-decoding shorthands: the ``--speculative-config`` key each sets
_SPEC = {
    "--spec-method": "method",
    "--spec-model": "model",
    "--spec-tokens": "num_speculative_tokens",
}
#: vLLM's short spellings of JSON flags (one spelling, for merging dotted keys)
_LONG = {"-sc": "--speculative-config", "-cc": "--compilation-config"}


def _is_path(token: str) -> bool:
    try:
        return Path(token).exists()
    except (OSError, ValueError):
        return False


def _takes_another(flag: str, token: str) -> bool:
    """Whether ``token``, after ``flag``'s first value, is another of its values (vLLM's
    ``nargs="+"``) rather than kiln's positional MODEL or the next flag."""
    if token.startswith("-"):
        return False
    if flag == "--lora-modules":
        return "=" in token or token.startswith("{")
    if flag == "--cudagraph-capture-sizes":
        return token.isdigit()
    return not _is_path(token)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def config_args(path: str, command: click.Command) -> list[tuple[str, str | None]]:
    """The flags a vLLM ``--config`` YAML file holds, as vLLM expands them: ``key: value``
    is ``--key value``, ``true`` a switch, ``false`` its ``--no-`` form where kiln has one,
    a list several values, a mapping a JSON object. Each (flag, value or None)."""
    if not path.endswith((".yaml", ".yml")):
        raise click.BadParameter(f"'{path}' is not a .yaml or .yml file", param_hint="--config")
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except OSError as exc:
        raise click.BadParameter(f"'{path}': {exc.strerror}", param_hint="--config") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise click.BadParameter(
            f"'{path}'{line}: not YAML: {getattr(exc, 'problem', exc)}", param_hint="--config"
        ) from None
    if loaded is None:
        return []
    if not isinstance(loaded, dict):
        raise click.BadParameter(f"'{path}' must hold a mapping of flags", param_hint="--config")
    negatives = {o for p in command.params for o in getattr(p, "secondary_opts", ())}
    flags: list[tuple[str, str | None]] = []
    for key, value in loaded.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append((flag, None))
            elif "--no-" + flag[2:] in negatives:
                flags.append(("--no-" + flag[2:], None))
        elif isinstance(value, list):
            flags += [(flag, v if isinstance(v, str) else json.dumps(v)) for v in value]
        elif isinstance(value, dict):
            flags.append((flag, json.dumps(value)))
        elif value is not None:
            flags.append((flag, str(value)))
    return flags


def _given(args: list[str], opts: set[str]) -> bool:
    return any(a in opts or a.split("=", 1)[0] in opts for a in args)


def vllm_args(args: list[str], command: click.Command) -> list[str]:
    """``args`` rewritten as vLLM's parser reads them (the module's docstring)."""
    out: list[str] = []
    objects: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        if arg.startswith("-O") and arg != "-O" and not arg.startswith("--"):
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
            i += 1
            continue
        if arg == "-O":
            out.append("--optimization-level")
            i += 1
            continue
        if arg in _LONG:  # one spelling, for the dotted keys' merge below
            arg = _LONG[arg]
        if not arg.startswith("--"):
            out.append(arg)
            i += 1
            continue
        name, eq, value = arg.partition("=")
        base, dot, rest = name.partition(".")
        base = base.replace("_", "-")
        if dot or base in _SPEC:
            if eq:
                text = value
            elif i + 1 < len(args):
                text, i = args[i + 1], i + 1
            else:
                raise click.BadParameter(f"{arg} needs a value")
            keys = rest.split(".") if dot else [_SPEC[base]]
            target = objects.setdefault("--speculative-config" if base in _SPEC else base, {})
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            target[keys[-1]] = _json_value(text)
            i += 1
            continue
        if base in _SEVERAL and not eq:
            out.append(base)
            j = i + 1
            if j < len(args):
                out.append(args[j])
                j += 1
            while j < len(args) and _takes_another(base, args[j]):
                out += [base, args[j]]
                j += 1
            i = j
            continue
        out.append(base + eq + value)
        i += 1
    for flag, obj in objects.items():
        given = [k for k, a in enumerate(out) if a == flag]  # a whole JSON given as well
        if given and given[-1] + 1 < len(out):
            whole = _json_value(out[given[-1] + 1])
            if isinstance(whole, dict):
                obj = {**whole, **obj}
            del out[given[-1] : given[-1] + 2]
        out += [flag, json.dumps(obj)]
    return out


class ServeCommand(click.Command):
    """``kiln serve``: a ``vllm serve`` command line runs unchanged where kiln can serve it,
    and fails naming the flag and the reason where it cannot."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        if "--config" in args or any(a.startswith("--config=") for a in args):
            args = self._with_config(args)
        args = vllm_args(args, self)
        known = {o for p in self.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
        kept = []
        for arg in args:
            name = arg.split("=", 1)[0]
            if name.startswith("--no-") and name not in known:
                if ("--" + name[5:]) in VLLM_SERVE_FLAGS:
                    log.info("vLLM's %s: accepted, nothing to turn off in kiln", name)
                    continue
            elif not name.startswith("--") and name in VLLM_SERVE_FLAGS and name not in known:
                # a short one (-dpn) would reach click as a cluster of one-letter options
                why = why_unsupported(name)
                raise click.UsageError(f"vLLM's {name} is not supported by kiln: {why}", ctx)
            kept.append(arg)
        try:
            return super().parse_args(ctx, kept)
        except click.NoSuchOption as exc:
            why = why_unsupported(exc.option_name)
            if why is None:
                raise
            raise click.UsageError(
                f"vLLM's {exc.option_name} is not supported by kiln: {why}", ctx
            ) from None

    def _with_config(self, args: list[str]) -> list[str]:
        """vLLM's precedence: the command line over the file over the defaults."""
        at = next(i for i, a in enumerate(args) if a == "--config" or a.startswith("--config="))
        if args[at] == "--config":
            if at + 1 >= len(args):
                raise click.BadParameter("needs a file", param_hint="--config")
            path, rest = args[at + 1], args[:at] + args[at + 2 :]
        else:
            path, rest = args[at].split("=", 1)[1], args[:at] + args[at + 1 :]
        if "--config" in rest or any(a.startswith("--config=") for a in rest):
            raise click.BadParameter("given twice", param_hint="--config")
        # a repeatable option the command line gives replaces the file's values; a MODEL
        # on the command line (first, as vLLM has it) or --model replaces the file's model
        several = {o for p in self.params if getattr(p, "multiple", False) for o in p.opts}
        positional = rest[:1] != [] and not rest[0].startswith("-")
        kept: list[str] = []
        for flag, value in config_args(path, self):
            if flag in several and _given(rest, {flag}):
                continue
            if flag == "--model" and (positional or _given(rest, {"--model"})):
                continue
            kept += [flag] if value is None else [flag, value]
        return kept + rest
