"""benchmarks/llm_vllm.py's pure parts, without vLLM: the workload, reading tokens back from
a completion's text, the token comparison, CPU accounting over a process tree, and the table
of kiln / vLLM ratios."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.llm_vllm import (
    SHAPES,
    compare_tokens,
    cpu_delta,
    format_table,
    make_requests,
    num_params,
    parse_env,
    steal_pct,
    summarize,
    text_to_ids,
)


def test_requests_are_seeded_and_within_the_ranges() -> None:
    a = make_requests(64, 0, 4096, (16, 256), (16, 256))
    assert a == make_requests(64, 0, 4096, (16, 256), (16, 256))
    assert a != make_requests(64, 1, 4096, (16, 256), (16, 256))
    assert len(a) == 64
    assert all(16 <= len(r.prompt) <= 256 and 16 <= r.output_len <= 256 for r in a)
    # no special token (unk 0, bos 1, eos 2) in a prompt, nothing outside the vocabulary
    assert min(min(r.prompt) for r in a) >= 3
    assert max(max(r.prompt) for r in a) < 4096


def test_the_shapes_are_the_sizes_the_issue_names() -> None:
    assert num_params(SHAPES["5m"]) == pytest.approx(5.24e6, rel=0.01)
    assert num_params(SHAPES["125m"]) == pytest.approx(124.7e6, rel=0.01)


def test_the_parameter_count_is_that_of_a_real_llama() -> None:
    transformers = pytest.importorskip("transformers")
    shape = dict(SHAPES["5m"], tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    assert num_params(SHAPES["5m"]) == sum(p.numel() for p in model.parameters())


def test_text_turns_back_into_token_ids_however_it_is_spaced() -> None:
    assert text_to_ids(" w12 w7 </s> w3") == [12, 7, 2, 3]
    assert text_to_ids("w12w7</s>w3") == [12, 7, 2, 3]
    assert text_to_ids("") == []


def test_identical_outputs_have_no_mismatch() -> None:
    check = compare_tokens([[1, 2, 3], [4]], [[1, 2, 3], [4]])
    assert check == {"requests": 2, "identical": 2, "mismatches": []}


def test_a_mismatch_names_the_request_position_and_tokens() -> None:
    check = compare_tokens([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]])
    assert check["identical"] == 1
    assert check["mismatches"] == [
        {"request": 1, "position": 1, "len": [2, 2], "tokens": [5, 9]},
        # one output is a prefix of the other: the difference is where the shorter ends
        {"request": 2, "position": 1, "len": [1, 2], "tokens": [None, 7]},
    ]
    with pytest.raises(ValueError):
        compare_tokens([[1]], [[1], [2]])


def test_cpu_delta_sums_the_tree_and_names_the_busiest_process() -> None:
    before = {10: ("api", 5.0), 11: ("worker", 20.0)}
    after = {10: ("api", 6.5), 11: ("worker", 30.0), 12: ("new", 0.5)}
    d = cpu_delta(before, after)
    assert d["cpu_s"] == pytest.approx(1.5 + 10.0 + 0.5)
    assert (d["busiest"], d["busiest_cpu_s"]) == ("worker", pytest.approx(10.0))
    assert d["processes"] == 3


def test_steal_is_the_share_of_the_stolen_ticks() -> None:
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [200, 0, 100, 900, 0, 0, 0, 100, 0, 0]  # +100 user +50 sys +100 idle +50 steal
    assert steal_pct(before, after) == pytest.approx(100 * 50 / 300)


def run(engine: str, repeat: int, tok_s: float, cpu_s: float, mode: str = "offline",
        **extra: Any) -> dict[str, Any]:  # fmt: skip
    check = {"requests": 64, "identical": 64, "mismatches": []}
    return {"model": "5m", "threads": 1, "mode": mode, "repeat": repeat, "engine": engine,
            "output_tokens": 1000, "output_tok_s": tok_s, "cpu_s": cpu_s,
            "busiest_cpu_s": cpu_s / 2, "startup_s": 4.0 if engine == "kiln" else 40.0,
            "peak_rss_gb": 1.5, "token_check": check, **extra}  # fmt: skip


def test_ratios_are_taken_within_each_repeat_then_the_median() -> None:
    runs = [
        run("kiln", 0, 100.0, 10.0), run("vllm", 0, 200.0, 5.0),
        run("vllm", 1, 100.0, 10.0), run("kiln", 1, 150.0, 10.0),
        run("kiln", 2, 90.0, 12.0), run("vllm", 2, 100.0, 8.0),
    ]  # fmt: skip
    (row,) = summarize(runs)
    ratio = row["ratios"]["output_tok_s"]
    assert ratio["median"] == pytest.approx(0.9)  # of 0.5, 1.5, 0.9
    assert (ratio["min"], ratio["max"], ratio["n"]) == (0.5, 1.5, 3)
    assert row["ratios"]["cpu_s_per_token"]["median"] == pytest.approx(1.5)  # 2, 1, 1.5
    assert row["kiln"]["output_tok_s"] == 100.0 and row["vllm"]["output_tok_s"] == 100.0
    assert row["kiln"]["cpu_s_per_1k"] == pytest.approx(10.0)
    assert row["tokens"] == {"identical": 64, "requests": 64}


def test_a_repeat_missing_an_engine_gives_no_ratio() -> None:
    (row,) = summarize([run("kiln", 0, 100.0, 10.0)])
    assert row["ratios"] == {}
    assert row["vllm"]["output_tok_s"] is None and row["vllm"]["runs"] == 0


def test_the_table_has_one_line_per_model_threads_and_mode() -> None:
    lat = {"p50": 700.0, "p99": 900.0}
    runs = [run("kiln", 0, 100.0, 10.0), run("vllm", 0, 200.0, 5.0),
            run("kiln", 0, 80.0, 10.0, "serve", ttft_ms=lat, tpot_ms=lat),
            run("vllm", 0, 160.0, 5.0, "serve", ttft_ms=lat, tpot_ms=lat)]  # fmt: skip
    table = format_table(summarize(runs)).splitlines()
    assert len(table) == 4
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| 5m | 1 | offline | 100.0 / 200.0 | 0.50 |" in table[2]
    assert "700 / 900 · 700 / 900" in table[3]
    assert table[2].endswith("| 64/64 |")


def test_env_items_are_key_value() -> None:
    assert parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError):
        parse_env(["NOPE"])


def test_the_physical_bound_counts_the_workloads_arithmetic() -> None:
    """benchmarks/llm_cpu_bound.py: a token's FLOPs are twice its layers' and LM head's
    weights plus attention over its context; prefill is compute-bound, a decode step the
    longer of its arithmetic and one read of the weights."""
    from benchmarks.llm_cpu_bound import bound, flops_per_token

    shape = SHAPES["5m"]
    h, i, v, layers = 256, 768, 4096, 4
    kv = 2 * h // 4
    weights = layers * (h * (h + 2 * kv) + h * h + 3 * h * i)
    assert flops_per_token(shape, 0, False) == 2 * weights
    assert flops_per_token(shape, 10, True) == 2 * weights + layers * 4 * 10 * h + 2 * h * v
    requests = make_requests(8, 0, v, (16, 32), (16, 32))
    slow = bound(shape, requests, peak=10.0, bw=1e9, weight_bytes=1)  # compute-bound
    fast = bound(shape, requests, peak=20.0, bw=1e9, weight_bytes=1)
    assert slow["output_tokens"] == sum(r.output_len for r in requests)
    assert slow["prefill_s"] == pytest.approx(2 * fast["prefill_s"])
    assert slow["decode_s"] == pytest.approx(2 * fast["decode_s"])
    # memory-bound: every decode step reads the weights once
    steps = max(r.output_len for r in requests) - 1
    mem = bound(shape, requests, peak=1e9, bw=1.0, weight_bytes=10**9)
    assert mem["decode_s"] == pytest.approx(steps)
