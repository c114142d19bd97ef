"""vLLM's ``--profiler-config`` and the engine's profiling sessions: the config's checks
(each refusal names its field), and a session's delayed start, step limit and schedule on
the real ``torch.profiler``, counted in the trace it writes; the offline ``LLM``'s
``start_profile`` / ``stop_profile`` on a real model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import KilnError, Status
from kiln.llm.profiler_config import ProfilerConfig, check_session

torch = pytest.importorskip("torch")

from kiln.llm.profiler import EngineProfiler, trace_name  # noqa: E402


def config(folder: Path, **fields: Any) -> ProfilerConfig:
    parsed = ProfilerConfig.parse({"profiler": "torch", "torch_profiler_dir": str(folder),
                                   "torch_profiler_with_stack": False, **fields})  # fmt: skip
    assert parsed is not None
    return parsed


# ---- the config ----------------------------------------------------------------------------
def test_the_config_reads_vllms_json_and_its_defaults(tmp_path: Path) -> None:
    parsed = ProfilerConfig.parse(json.dumps({"profiler": "torch", "torch_profiler_dir": "~/t"}))
    assert parsed is not None
    assert parsed.torch_profiler_dir == str(Path("~/t").expanduser().resolve())
    assert (parsed.torch_profiler_use_gzip, parsed.torch_profiler_with_stack) == (True, True)
    assert (parsed.delay_iterations, parsed.max_iterations, parsed.active_iterations) == (0, 0, 5)
    # no profiler: nothing is served, as vLLM's default
    assert ProfilerConfig.parse("{}") is None
    assert ProfilerConfig.parse({"profiler": None}) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"profiler": "proton"}, "profiler 'proton' is not supported by kiln"),
        ({"profiler": "torch"}, "torch_profiler_dir must be set when profiler is 'torch'"),
        ({"profiler": "cuda", "torch_profiler_dir": "/t"}, "only applicable when profiler is"),
        ({"torch_profiler_dir": "/t"}, "only applicable when profiler is 'torch'"),
        ({"profiler": "torch", "torch_profiler_dir": "s3://b/t"}, "not to a URI"),
        ({"profiler": "torch", "torch_profiler_dir": "/t\x00x"}, "NUL"),
        ({"profiler": "torch", "torch_profiler_dir": 5}, "'torch_profiler_dir' must be a string"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "delay_iterations": -1},
         "'delay_iterations' must be between 0 and 4294967295, got -1"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": 2**40},
         "'max_iterations' must be between 0 and 4294967295"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "active_iterations": 0},
         "'active_iterations' must be between 1"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "warmup_iterations": "2"},
         "'warmup_iterations' must be an integer"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_use_gzip": 1},
         "'torch_profiler_use_gzip' must be true or false"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": ["XPU"]},
         "'XPU' is not supported by kiln"),
        ({"profiler": "torch", "torch_profiler_dir": "/t",
          "torch_profiler_activities": ["CPU", "CPU"]}, "must not contain duplicates"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": []},
         "must be a list of 1 to 2"),
        ({"profiler": "cuda", "torch_profiler_activities": ["CPU"]},
         "torch_profiler_activities is only applicable"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "proton_profiler_dir": "/p"},
         "'proton_profiler_dir': kiln has no Proton profiler"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "capture_torch_profiler": True},
         "'capture_torch_profiler' is not supported by kiln"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "colour": "red"},
         "field 'colour' is not supported by kiln"),
    ],
)  # fmt: skip
def test_each_bad_field_is_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(KilnError) as caught:
        ProfilerConfig.parse(fields)
    assert caught.value.status is Status.INVALID_ARG
    assert message in caught.value.message
    assert caught.value.message.startswith("llm backend: profiler_config: ")


def test_text_that_is_not_a_json_object_is_refused() -> None:
    for raw in ("{", "[1]", '"torch"'):
        with pytest.raises(KilnError, match=r"not JSON|must be a JSON object"):
            ProfilerConfig.parse(raw)


@pytest.mark.parametrize(
    ("prefix", "delay", "limit", "message"),
    [
        ("../etc", None, None, "profile_prefix must be 1-128 ASCII characters"),
        ("a/b", None, None, "profile_prefix"),
        ("x" * 129, None, None, "profile_prefix"),
        ("", None, None, "profile_prefix"),
        ("é", None, None, "profile_prefix"),
        (7, None, None, "profile_prefix"),
        (None, -1, None, "delay_iterations must be between 0 and 4294967295, got -1"),
        (None, True, None, "delay_iterations must be an integer"),
        (None, None, 2**32, "max_iterations must be between 0 and 4294967295"),
        (None, None, 1.5, "max_iterations must be an integer"),
    ],
)
def test_a_sessions_overrides_are_checked(
    prefix: Any, delay: Any, limit: Any, message: str
) -> None:
    with pytest.raises(KilnError) as caught:
        check_session(prefix, delay, limit)
    assert message in caught.value.message
    assert check_session("run-1.a_b", 3, 0) == ("run-1.a_b", 3, 0)


def test_trace_names_keep_file_name_characters() -> None:
    assert trace_name("org/llama 3", None) == "org_llama_3_tp0"
    assert trace_name("tiny", "run1", 1) == "run1_tiny_tp1"


# ---- sessions on the real torch.profiler ---------------------------------------------------
def steps_in(files: list[str], name: str = "kiln::step") -> int:
    """How many ``name`` ranges the session's trace holds."""
    [trace] = [f for f in files if ".pt.trace.json" in f]
    opener = gzip.open if trace.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sum(1 for e in events if e.get("name") == name and e.get("ph") == "X")


