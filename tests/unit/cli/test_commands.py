"""The ``kiln`` group: one module per command, every help page reachable."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kiln.cli import main


def _paths(command: click.Command, path: list[str]) -> Iterator[list[str]]:
    yield path
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from _paths(sub, [*path, name])


def test_the_group_has_one_command_per_module() -> None:
    assert sorted(main.commands) == [
        "bench", "chat", "complete", "monitor", "optimize", "repo", "run-batch", "serve",
        "trace",
    ]  # fmt: skip
    for name, command in main.commands.items():
        assert command.callback is not None
        assert command.callback.__module__ == f"kiln.cli.{name.replace('-', '_')}"


@pytest.mark.parametrize("path", list(_paths(main, [])), ids=" ".join)
def test_every_help_page_exits_0(path: list[str]) -> None:
    for flag in ("--help", "-h"):  # -h is inherited from the group's context settings
        result = CliRunner().invoke(main, [*path, flag], prog_name="kiln")
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"Usage: kiln {' '.join(path)}".replace("  ", " "))


def test_python_m_kiln_is_the_same_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "kiln, version 0.1.0"


def test_optimize_is_a_function_of_an_ordinary_package() -> None:
    import types

    import kiln.optimize
    from kiln.optimize import optimize

    assert isinstance(optimize, types.FunctionType)
    assert type(kiln.optimize) is types.ModuleType  # no longer made callable


def test_serve_reads_vllms_command_line(tmp_path: Path) -> None:
    """``kiln serve MODEL --port N`` as ``vllm serve MODEL --port N``: the positional
    checkpoints are served before the --model ones."""
    from kiln.cli.serve import serve

    first, second = tmp_path / "a.gguf", tmp_path / "b"
    first.write_bytes(b"")
    second.mkdir()
    ctx = serve.make_context("serve", [str(first), "--port", "9123", "--model", str(second)])
    assert ctx.params["http_port"] == 9123
    assert ctx.params["model_paths"] == (first,) and ctx.params["models"] == (second,)
    ctx = serve.make_context("serve", ["--model", str(second)])
    assert ctx.params["http_port"] == 8000 and ctx.params["model_paths"] == ()
    with pytest.raises(click.BadParameter):
        serve.make_context("serve", [str(tmp_path / "missing")])
    # vLLM's operational flags that have nothing to change in kiln are accepted
    flags = ["--disable-log-requests", "--disable-log-stats", "--trust-remote-code",
             "--enable-chunked-prefill"]  # fmt: skip
    ctx = serve.make_context("serve", [str(first), *flags])
    assert not set(ctx.params) & {"disable_log_requests", "disable_log_stats",
                                  "enable_chunked_prefill"}  # fmt: skip
    # and vLLM's engine flags kiln has, with vLLM's names
    engine = ["--seed", "3", "--max-logprobs", "-1", "--stream-interval", "4"]
    ctx = serve.make_context("serve", [str(first), *engine])
    assert (ctx.params["seed"], ctx.params["max_logprobs"], ctx.params["stream_interval"]) == (
        3, -1, 4,
    )  # fmt: skip


def test_vllms_other_flags_are_accepted_or_refused_by_name(tmp_path: Path) -> None:
    """A ``vllm serve`` command line runs unchanged where kiln has nothing to do for a
    flag, and fails naming the flag where it asks for what kiln does not do."""
    from kiln.cli.serve import serve
    from kiln.cli.vllm_flags import (
        ACCEPTED_SWITCHES,
        ACCEPTED_VALUES,
        LIMITED_VALUES,
        REFUSED_SWITCHES,
    )

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    accepted = ["--download-dir", "/tmp/hf",
                "--revision", "main", "--pipeline-parallel-size", "1",
                "--load-format", "safetensors", "--tokenizer-mode", "auto",
                "--distributed-executor-backend", "mp", "--logprobs-mode", "raw_logprobs",
                "--structured-outputs-config", '{"backend": "xgrammar"}',
                "--guided-decoding-backend", "guidance", *ACCEPTED_SWITCHES]  # fmt: skip
    ctx = serve.make_context("serve", [str(model), *accepted])
    assert not any(k.startswith("vllm_") for k in ctx.params)  # nothing reaches serve()
    refused = [["--pipeline-parallel-size", "2"], ["--data-parallel-size", "4"],
               ["--cpu-offload-gb", "8"], ["--load-format", "dummy"],
               ["--logprobs-mode", "processed_logprobs"], ["--kv-transfer-config", "{}"],
               *([s] for s in REFUSED_SWITCHES)]  # fmt: skip
    for args in refused:
        with pytest.raises(click.BadParameter, match=f"vLLM's {args[0]}"):
            serve.make_context("serve", [str(model), *args])
    for config in ('{"backend": "mine"}', '{"backend": "auto", "reasoning_parser": "x"}', "[]"):
        with pytest.raises(click.BadParameter):
            serve.make_context("serve", [str(model), "--structured-outputs-config", config])
    # every flag of the tables is a hidden option of kiln serve
    opts = {o for p in serve.params for o in p.opts if getattr(p, "hidden", False)}
    tables = (ACCEPTED_VALUES, ACCEPTED_SWITCHES, LIMITED_VALUES, REFUSED_SWITCHES)
    assert set().union(*tables) <= opts


def test_vllms_model_flags_become_engine_parameters(tmp_path: Path) -> None:
    from kiln.cli.llm_options import served_models
    from kiln.cli.serve import serve

    model, tok = tmp_path / "m", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    args = [str(model), "--tokenizer", str(tok), "--num-gpu-blocks-override", "64",
            "--default-chat-template-kwargs", '{"enable_thinking": false}',
            "--override-generation-config", '{"temperature": 0.5}',
            "--response-role", "model", "--enable-force-include-usage",
            "--return-tokens-as-token-ids", "--trust-request-chat-template"]  # fmt: skip
    ctx = serve.make_context("serve", args)
    (config,) = served_models(ctx.params["model_paths"], (), ctx.params)
    got = {k: v.string_value for k, v in config.parameters.items()}
    assert got["tokenizer"] == str(tok.resolve()) and got["num_gpu_blocks"] == "64"
    assert got["default_chat_template_kwargs"] == '{"enable_thinking": false}'
    assert got["override_generation_config"] == '{"temperature": 0.5}'
    assert got["response_role"] == "model"
    for key in ("enable_force_include_usage", "return_tokens_as_token_ids",
                "trust_request_chat_template"):  # fmt: skip
        assert got[key] == "true"
    for flag in ("--default-chat-template-kwargs", "--override-generation-config"):
        with pytest.raises(click.BadParameter, match="JSON object"):
            serve.make_context("serve", [str(model), flag, "[1]"])


def test_vllms_frontend_and_admission_flags_become_engine_parameters(tmp_path: Path) -> None:
    """--chat-template-content-format, --exclude-tools-when-tool-choice-none,
    --sse-keep-alive-interval, --max-num-queued-reqs, --max-num-queued-tokens and
    --enable-tokenizer-info-endpoint: options of kiln serve (no longer refused as vLLM
    flags kiln lacks), in its --help, each a parameter of the model's config."""
    from kiln.cli.llm_options import served_models
    from kiln.cli.serve import serve
    from kiln.cli.vllm_command import VLLM_SERVE_FLAGS

    model = tmp_path / "m"
    model.mkdir()
    flags = {"--chat-template-content-format": "openai", "--sse-keep-alive-interval": "0.5",
             "--max-num-queued-reqs": "8", "--max-num-queued-tokens": "4096"}  # fmt: skip
    switches = ["--exclude-tools-when-tool-choice-none", "--enable-tokenizer-info-endpoint"]
    assert set(flags) | set(switches) <= VLLM_SERVE_FLAGS  # vLLM's names
    args = [str(model), *(x for kv in flags.items() for x in kv), *switches]
    ctx = serve.make_context("serve", args)
    (config,) = served_models(ctx.params["model_paths"], (), ctx.params)
    got = {k: v.string_value for k, v in config.parameters.items()}
    assert got["chat_template_content_format"] == "openai"
    assert got["sse_keep_alive_interval"] == "0.5"
    assert (got["max_num_queued_reqs"], got["max_num_queued_tokens"]) == ("8", "4096")
    assert got["exclude_tools_when_tool_choice_none"] == "true"
    assert got["enable_tokenizer_info_endpoint"] == "true"
    shown = {o for p in serve.params if not getattr(p, "hidden", False) for o in p.opts}
    assert set(flags) | set(switches) <= shown  # in --help
    # vLLM's --no- spellings of the switches: accepted, nothing turned on
    ctx = serve.make_context("serve", [str(model), "--no-exclude-tools-when-tool-choice-none"])
    assert ctx.params["exclude_tools_when_tool_choice_none"] is None
    bad = [["--chat-template-content-format", "jinja"], ["--sse-keep-alive-interval", "-1"],
           ["--sse-keep-alive-interval", "soon"], ["--max-num-queued-reqs", "-1"],
           ["--max-num-queued-tokens", "many"]]  # fmt: skip
    for argv in bad:
        with pytest.raises(click.BadParameter) as refused:
            serve.make_context("serve", [str(model), *argv])
        param = refused.value.param  # click's message names it
        assert param is not None and argv[0] in param.opts


