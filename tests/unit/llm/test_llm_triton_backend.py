"""``attention_backend: triton`` wired into the engine, run on CPU by Triton's interpreter
(``TRITON_INTERPRET=1``): the Triton decode kernel, fused add+RMSNorm, SiLU-and-mul and RoPE
replace torch's operations in the Llama skeleton (prefills through eager flex), and greedy
tokens stay identical to ``transformers`` in float32: batched, with chunked prefill beside
decodes, with a sliding window, and through the CUDA-graph static buffers run uncaptured
(padding rows, block tables padded to the longest context, metadata updated in place).
Capture and replay on a GPU, and bf16 with the kernels on vs off: tests/gpu."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton")

from kiln.core.errors import KilnError
from kiln.llm import kernels
from kiln.llm.attention_flex import FlexMetadata, resolve_attention_backend
from kiln.llm.config import EngineConfig
from kiln.llm.cuda_graphs import DecodeGraphs
from kiln.llm.engine import LLMEngine
from kiln.llm.models.llama import MLP, Attention, RMSNorm
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm, reference_generate

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# every kernel call is interpreted (numpy per program): few, short requests
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(7, 26)), [250]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def triton_engine(folder: Path, **kw: int) -> LLMEngine:
    # a small cache: eager flex (the prefills) scores every slot of it
    kw = {"num_gpu_blocks": 24} | kw
    config = EngineConfig(attention_backend="triton", **kw)  # type: ignore[arg-type]
    return LLMEngine(folder, config)


def test_triton_backend_matches_transformers_with_mixed_steps(llama: Path) -> None:
    expected = [reference_generate(llama, p, GREEDY.max_tokens) for p in PROMPTS]
    engine = triton_engine(llama, max_num_batched_tokens=7)
    runner = engine.runner
    assert runner.attention_backend == "triton" and runner.paged_flex
    # every norm, MLP and attention of the Llama skeleton switched to its kernel
    model = runner.model
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, MLP, Attention))]
    assert switched and all(m.use_triton for m in switched)
    metas: list[FlexMetadata] = []
    build = FlexMetadata.build

    def observed(*args: object, **kw: object) -> FlexMetadata:
        meta = build(*args, **kw)  # type: ignore[arg-type]
        metas.append(meta)
        return meta

    FlexMetadata.build = observed  # type: ignore[method-assign]
    try:
        assert engine.generate(PROMPTS, GREEDY) == expected
    finally:
        FlexMetadata.build = build  # type: ignore[method-assign]
    # decodes went to the Triton kernel (no flex group of one-token queries), prefill chunks
    # to flex, and some steps had both
    assert any(m.decode is not None for m in metas)
    assert all(not g.is_decode for m in metas for g in m.groups)
    assert any(m.decode is not None and m.groups for m in metas)


def test_triton_backend_with_a_sliding_window(tmp_path: Path) -> None:
    """Mistral with a 6-token window over 4-token pages: decodes slide past it (the kernel
    starts its walk inside the window)."""
    folder = build_tiny_llm(tmp_path / "m", arch="mistral", sliding_window=6)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [reference_generate(folder, p, 10) for p in PROMPTS]
    engine = triton_engine(folder, block_size=4, num_gpu_blocks=40)
    assert engine.generate(PROMPTS, params) == expected


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_triton_backend_on_the_llama_skeleton_s_relatives(tmp_path: Path, arch: str) -> None:
    """Qwen2 (q/k/v biases: the rotated fused output), Qwen3 (its per-head q/k norms through
    the RMSNorm kernel, its own RoPE path), Phi-3 (its own partial RoPE, the SiLU-and-mul
    kernel on its checkpoint-fused gate/up)."""
    extra = {"qwen3": {"head_dim": 16}, "phi3": {"pad_token_id": 0}}.get(arch, {})
    folder = build_tiny_llm(tmp_path / arch, arch=arch, **extra)
    expected = [reference_generate(folder, p, 4) for p in PROMPTS[:2]]
    engine = triton_engine(folder)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert engine.generate(PROMPTS[:2], params) == expected


def test_static_buffers_of_cuda_graphs_with_the_triton_decode(llama: Path) -> None:
    """The graphs' path uncaptured: block tables padded to max_model_len's pages, dummy rows
    in the scratch page, the PagedDecode tensors overwritten in place each step."""
    prompts = [[5, 17, 42, 99, 3], list(range(7, 26)), [250], [9, 8, 7], [1, 2]]
    lengths = [6, 4, 5, 3, 2]
    want = [reference_generate(llama, p, n) for p, n in zip(prompts, lengths, strict=True)]
    engine = LLMEngine(
        llama,
        EngineConfig(
            attention_backend="triton", num_gpu_blocks=16, max_num_seqs=8, max_model_len=128
        ),
    )
    assert engine.runner.graphs is None  # no GPU: never captured
    graphs = DecodeGraphs(engine.runner, [1, 2, 4], capture=False)
    meta = graphs.graphs[4].metas[None]
    assert meta.decode is not None and not meta.groups
    assert meta.decode.block_table.shape == (4, 128 // 16)
    table = meta.decode.block_table
    # every static tensor the graphs read is a view of the staging buffer: one copy a step
    assert graphs.staging is not None
    buffer = graphs.staging.device.untyped_storage().data_ptr()
    for entry in graphs.graphs.values():
        decode = entry.metas[None].decode
        assert decode is not None
        for t in (entry.metas[None].slot_mapping, *decode.tensors()):
            assert t.untyped_storage().data_ptr() == buffer
    assert graphs.input_ids.untyped_storage().data_ptr() == buffer
    engine.runner.graphs = graphs
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    assert engine.generate(prompts, params) == want
    assert graphs.num_replays == 4
    assert graphs.graphs[4].metas[None].decode.block_table is table  # updated in place
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_triton_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend("triton", cpu, 16) == "triton"  # the interpreter
    assert resolve_attention_backend("auto", cpu, 16) != "triton"  # never picked on CPU
    assert resolve_attention_backend("auto", cuda, 16) == "flex"  # opt-in until a GPU ran it
    assert resolve_attention_backend("triton", cuda, 16) == "triton"
    # Gemma 2's soft-capping: its prefills need the portable backend
    assert resolve_attention_backend("auto", cuda, 16, softcap=True) == "torch"
    with pytest.raises(KilnError, match="attention_backend 'triton' has no attention logit"):
        resolve_attention_backend("triton", cuda, 16, softcap=True)
    with pytest.raises(KilnError, match="'triton' on CUDA needs block_size >= 16, got 8"):
        resolve_attention_backend("triton", cuda, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KilnError, match="'triton' runs on a CUDA GPU, not on cpu"):
        resolve_attention_backend("triton", cpu, 16)
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(KilnError, match="'triton' needs triton"):
        resolve_attention_backend("triton", cuda, 16)
    # flex is the switch that turns the kernels off
    assert resolve_attention_backend("flex", cuda, 16) == "flex"


def test_the_kernels_stay_off_on_other_backends(llama: Path) -> None:
    engine = LLMEngine(llama, EngineConfig(attention_backend="flex", num_gpu_blocks=8))
    assert not any(getattr(m, "use_triton", False) for m in engine.runner.model.modules())


def test_attention_backend_flag_reaches_the_engine_config(llama: Path) -> None:
    """``kiln serve --model M --attention-backend flex``: the parameter the engine reads."""
    from click.testing import CliRunner

    from kiln.backends.base import InstanceSpec
    from kiln.cli import main
    from kiln.cli.llm_options import served_models
    from kiln.llm.backend import engine_config

    (config,) = served_models((llama,), ("m",), {"attention_backend": "flex"})
    assert config.parameters["attention_backend"].string_value == "flex"
    spec = InstanceSpec(name="m_0", kind="gpu", device_id=0, index=0, total_instances=1)
    assert engine_config(config, spec).attention_backend == "flex"
    bad = CliRunner().invoke(main, ["serve", "--model", str(llama), "--attention-backend", "x"])
    assert bad.exit_code == 2 and "'x' is not one of" in bad.output
