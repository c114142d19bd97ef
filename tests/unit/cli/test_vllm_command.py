"""``kiln serve`` reads a ``vllm serve`` command line as vLLM's parser does: config files,
underscores, ``-O``, dotted JSON keys, several values per flag, and every other vLLM flag
refused by name with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest

from kiln.cli.serve import serve
from kiln.cli.vllm_command import FAMILIES, VLLM_SERVE_FLAGS, why_unsupported


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    return path


def _params(args: list[str]) -> dict[str, Any]:
    return serve.make_context("serve", args).params


def test_a_vllm_flag_kiln_lacks_is_refused_by_name_with_its_reason(model: Path) -> None:
    cases = {
        "--enable-eplb": "no expert parallelism",
        "--mamba-cache-dtype": "state-space",
        "--data-parallel-rank": "one kiln per replica",
        "-dpn": "one kiln per replica",  # a short one, not a cluster of -d -p -n
        "--mm-processor-kwargs": "multimodal",
        "--worker-extension-cls": "no user code",
        "--kv-offloading-size": "no offloading",
        "--sleep-mode-offload-cudagraph": "no other state kept",
        "--sleep-preserve-parameter-names": "read again from the model files",
        "--fingerprint-mode": "no counterpart",
    }
    for flag, why in cases.items():
        with pytest.raises(click.UsageError) as caught:
            _params([str(model), flag, "x"])
        message = caught.value.format_message()
        assert message.startswith(f"vLLM's {flag} is not supported by kiln: ")
        assert why in message
    # a flag that is nobody's stays click's own error
    with pytest.raises(click.NoSuchOption, match="--bogus"):
        _params([str(model), "--bogus"])


def test_the_no_form_of_a_vllm_switch_asks_for_nothing(model: Path) -> None:
    params = _params(
        [str(model), "--no-enable-eplb", "--no-async-scheduling", "--async-scheduling"]
    )
    assert params["model_paths"] == (model,)
    with pytest.raises(click.NoSuchOption):
        _params([str(model), "--no-such-thing"])  # not vLLM's


def test_every_vllm_flag_is_kilns_or_has_a_reason() -> None:
    known = {o for p in serve.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    for flag in VLLM_SERVE_FLAGS:
        assert flag in known or why_unsupported(flag)
    # each family names flags vLLM has (a typo in a prefix would match nothing)
    for prefixes, _ in FAMILIES:
        for prefix in prefixes:
            assert any(f == prefix or f.startswith(prefix) for f in VLLM_SERVE_FLAGS), prefix
    assert why_unsupported("--not-vllms") is None


def test_token_counts_read_as_vllm_reads_them(model: Path) -> None:
    params = _params([str(model), "--max_model_len", "32k", "--max-num-batched-tokens", "2K"])
    assert (params["max_model_len"], params["max_num_batched_tokens"]) == (32_000, 2048)
    assert _params([str(model), "--max-model-len", "25.6k"])["max_model_len"] == 25_600
    for auto in ("auto", "-1"):
        assert _params([str(model), "--max-model-len", auto])["max_model_len"] is None
    for bad, why in (("2.5K", "no decimals"), ("0", "positive"), ("lots", "count of tokens")):
        with pytest.raises(click.BadParameter, match=why):
            _params([str(model), "--max-model-len", bad])
    with pytest.raises(click.BadParameter):
        _params([str(model), "--max-num-batched-tokens", "auto"])  # no auto here


def test_optimization_levels_and_short_spellings(model: Path) -> None:
    args = [str(model), "-O3", "-O", "2", "-O=1", "-cc", '{"level": 3}', "-pp", "1", "-dp", "1",
            "--device-memory-utilization", "0.5"]  # fmt: skip
    assert _params(args)["gpu_memory_utilization"] == 0.5
    with pytest.raises(click.BadParameter, match="--data-parallel-size '2'"):
        _params([str(model), "-dp", "2"])


def test_dotted_keys_and_spec_shorthands_build_one_json_object(model: Path) -> None:
    params = _params([str(model), "--speculative-config.method", "ngram",
                      "--speculative_config.num_speculative_tokens=3",
                      "--speculative-config.draft.depth", "2"])  # fmt: skip
    assert json.loads(params["speculative_config"]) == {
        "method": "ngram", "num_speculative_tokens": 3, "draft": {"depth": 2}
    }  # fmt: skip
    params = _params([str(model), "--spec-method", "ngram", "--spec-tokens", "4",
                      "-sc", '{"prompt_lookup_max": 5, "method": "draft_model"}'])  # fmt: skip
    assert json.loads(params["speculative_config"]) == {
        "prompt_lookup_max": 5, "method": "ngram", "num_speculative_tokens": 4
    }  # fmt: skip
    with pytest.raises(click.BadParameter, match="needs a value"):
        _params([str(model), "--spec-tokens"])


def test_profiler_config_is_read_whole_or_dotted_and_checked_at_once(model: Path) -> None:
    params = _params([str(model), "--profiler-config.profiler", "torch",
                      "--profiler-config.torch_profiler_dir=/tmp/t",
                      "--profiler-config.max_iterations", "5"])  # fmt: skip
    assert json.loads(params["profiler_config"]) == {
        "profiler": "torch", "torch_profiler_dir": "/tmp/t", "max_iterations": 5
    }  # fmt: skip
    with pytest.raises(click.BadParameter, match="torch_profiler_dir must be set"):
        _params([str(model), "--profiler-config", '{"profiler": "torch"}'])
    with pytest.raises(click.BadParameter, match="'proton' is not supported by kiln"):
        _params([str(model), "--profiler-config.profiler", "proton"])


def test_flags_that_take_several_values(model: Path, tmp_path: Path) -> None:
    params = _params(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', str(model)])
    assert params["lora_modules"] == ("a=/x", '{"name": "b", "path": "/y"}')
    assert params["model_paths"] == (model,)
    params = _params(["--api-key", "k1", "k2", str(model)])
    assert params["api_keys"] == ("k1", "k2") and params["model_paths"] == (model,)
    params = _params(["--served-model-name", "smol", str(model), "--port", "9000"])
    assert params["served_model_names"] == ("smol",) and params["model_paths"] == (model,)
    params = _params([str(model), "--cudagraph-capture-sizes", "1", "2", "4", "--port", "9"])
    assert params["http_port"] == 9


def test_a_config_file_holds_flags_and_the_command_line_wins(model: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {model}\n"
        "port: 9001\n"
        "max_model_len: 4k\n"
        "enable-prefix-caching: false\n"
        "enforce-eager: true\n"
        "api-key: [one, two]\n"
        "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n"
        "async-scheduling: true\n"
    )
    params = _params(["--config", str(config)])
    assert params["models"] == (model,) and params["http_port"] == 9001
    assert params["max_model_len"] == 4000 and params["enable_prefix_caching"] is False
    assert params["enforce_eager"] is True and params["api_keys"] == ("one", "two")
    assert json.loads(params["speculative_config"])["num_speculative_tokens"] == 2
    # the command line over the file: a value, a repeated option, the model
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    params = _params([str(other), f"--config={config}", "--port", "9002", "--api-key", "three"])
    assert params["http_port"] == 9002 and params["api_keys"] == ("three",)
    assert params["model_paths"] == (other,) and params["models"] == ()


@pytest.mark.parametrize(
    ("text", "name", "why"),
    [
        ("port: [1\n", "serve.yaml", "line 2"),
        ("- port\n", "serve.yaml", "mapping of flags"),
        ("port: 1\n", "serve.json", "not a .yaml"),
        ("enable-eplb: true\n", "serve.yaml", "vLLM's --enable-eplb is not supported"),
    ],
)
def test_a_bad_config_file_is_named(tmp_path: Path, text: str, name: str, why: str) -> None:
    config = tmp_path / name
    config.write_text(text)
    with pytest.raises(click.UsageError) as caught:
        _params(["--config", str(config)])
    assert why in caught.value.format_message()


def test_a_missing_or_repeated_config_file(tmp_path: Path) -> None:
    with pytest.raises(click.BadParameter, match="No such file"):
        _params(["--config", str(tmp_path / "none.yaml")])
    with pytest.raises(click.BadParameter, match="needs a file"):
        _params(["--config"])
    config = tmp_path / "c.yaml"
    config.write_text("port: 1\n")
    with pytest.raises(click.BadParameter, match="given twice"):
        _params(["--config", str(config), "--config", str(config)])


def test_several_served_names_for_one_model(model: Path, tmp_path: Path) -> None:
    from kiln.cli.llm_options import served_aliases, served_models

    params = _params([str(model), "--served-model-name", "a", "b", "c"])
    names = params["served_model_names"]
    assert names == ("a", "b", "c")
    (config,) = served_models(params["model_paths"], names, params)
    assert config.name == "a"
    assert served_aliases(params["model_paths"], names) == {"b": "a", "c": "a"}
    with pytest.raises(click.BadParameter, match="'b' is given twice"):
        served_aliases((model,), ("a", "b", "b"))
    # two models: one name each, as before
    other = tmp_path / "o.gguf"
    other.write_bytes(b"")
    assert served_aliases((model, other), ("a", "b")) == {}
    with pytest.raises(click.BadParameter, match="3 names for 2 --model"):
        served_models((model, other), ("a", "b", "c"), params)


def test_uvicorn_log_level_reaches_the_http_server(model: Path) -> None:
    import logging

    from kiln.launch import _uvicorn

    assert _params([str(model)])["uvicorn_log_level"] == "warning"
    assert _params([str(model), "--uvicorn-log-level", "debug"])["uvicorn_log_level"] == "debug"
    with pytest.raises(click.BadParameter):
        _params([str(model), "--uvicorn-log-level", "loud"])
    logger = logging.getLogger("uvicorn.error")
    before = logger.level
    try:
        _uvicorn(object(), "127.0.0.1", 0, 1.0, log_level="debug")
        assert logger.level == logging.DEBUG
        _uvicorn(object(), "127.0.0.1", 0, 1.0)
        assert logger.level == logging.WARNING  # kiln's default: quiet
    finally:
        logger.setLevel(before)


def test_vllms_sleep_mode_switch_runs_unchanged(model: Path) -> None:
    """vLLM needs --enable-sleep-mode before /sleep frees memory; kiln's engine can always
    sleep, so the switch is accepted and asks for nothing."""
    params = _params([str(model), "--enable-sleep-mode"])
    assert params["model_paths"] == (model,)
    assert not any(k.startswith("vllm_") for k in params)