def test_vllms_admission_gates_become_engine_parameters(tmp_path: Path) -> None:
    """--watermark and --scheduler-reserve-full-isl (vLLM's scheduler flags, refused before
    as flags kiln lacks): parameters of the model's config, read into the engine's."""
    from kiln.backends.base import InstanceSpec
    from kiln.cli.llm_options import served_models
    from kiln.cli.serve import serve
    from kiln.cli.vllm_command import VLLM_SERVE_FLAGS
    from kiln.core.errors import KilnError
    from kiln.llm.backend import engine_config

    assert {"--watermark", "--scheduler-reserve-full-isl"} <= VLLM_SERVE_FLAGS
    model = tmp_path / "m"
    model.mkdir()
    instance = InstanceSpec("m_0", "cpu", 0, 0, 1)
    ctx = serve.make_context("serve", [str(model)])
    (config,) = served_models(ctx.params["model_paths"], (), ctx.params)
    settings = engine_config(config, instance)
    assert (settings.watermark, settings.scheduler_reserve_full_isl) == (0.0, True)  # vLLM's
    args = [str(model), "--watermark", "0.05", "--no-scheduler-reserve-full-isl"]
    ctx = serve.make_context("serve", args)
    (config,) = served_models(ctx.params["model_paths"], (), ctx.params)
    got = {k: v.string_value for k, v in config.parameters.items()}
    assert (got["watermark"], got["scheduler_reserve_full_isl"]) == ("0.05", "false")
    settings = engine_config(config, instance)
    assert (settings.watermark, settings.scheduler_reserve_full_isl) == (0.05, False)
    with pytest.raises(click.BadParameter, match="0<=x<1"):
        serve.make_context("serve", [str(model), "--watermark", "1"])
    config.parameters["watermark"].string_value = "lots"
    with pytest.raises(KilnError, match="model 'm': parameter watermark must be a number"):
        engine_config(config, instance)


