"""CUDA-graph decode, the device-independent parts: capture sizes, bucket choice, padding,
the eager-fallback decision, and the static-buffer path itself run uncaptured on CPU
(token-identical to ``transformers``). Capture and replay are tested in tests/gpu."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.cuda_graphs import (
    DecodeGraphs,
    _Staging,
    capture_sizes,
    is_pure_decode,
    pad_decode_batch,
    pick_size,
)
from kiln.llm.engine import LLMEngine
from kiln.llm.scheduler import SchedulerOutput
from kiln.llm.sequence import SamplingParams, Sequence
from tests.llm_models import build_tiny_llm, reference_generate
from tests.unit.llm.test_llm_scheduling import _config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_staging_writes_a_decode_step_in_one_copy() -> None:
    """The triton backend's decode inputs: real rows from the sequences, dummy rows at slot 0
    of the scratch page, all in one device buffer (the views the graphs read)."""
    staging = _Staging(biggest=4, width=3, device=torch.device("cpu"))
    staging.np_tables[:] = -7  # stale entries past a row's length stay: never read
    # two sequences: 17 tokens cached (page size 8: the new one goes to their third page),
    # and 2 cached (first page)
    staging.write([11, 12], [17, 2], [[5, 6, 9], [4]], [17, 2], 4, 8, scratch_page=10)
    assert staging.rows[0].tolist() == [11, 12, 0, 0]  # token ids
    assert staging.rows[1].tolist() == [17, 2, 0, 0]  # positions
    assert staging.rows[2].tolist() == [9 * 8 + 1, 4 * 8 + 2, 80, 80]  # KV slots
    assert staging.rows[3].tolist() == [0, 1, 2, 3]  # each row's token
    assert staging.lens.tolist() == [18, 3, 1, 1]
    assert staging.tables[:, 0].tolist() == [5, 4, 10, 10]
    assert staging.tables[0].tolist() == [5, 6, 9]
    assert staging.tables[1, 1:].tolist() == [-7, -7]
    # a smaller step copies its own rows' prefix; the views never move
    views = [t.data_ptr() for t in (staging.rows, staging.lens, staging.tables)]
    staging.write([13], [18], [[5, 6, 9]], [18], 1, 8, scratch_page=10)
    assert staging.rows[:3, 0].tolist() == [13, 18, 9 * 8 + 2]
    assert [t.data_ptr() for t in (staging.rows, staging.lens, staging.tables)] == views
    assert staging.rows.untyped_storage().data_ptr() == staging.device.data_ptr()


def test_capture_sizes_are_powers_of_two_up_to_max_num_seqs() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    # configured sizes: deduplicated, sorted, bounded by max_num_seqs
    assert capture_sizes(16, (8, 1, 8, 32, 3)) == [1, 3, 8]


def test_pick_size_takes_the_smallest_bucket_that_fits() -> None:
    sizes = [1, 2, 4, 8]
    assert [pick_size(sizes, b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert pick_size(sizes, 9) is None


def test_padding_rows_point_at_the_scratch_page() -> None:
    tables, computed = pad_decode_batch([[3, 4], [7]], [20, 2], 4, scratch_page=99)
    assert tables == [[3, 4], [7], [99], [99]]
    assert computed == [20, 2, 0, 0]


def _seq(prompt: int, computed: int, output: int = 0) -> Sequence:
    seq = Sequence("r", list(range(prompt)), SamplingParams(max_tokens=4), ())
    for t in range(output):
        seq.append(t)
    seq.num_computed_tokens = computed
    return seq


def test_only_pure_decode_steps_use_graphs() -> None:
    decoding = _seq(5, 5, output=1)
    assert is_pure_decode(SchedulerOutput([decoding], [1]))
    # a one-token prompt chunk that does not reach the end is not a decode
    assert not is_pure_decode(SchedulerOutput([_seq(5, 3)], [1]))
    assert not is_pure_decode(SchedulerOutput([decoding, _seq(5, 0)], [1, 5]))
    forked = _seq(1, 0)
    forked.forks = [_seq(1, 0)]
    assert not is_pure_decode(SchedulerOutput([forked], [1]))
    assert not is_pure_decode(SchedulerOutput())


@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding-window"])
def test_static_buffer_decode_matches_transformers(tmp_path: Path, window: int | None) -> None:
    """With a window of 4 (Mistral), the static metadata is windowed too: the 19-token prompt
    decodes past it, its window's edge moving through the padded page lists in place."""
    if window is None:
        folder = build_tiny_llm(tmp_path / "m")
    else:
        folder = build_tiny_llm(tmp_path / "m", arch="mistral", sliding_window=window)
    prompts = [[5, 17, 42, 99, 3], list(range(7, 26)), [250], [9, 8, 7], [1, 2]]
    lengths = [6, 4, 5, 3, 2]  # the batch shrinks as requests finish: 5, 4, 3, 1 rows
    want = [reference_generate(folder, p, n) for p, n in zip(prompts, lengths, strict=True)]
    engine = LLMEngine(
        folder, EngineConfig(attention_backend="flex", num_gpu_blocks=16, max_num_seqs=8)
    )
    assert engine.runner.graphs is None  # no GPU: never captured
    graphs = DecodeGraphs(engine.runner, [1, 2, 4], capture=False)
    assert list(graphs.graphs[4].metas) == [window]
    engine.runner.graphs = graphs
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    assert engine.generate(prompts, params) == want
    # 5 rows ran eagerly (no bucket); 4, 3 (padded to 4), 2 and 1 through the buffers
    assert graphs.num_replays == 4
    # the dummy rows wrote the scratch page, which the block manager never hands out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    scratch = engine.runner.kv_cache[:, :, graphs.scratch_page]
    assert scratch.abs().sum() > 0
    assert torch.equal(graphs.logit_index, torch.arange(4))