def run_steps(profiler: EngineProfiler, n: int) -> None:
    """What ``LLMEngine.step`` does around a model run, with a matmul for the model."""
    x = torch.ones(8, 8)
    for _ in range(n):
        with profiler.annotate("kiln::step"):
            x = x @ x / 8
        profiler.step()


def test_a_session_records_until_stopped(tmp_path: Path) -> None:
    profiler = EngineProfiler(config(tmp_path), "tiny", "cpu")
    assert profiler.stop() == []  # no session: nothing to stop (vLLM ignores it)
    profiler.start("a", None, None)
    with pytest.raises(KilnError) as caught:
        profiler.start("b", None, None)
    assert caught.value.status is Status.CONFLICT and "already active" in caught.value.message
    run_steps(profiler, 3)
    files = profiler.stop()
    assert not profiler.active and not profiler.running
    assert steps_in(files) == 3
    assert all(Path(f).name.startswith("a_tiny_tp0.") for f in files)
    [table] = [f for f in files if f.endswith(".profiler_out.txt")]
    assert "aten::" in Path(table).read_text() and "kiln::step" in Path(table).read_text()
    # a new session may start once the last one ended
    profiler.start(None, None, None)
    run_steps(profiler, 1)
    assert steps_in(profiler.stop()) == 1


def test_delay_and_max_iterations_bound_what_is_recorded(tmp_path: Path) -> None:
    profiler = EngineProfiler(config(tmp_path, delay_iterations=2, max_iterations=3), "m", "cpu")
    profiler.start(None, None, None)
    run_steps(profiler, 1)
    assert profiler.active and not profiler.running  # waiting for its delay
    run_steps(profiler, 10)
    assert not profiler.active  # stopped itself after three recorded steps
    # two steps skipped, then three recorded
    assert steps_in(profiler.written) == 3
    # a request's overrides replace the config's for its session
    profiler.start("over", 0, 4)
    run_steps(profiler, 9)
    assert steps_in(profiler.written) == 4


def test_a_schedule_discards_its_wait_and_warmup_steps(tmp_path: Path) -> None:
    cfg = config(tmp_path, wait_iterations=1, warmup_iterations=1, active_iterations=2)
    profiler = EngineProfiler(cfg, "m", "cpu")
    profiler.start(None, None, None)
    run_steps(profiler, 6)
    assert steps_in(profiler.stop()) == 2


def test_gpu_only_profilers_are_refused_on_a_cpu(tmp_path: Path) -> None:
    cuda = ProfilerConfig.parse({"profiler": "cuda"})
    assert cuda is not None
    with pytest.raises(KilnError, match="profiler 'cuda' needs a GPU"):
        EngineProfiler(cuda, "m", "cpu")
    with pytest.raises(KilnError, match="'CUDA' needs a GPU"):
        EngineProfiler(config(tmp_path, torch_profiler_activities=["CUDA"]), "m", "cpu")


def test_the_offline_llm_profiles_its_steps(tmp_path: Path) -> None:
    from kiln.llm.offline import LLM, SamplingParams
    from tests.llm_models import build_tiny_llm

    folder = build_tiny_llm(tmp_path / "tiny")
    llm = LLM(folder, max_model_len=64, kv_cache_memory_bytes=1 << 20, block_size=4,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "t"),
                               "torch_profiler_with_stack": False})  # fmt: skip
    with pytest.raises(KilnError, match="profile_prefix"):
        llm.start_profile("../x")
    llm.start_profile("offline")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], params)
    files = llm.stop_profile()
    # one prefill step and four decode steps
    assert steps_in(files) == 5
    assert Path(files[0]).name.startswith("offline_tiny_tp0.")
    plain = LLM(folder, max_model_len=64, kv_cache_memory_bytes=1 << 20, block_size=4)
    with pytest.raises(KilnError, match="profiling is not enabled") as caught:
        plain.start_profile()
    assert caught.value.status is Status.NOT_FOUND