def test_vllms_metric_switches_become_engine_parameters(tmp_path: Path) -> None:
    """--kv-cache-metrics, --kv-cache-metrics-sample and --enable-mfu-metrics (accepted as
    no-ops before): parameters of the model's config, read into the engine's switches."""
    from kiln.backends.base import InstanceSpec
    from kiln.cli.llm_options import served_models
    from kiln.cli.serve import serve
    from kiln.cli.vllm_flags import ACCEPTED_SWITCHES, ACCEPTED_VALUES
    from kiln.core.errors import KilnError
    from kiln.llm.backend import engine_config

    flags = {"--kv-cache-metrics", "--kv-cache-metrics-sample", "--enable-mfu-metrics"}
    assert flags.isdisjoint({*ACCEPTED_SWITCHES, *ACCEPTED_VALUES})
    model = tmp_path / "m"
    model.mkdir()
    instance = InstanceSpec("m_0", "cpu", 0, 0, 1)
    ctx = serve.make_context("serve", [str(model)])
    (config,) = served_models(ctx.params["model_paths"], (), ctx.params)
    observe = engine_config(config, instance).observability
    assert (observe.kv_cache_metrics, observe.kv_cache_metrics_sample,
            observe.enable_mfu_metrics) == (False, 0.01, False)  # vLLM's defaults  # fmt: skip
    args = [str(model), "--kv-cache-metrics", "--kv-cache-metrics-sample", "0.25",
            "--enable-mfu-metrics"]  # fmt: skip
    ctx = serve.make_context("serve", args)
    (config,) = served_models(ctx.params["model_paths"], (), ctx.params)
    got = {k: v.string_value for k, v in config.parameters.items()}
    assert (got["kv_cache_metrics"], got["kv_cache_metrics_sample"],
            got["enable_mfu_metrics"]) == ("true", "0.25", "true")  # fmt: skip
    observe = engine_config(config, instance).observability
    assert (observe.kv_cache_metrics, observe.kv_cache_metrics_sample,
            observe.enable_mfu_metrics) == (True, 0.25, True)  # fmt: skip
    with pytest.raises(click.BadParameter, match="0<x<=1"):
        serve.make_context("serve", [str(model), "--kv-cache-metrics-sample", "0"])
    config.parameters["kv_cache_metrics_sample"].string_value = "2"
    with pytest.raises(KilnError, match=r"model 'm': parameter kv_cache_metrics_sample must "
                       r"be a number in \(0, 1\], got '2'"):  # fmt: skip
        engine_config(config, instance)
    config.parameters["kv_cache_metrics_sample"].string_value = "0.5"
    config.parameters["enable_mfu_metrics"].string_value = "sometimes"
    with pytest.raises(KilnError, match="parameter enable_mfu_metrics must be true or false"):
        engine_config(config, instance)
