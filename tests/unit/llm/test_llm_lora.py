"""Multi-LoRA against ``transformers`` + PEFT: requests with different adapters (and none)
share one step, and each one's greedy tokens equal PEFT's with its adapter alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")

from kiln.core.errors import KilnError, Status
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.lora import (
    LoRAConfig,
    LoRARegistry,
    LoRARequest,
    lora_config,
    parse_lora_modules,
)
from kiln.llm.sequence import SamplingParams
from tests.llm_models import (
    all_blocks_returned,
    build_lora_adapter,
    build_tiny_llm,
    reference_generate_lora,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 70)), [250, 4, 8]]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        # every projection kiln fuses (q/k/v, gate/up) and the others
        "a": build_lora_adapter(base, root / "a", seed=1, r=8),
        # a part of the fused q/k/v only, rank-stabilised scaling, another rank
        "b": build_lora_adapter(
            base,
            root / "b",
            seed=2,
            r=4,
            target_modules=("q_proj", "v_proj", "up_proj"),
            use_rslora=True,
        ),
    }


@pytest.fixture(scope="module")
def expected(base: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    out: dict[str | None, list[list[int]]] = {}
    for name in (None, "a", "b"):
        path = adapters[name] if name else None
        out[name] = [reference_generate_lora(base, path, p, GREEDY.max_tokens) for p in PROMPTS]
    return out


def _engine(base: Path, lora: LoRAConfig | None = None, **kw: object) -> LLMEngine:
    config = EngineConfig(lora_config=lora or LoRAConfig(max_loras=2), **kw)  # type: ignore[arg-type]
    return LLMEngine(base, config)


def _request(name: str, path: Path) -> LoRARequest:
    return LoRARegistry.new_request(name, str(path))


def _run(
    engine: LLMEngine, jobs: list[tuple[str, list[int], LoRARequest | None]]
) -> dict[str, list[int]]:
    for rid, prompt, lora in jobs:
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id].extend(result.new_token_ids)
        engine.block_manager.check(engine.scheduler.running + list(engine.scheduler.waiting))
    return outputs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_one_mixed_batch_matches_peft_per_adapter(
    base: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]],
    backend: str,
) -> None:  # fmt: skip
    # the adapters do change the tokens (else the test would prove nothing)
    assert expected["a"] != expected[None] and expected["b"] != expected[None]
    engine = _engine(base, attention_backend=backend)
    loras = {name: _request(name, path) for name, path in adapters.items()}
    for request in loras.values():
        engine.add_lora(request)
    jobs = [
        (f"{name}-{i}", prompt, loras[name] if name else None)
        for i, prompt in enumerate(PROMPTS)
        for name in ("a", None, "b")
    ]
    first = engine.scheduler.schedule  # every request is admitted into the first step
    seen: list[set[str | None]] = []

    def schedule():  # type: ignore[no-untyped-def]
        out = first()
        seen.append({s.lora_request.lora_name if s.lora_request else None for s in out.seqs})
        return out

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    outputs = _run(engine, jobs)
    assert seen[0] == {"a", "b", None}, "the three kinds of request share one step"
    for i in range(len(PROMPTS)):
        for name in ("a", None, "b"):
            assert outputs[f"{name}-{i}"] == expected[name][i], (name, i)
    all_blocks_returned(engine)


def test_more_adapters_than_slots_wait_their_turn(
    base: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]]
) -> None:
    engine = _engine(base, LoRAConfig(max_loras=1, max_cpu_loras=1))
    loras = {name: _request(name, path) for name, path in adapters.items()}
    for request in loras.values():
        engine.add_lora(request)  # the host holds one: "a" is read again from its folder
    jobs = [(f"{n}-{i}", p, loras[n] if n else None) for i, p in enumerate(PROMPTS) for n in "ab"]
    jobs.append(("none", PROMPTS[0], None))
    for rid, prompt, lora in jobs:
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id].extend(result.new_token_ids)
        running = {s.lora_request.lora_int_id for s in engine.scheduler.running if s.lora_request}
        assert len(running) <= 1
    for rid, _, lora in jobs:
        i = 0 if rid == "none" else int(rid.split("-")[1])
        assert outputs[rid] == expected[lora.lora_name if lora else None][i], rid


def test_prefix_cache_is_keyed_by_adapter(
    base: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]]
) -> None:
    engine = _engine(base, block_size=4)
    a, b = _request("a", adapters["a"]), _request("b", adapters["b"])
    engine.add_lora(a)
    engine.add_lora(b)
    prompt = PROMPTS[1]  # 40 tokens: 9 full blocks to share, or not
    stats = engine.block_manager.stats
    hits = []
    for name, lora in (("a", a), ("b", b), (None, None), ("a", a), (None, None)):
        before = stats.hits
        assert _run(engine, [("r", prompt, lora)])["r"] == expected[name][1], name
        hits.append(stats.hits - before)
    # nobody reuses another adapter's (or the base model's) K/V; the same one again does
    assert hits == [0, 0, 0, 36, 36]


def _config(folder: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((folder / "adapter_config.json").read_text())
    return data


def _copy(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = {**_config(src), **changes}
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_naming_why(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = _engine(base, LoRAConfig(max_loras=1, max_lora_rank=4))

    def refused(path: Path, why: str) -> None:
        with pytest.raises(KilnError, match=why) as info:
            engine.add_lora(_request("bad", path))
        assert "LoRA adapter 'bad'" in str(info.value)

    refused(adapters["a"], r"rank 8 is above --max-lora-rank \(4\)")
    other = build_tiny_llm(tmp_path / "other", hidden_size=32, intermediate_size=64)
    refused(
        build_lora_adapter(other, tmp_path / "other-lora", seed=3, r=4),
        r"down_proj.lora_A.weight. has shape \[4, 64\], this model.s needs \[4, 128\] "
        r"\(an adapter for another base",
    )
    head = build_lora_adapter(
        base, tmp_path / "head", seed=4, r=4, target_modules=("q_proj", "lm_head")
    )
    refused(head, "target module 'lm_head' is not supported by kiln for this model")
    pickled = tmp_path / "pickled"
    shutil.copytree(adapters["b"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    refused(pickled, "adapter_model.bin is a pickle, which kiln never loads")
    big = _copy(adapters["b"], tmp_path / "big")
    with (big / "adapter_model.safetensors").open("ab") as f:
        f.truncate(64 << 20)  # sizes are checked before a byte of it is read
    refused(big, "adapter_model.safetensors holds 67108864 bytes, more than rank 4")
    refused(
        _copy(adapters["b"], tmp_path / "dora", use_dora=True), "use_dora True is not supported"
    )
    refused(tmp_path, "has no adapter_config.json")
    assert engine.runner.lora is not None and not engine.runner.lora._host


def test_a_request_for_an_adapter_without_enable_lora_is_refused(
    base: Path, tmp_path: Path
) -> None:
    engine = LLMEngine(base, EngineConfig())
    lora = _request("a", tmp_path)
    with pytest.raises(KilnError, match="LoRA is not enabled for this model"):
        engine.add_request("r", [1, 2, 3], GREEDY, lora_request=lora)
    with pytest.raises(KilnError, match="LoRA is not enabled for this model"):
        engine.add_lora(lora)


def test_lora_modules_take_vllms_forms() -> None:
    spaced = parse_lora_modules("sql=/a/sql chat=/b")
    assert [(m.name, m.path, m.base_model_name) for m in spaced] == [
        ("sql", "/a/sql", None),
        ("chat", "/b", None),
    ]
    listed = json.dumps(
        ["sql=/a/sql", json.dumps({"name": "chat", "path": "/b", "base_model_name": "m"})]
    )
    assert [(m.name, m.base_model_name) for m in parse_lora_modules(listed)] == [
        ("sql", None),
        ("chat", "m"),
    ]
    assert parse_lora_modules('{"name": "x", "path": "/p"}')[0].path == "/p"
    for bad, why in (("sql", "not name=path"), ("a=/x a=/y", "given twice"),
                     ('{"name": "x"}', "needs a string name and path")):  # fmt: skip
        with pytest.raises(KilnError, match=why):
            parse_lora_modules(bad)


def _parameters(**given: str) -> LoRAConfig | None:
    return lora_config(given.get, "m")


def test_lora_parameters_as_a_config_pbtxt_gives_them() -> None:
    assert _parameters() is None
    config = _parameters(
        enable_lora="true", lora_modules="a=/x", max_loras="3", max_lora_rank="64",
        max_cpu_loras="4", allowed_lora_paths='["/srv/loras"]',
    )  # fmt: skip
    assert config == LoRAConfig(3, 64, 4, parse_lora_modules("a=/x"), ("/srv/loras",))
    for given, why in (
        ({"lora_modules": "a=/x"}, "parameter lora_modules needs enable_lora"),
        ({"enable_lora": "maybe"}, "enable_lora must be true or false"),
        ({"enable_lora": "true", "max_loras": "two"}, "max_loras must be an integer"),
        ({"enable_lora": "true", "max_loras": "0"}, "max_loras must be at least 1"),
        ({"enable_lora": "true", "max_loras": "4", "max_cpu_loras": "2"}, "max_cpu_loras"),
    ):
        with pytest.raises(KilnError, match=why):
            _parameters(**given)


@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        ("qwen2", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        # fused in the checkpoint itself: one adapter matrix over all of q/k/v (gate/up)
        ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    ],
)
def test_other_architectures_mixed_batch(
    arch: str, targets: tuple[str, ...], tmp_path: Path
) -> None:
    extra = {"pad_token_id": 0} if arch == "phi3" else {}
    folder = build_tiny_llm(tmp_path / arch, arch=arch, **extra)
    adapter = build_lora_adapter(folder, tmp_path / "lora", seed=7, r=8, target_modules=targets)
    want = {
        path: [reference_generate_lora(folder, path, p, GREEDY.max_tokens) for p in PROMPTS]
        for path in (None, adapter)
    }
    assert want[None] != want[adapter]
    engine = _engine(folder)
    lora = _request("x", adapter)
    engine.add_lora(lora)
    jobs = [(f"{i}-{k}", p, lora if k else None) for i, p in enumerate(PROMPTS) for k in (0, 1)]
    outputs = _run(engine, jobs)
    for i in range(len(PROMPTS)):
        assert outputs[f"{i}-0"] == want[None][i] and outputs[f"{i}-1"] == want[adapter][i]


def test_repeated_lora_modules_flags_arrive_as_one_json_list() -> None:
    # what kiln serve writes for --lora-modules 'a=/x b=/y' --lora-modules '{...}'
    raw = json.dumps(["a=/x b=/y", json.dumps({"name": "c", "path": "/my loras/c"})])
    assert [(m.name, m.path) for m in parse_lora_modules(raw)] == [
        ("a", "/x"),
        ("b", "/y"),
        ("c", "/my loras/c"),
    ]


def test_requests_running_with_an_unloaded_adapter_finish_with_it(
    base: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]],
    tmp_path: Path,
) -> None:  # fmt: skip
    engine = _engine(base)
    folder = shutil.copytree(adapters["a"], tmp_path / "a")
    lora = _request("a", folder)
    engine.add_lora(lora)
    engine.add_request("r", PROMPTS[0], GREEDY, lora_request=lora)
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    engine.remove_lora(lora.lora_int_id)
    shutil.rmtree(folder)  # its weights are in its slot
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == expected["a"][0]


def test_the_engine_process_counts_carry_the_adapters_in_use(
    base: Path, adapters: dict[str, Path]
) -> None:
    """``lora_requests_info``'s labels travel in the engine process's counters: the
    adapters of the waiting requests, then of the running ones, and the server's view of
    the engine reads them from there (it has no scheduler of its own)."""
    import msgspec

    from kiln.llm import engine_messages as msg
    from kiln.llm.engine_proc import EngineView

    engine = _engine(base)
    a, b = _request("a", adapters["a"]), _request("b", adapters["b"])
    engine.add_lora(a)
    engine.add_lora(b)
    assert msg.counts(engine).waiting_loras == ""
    engine.add_request("ra", PROMPTS[0], GREEDY, lora_request=a)
    engine.add_request("rb", PROMPTS[1], GREEDY, lora_request=b)
    engine.add_request("r", PROMPTS[0], GREEDY)
    counts = msg.counts(engine)
    assert (counts.waiting_loras, counts.running_loras) == ("a,b", "")
    engine.step()
    counts = msg.counts(engine)
    assert (counts.waiting_loras, counts.running_loras) == ("", "a,b")
    # through the wire, as the server's view reads it
    view = EngineView.__new__(EngineView)
    view.counts = msgspec.msgpack.decode(msg.ENCODER.encode(counts), type=msg.Counts)
    assert view.loras_in_use() == ("", "a,b")


def test_an_adapter_travels_to_the_engine_process_with_its_request() -> None:
    """``Add`` and ``LoadLoRA`` carry the whole ``LoRARequest`` (the engine process reads
    the folder again when it has not got the adapter, e.g. after a restart)."""
    from kiln.llm import engine_messages as msg

    lora = LoRARequest("a", 7, "/adapters/a", "base")
    add = msg.Add("r", [1, 2], {}, 0, 1.0, msg.lora_to(lora))
    load = msg.LoadLoRA(3, msg.lora_to(lora))
    frame = msg.ENCODER.encode(msg.Commands([add, load, msg.UnloadLoRA(7)]))
    got_add, got_load, unload = msg.COMMANDS.decode(frame).commands
    assert isinstance(got_add, msg.Add) and msg.lora_from(got_add.lora) == lora
    assert isinstance(got_load, msg.LoadLoRA) and msg.lora_from(got_load.lora) == lora
    assert isinstance(unload, msg.UnloadLoRA) and unload.lora_int_id == 7
    plain = msg.COMMANDS.decode(msg.ENCODER.encode(msg.Commands([msg.Add("r", [1], {}, 0, 1.0)])))
    assert plain.commands[0].lora is None  # type: ignore[union-attr]


def test_loading_an_adapter_while_asleep_without_weights_says_so(
    base: Path, adapters: dict[str, Path]
) -> None:
    """A level-2 sleep drops the model and its LoRA slots (their host copies stay): a load
    then is refused as unavailable, naming the wake, not as LoRA being off."""
    from kiln.llm.engine_control import EngineControl

    engine = _engine(base)
    control = EngineControl(engine)
    control.run("t", "sleep", {"level": 2})
    with pytest.raises(KilnError, match=r"asleep without its weights; wake it") as caught:
        engine.add_lora(_request("a", adapters["a"]))
    assert caught.value.status is Status.UNAVAILABLE
    assert control.run("t", "wake_up", {"tags": None}) == {"fully_awake": True}
    engine.add_lora(_request("a", adapters["a"]))