def test_capture_and_replay_run_on_the_models_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.cuda's streams, capture and replay act on the current device, which on an
    instance's thread is 0 whatever the model's: a fake torch.cuda records the device each
    call ran under (the model runs on the CPU for real)."""
    engine = LLMEngine(
        build_tiny_llm(tmp_path / "m"),
        EngineConfig(attention_backend="flex", num_gpu_blocks=16, max_num_seqs=2),
    )
    current: list[Any] = []
    calls: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def device(d: Any) -> Iterator[None]:
        current.append(d)
        yield
        current.pop()

    def note(what: str) -> None:
        calls.append((what, current[-1] if current else "no device set"))

    class Stream:
        def __init__(self, device: Any = None) -> None:
            note("stream")

        def wait_stream(self, other: Any) -> None:
            pass

    class CUDAGraph:
        def replay(self) -> None:
            note("replay")

    @contextlib.contextmanager
    def graph(g: Any, pool: Any = None, stream: Any = None) -> Iterator[None]:
        note("capture" if isinstance(stream, Stream) else "capture on torch's own stream")
        yield

    fake = {
        "device": device,
        "graph_pool_handle": lambda: note("pool"),
        "Stream": Stream,
        "current_stream": lambda device=None: Stream(),
        "stream": lambda s: contextlib.nullcontext(),
        "CUDAGraph": CUDAGraph,
        "graph": graph,
        "synchronize": lambda device=None: note("synchronize"),
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    engine.runner.graphs = DecodeGraphs(engine.runner, [1, 2])
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 17, 42]], greedy)  # its decode steps replay (the fake: nothing)
    model = engine.runner.device
    assert {what for what, _ in calls} == {"pool", "stream", "capture", "synchronize", "replay"}
    assert all(where == model for _, where in calls), calls


# -- config.pbtxt parameters and backend choice ----------------------------------------


def test_attention_and_cuda_graph_parameters_from_config_pbtxt() -> None:
    default = _config({})
    assert default.attention_backend == "auto" and not default.enforce_eager
    assert default.cuda_graph_sizes == ()
    config = _config(
        {"attention_backend": "Flex", "enforce_eager": "true", "cuda_graph_sizes": "1, 2,8 16"}
    )
    assert config.attention_backend == "flex" and config.enforce_eager
    assert config.cuda_graph_sizes == (1, 2, 8, 16)
    with pytest.raises(KilnError, match="attention_backend must be one of auto, torch, cpu, flex"):
        _config({"attention_backend": "flash"})
    with pytest.raises(KilnError, match="model 'm': parameter enforce_eager must be true or"):
        _config({"enforce_eager": "maybe"})
    with pytest.raises(KilnError, match="model 'm': parameter cuda_graph_sizes must be integers"):
        _config({"cuda_graph_sizes": "1,two"})
    with pytest.raises(KilnError, match=r"cuda_graph_sizes must be positive, got \[1, 0\]"):
        _config({"cuda_graph_sizes": "1 0"})


def test_flex_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.llm import kernels
    from kiln.llm.attention_flex import resolve_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, 16) == "cpu"  # numba is installed here
    assert resolve_attention_backend("auto", cpu, 16, torch.bfloat16) == "torch"
    # flex, the path measured on a GPU, even where triton imports (the test extra here):
    # kiln's Triton kernels are opt-in until they run on a GPU
    assert kernels.available()
    assert resolve_attention_backend("auto", cuda, 16) == "flex"
    assert resolve_attention_backend("triton", cuda, 16) == "triton"
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert resolve_attention_backend("auto", cuda, 16) == "flex"
    # pages smaller than a tensor-core tile keep the portable backend on CUDA
    assert resolve_attention_backend("auto", cuda, 8) == "torch"
    assert resolve_attention_backend("flex", cpu, 4) == "flex"
    assert resolve_attention_backend("torch", cuda, 16) == "torch"
    with pytest.raises(KilnError, match="'flex' on CUDA needs block_size >= 16, got 8"):
        resolve_attention_backend("flex", cuda, 8)


def test_cpu_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.llm import attention_cpu
    from kiln.llm.attention_flex import resolve_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention_backend("cpu", cpu, 16) == "cpu"
    with pytest.raises(KilnError, match="'cpu' needs dtype float32, got bfloat16"):
        resolve_attention_backend("cpu", cpu, 16, torch.bfloat16)
    with pytest.raises(KilnError, match="'cpu' runs on the CPU, not on cuda"):
        resolve_attention_backend("cpu", cuda, 16)
    # without numba: auto keeps the portable backend, an explicit 'cpu' says what is missing
    monkeypatch.setattr(attention_cpu, "numba", None)
    assert resolve_attention_backend("auto", cpu, 16) == "torch"
    with pytest.raises(KilnError, match=r"needs numba: pip install 'kiln-serve\[llm\]'"):
        resolve_attention_backend("cpu", cpu, 16)
