"""A request's outputs between the engine's steps and its reader (OutputCollector): outputs
a reader has not taken yet are merged per sample, vLLM's ``stream_interval`` holds an
unfinished sample's tokens until it has that many, and a stop string still ends a choice
at the token that completes it however the steps were merged."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError, Status
from kiln.frontends.openai.generation import Delta, run
from kiln.llm.async_engine import AsyncEngine, OutputCollector, outputs, stream_interval
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.params import InvalidField, sampling_fields
from kiln.llm.sampler import TokenLogprobs
from kiln.llm.sequence import SamplingParams, token_by_token
from kiln.llm.tokenizer import Tokenizer
from tests.llm_models import build_tiny_llm


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _out(tokens: list[int], count: int, index: int = 0, finished: bool = False,
         **extra: Any) -> RequestOutput:  # fmt: skip
    return RequestOutput("r", tokens, finished, "length" if finished else None, 3, count,
                         index=index, **extra)  # fmt: skip


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -float(token))


async def _pending(task: asyncio.Task[Any]) -> bool:
    for _ in range(5):  # let the loop run whatever the puts woke
        await asyncio.sleep(0)
    return not task.done()


async def test_outputs_the_reader_has_not_taken_are_merged_per_sample() -> None:
    collector = OutputCollector(asyncio.get_running_loop())
    first = _out([7], 1, logprobs=[_lp(7)], prompt_logprobs=[None], first_scheduled_time=1.5,
                 num_cached_tokens=4)  # fmt: skip
    collector.put(first)
    collector.put(_out([9], 1, index=1))
    collector.put(_out([8], 2, logprobs=[_lp(8)]))
    collector.put(_out([6, 5], 4, finished=True, logprobs=[_lp(6), _lp(5)], stop_token_id=5))
    taken = await collector.get()
    assert [(o.index, o.new_token_ids, o.num_output_tokens) for o in taken] == [
        (0, [7, 8, 6, 5], 4),
        (1, [9], 1),
    ]
    merged = taken[0]
    assert merged.finished and merged.finish_reason == "length" and merged.stop_token_id == 5
    assert [lp.token_id for lp in merged.logprobs or []] == [7, 8, 6, 5]
    # the first output's once-only fields stay
    assert merged.prompt_logprobs == [None]
    assert merged.first_scheduled_time == 1.5 and merged.num_cached_tokens == 4
    assert first.new_token_ids == [7, 8, 6, 5] and merged is first
    # nothing is left: the next get waits for the next put
    task = asyncio.ensure_future(collector.get())
    assert await _pending(task)
    collector.put(_out([4], 2, index=1))
    assert [o.new_token_ids for o in await task] == [[4]]


async def test_merging_extends_the_first_outputs_lists_in_place() -> None:
    # a reader that stops reading lets its outputs pile up: each merge is an append, not
    # a copy of everything merged so far (which would be quadratic in the output's length)
    collector = OutputCollector(asyncio.get_running_loop())
    first = _out([0], 1, logprobs=[_lp(0)])
    tokens, logprobs = first.new_token_ids, first.logprobs
    collector.put(first)
    for count in range(2, 2001):
        collector.put(_out([count - 1], count, logprobs=[_lp(count - 1)]))
    (taken,) = await collector.get()
    assert taken.new_token_ids is tokens and taken.logprobs is logprobs
    assert tokens == list(range(2000)) and taken.num_output_tokens == 2000


async def test_stream_interval_holds_tokens_until_it_has_that_many() -> None:
    collector = OutputCollector(asyncio.get_running_loop(), interval=4)
    collector.put(_out([10], 1))
    assert [o.new_token_ids for o in await collector.get()] == [[10]]  # the first at once
    task = asyncio.ensure_future(collector.get())
    for count in (2, 3, 4):
        collector.put(_out([10 + count - 1], count))
        assert await _pending(task), count
    collector.put(_out([14], 5))
    assert [o.new_token_ids for o in await task] == [[11, 12, 13, 14]]
    # the last tokens go out with the finish, however few
    task = asyncio.ensure_future(collector.get())
    collector.put(_out([15], 6))
    assert await _pending(task)
    collector.put(_out([16], 7, finished=True))
    (last,) = await task
    assert last.new_token_ids == [15, 16] and last.finished


async def test_stream_interval_counts_each_sample_on_its_own() -> None:
    collector = OutputCollector(asyncio.get_running_loop(), interval=2)
    collector.put(_out([1], 1, index=0))
    collector.put(_out([2], 1, index=1))
    assert [o.index for o in await collector.get()] == [0, 1]  # each one's first token
    collector.put(_out([3], 2, index=0))
    collector.put(_out([4], 2, index=1))
    collector.put(_out([5], 3, index=1))
    # sample 1 has 2 new tokens, sample 0 one: only sample 1 is due
    assert [(o.index, o.new_token_ids) for o in await collector.get()] == [(1, [4, 5])]
    collector.put(_out([6], 3, index=0))
    assert [(o.index, o.new_token_ids) for o in await collector.get()] == [(0, [3, 6])]


async def test_an_error_comes_after_the_outputs_before_it_held_or_not() -> None:
    collector = OutputCollector(asyncio.get_running_loop(), interval=8)
    collector.put(_out([1], 1))
    await collector.get()
    collector.put(_out([2], 2))  # held: not 8 new tokens yet
    collector.put(KilnError("the engine process stopped", Status.INTERNAL))
    assert [o.new_token_ids for o in await collector.get()] == [[2]]
    with pytest.raises(KilnError, match="engine process stopped"):
        await collector.get()


async def test_outputs_counts_finished_samples_in_merged_outputs() -> None:
    collector = OutputCollector(asyncio.get_running_loop())
    aborted: list[bool] = []
    stream = outputs(collector, 2, lambda: aborted.append(True))
    collector.put(_out([1], 1, index=0))
    collector.put(_out([2], 2, index=0, finished=True))
    collector.put(_out([3], 1, index=1, finished=True))
    got = [(o.index, o.new_token_ids, o.finished) async for o in stream]
    assert got == [(0, [1, 2], True), (1, [3], True)]
    assert not aborted  # both samples finished: nothing to abort


def test_stream_interval_is_raised_to_the_engines() -> None:
    assert stream_interval(SamplingParams(), 1) == 1
    assert stream_interval(SamplingParams(stream_interval=3), 1) == 3
    assert stream_interval(SamplingParams(stream_interval=3), 8) == 8
    assert stream_interval(SamplingParams(), 8) == 8


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "stream_interval must be >= 1, got 0"),
        (-2, "stream_interval must be >= 1, got -2"),
        ("4", "'stream_interval' must be an integer, got '4'"),
        (True, "'stream_interval' must be an integer, got True"),
        (2**70, "stream_interval must be in"),
    ],
)
def test_a_bad_stream_interval_is_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(InvalidField, match=message) as info:
        sampling_fields({"stream_interval": value})
    assert info.value.field == "stream_interval"


def test_the_engine_refuses_a_stream_interval_below_one(folder: Path) -> None:
    engine = LLMEngine(folder, EngineConfig())
    with pytest.raises(InvalidField, match="stream_interval must be at least 1, got 0"):
        engine.check_request(3, SamplingParams(stream_interval=0))
    with pytest.raises(KilnError, match="stream_interval must be positive, got 0"):
        EngineConfig(stream_interval=0).check()


@pytest.mark.parametrize("request_interval", [None, 6])
async def test_the_engines_stream_interval_paces_a_real_stream(
    folder: Path, request_interval: int | None
) -> None:
    engine = LLMEngine(folder, EngineConfig(block_size=4, stream_interval=3))
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            stream_interval=request_interval)  # fmt: skip
    try:
        counts = [o.num_output_tokens async for o in async_engine.generate([1, 2, 3], params)]
    finally:
        async_engine.close()
    interval = request_interval or 3
    # the first output holds the first token, and the steps the engine ran before the
    # reader first got to it (a reader that falls behind gets them merged): its size is
    # the scheduler's, not the collector's (test_stream_interval_holds_tokens_until_it_has
    # _that_many pins "the first at once" without timing)
    assert counts[0] >= 1 and counts[-1] == 20
    gaps = [b - a for a, b in itertools.pairwise(counts[:-1])]  # the last: what was left
    assert gaps and all(gap >= interval for gap in gaps), counts


def test_token_by_token_splits_an_output_with_its_counts_and_logprobs() -> None:
    out = _out([4, 5, 6], 9, finished=True, logprobs=[_lp(4), _lp(5), _lp(6)])
    pieces = [(ids, [lp.token_id for lp in lps], count, last)
              for ids, lps, count, last in token_by_token(out, drop_stop_token=True)]  # fmt: skip
    assert pieces == [([4], [4], 7, False), ([5], [5], 8, False), ([], [6], 9, True)]


class _Steps:
    """An EngineClient whose engine produced ``tokens``, one a step, handed over in the
    runs ``runs`` gives (a reader that fell behind gets several steps in one output)."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[int], runs: list[int]) -> None:
        self.tokenizer = tokenizer
        self.tokens, self.runs = tokens, runs
        self.aborted: list[tuple[str, int | None, str]] = []

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        at = 0
        for run_ in self.runs:
            chunk = self.tokens[at : at + run_]
            at += run_
            done = at == len(self.tokens)
            yield _out(chunk, at, finished=done)
            if done:
                return

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        self.aborted.append((request_id, index, reason))


WORDS = "one two three four five six seven eight"


def _steps(folder: Path, runs: list[int]) -> _Steps:
    """WORDS generated (32 tokens of the test tokenizer), handed over in ``runs``."""
    tokenizer = Tokenizer(folder)
    tokens = tokenizer.encode(WORDS)
    assert len(tokens) == 32 and tokenizer.decode(tokens) == WORDS
    return _Steps(tokenizer, tokens, runs)


async def _deltas(client: _Steps, stops: tuple[str, ...], min_tokens: int = 0) -> list[Delta]:
    params = SamplingParams(max_tokens=len(client.tokens), min_tokens=min_tokens)
    return [d async for d in run(client, [1, 2], params, stops)]  # type: ignore[arg-type]


@pytest.mark.parametrize("runs", [[1] * 32, [5, 10, 17], [32], [2, 30]])
async def test_a_stop_string_ends_the_choice_at_its_token_however_steps_merged(
    folder: Path, runs: list[int]
) -> None:
    stop = " four"
    steps = _steps(folder, runs)
    deltas = await _deltas(steps, (stop,))
    one_by_one = await _deltas(_steps(folder, [1] * 32), (stop,))
    text = "".join(d.text for d in deltas)
    assert text == WORDS[: WORDS.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    # the count stops at the token that completed " four", as when each step came alone
    assert deltas[-1].completion_tokens == one_by_one[-1].completion_tokens
    assert deltas[-1].completion_tokens < 32
    # the engine is told to stop the sample unless the output was its last already
    stopped_early = sum(runs[:-1]) >= deltas[-1].completion_tokens
    assert [a[2] for a in steps.aborted] == (["stop"] if stopped_early else [])
    # min_tokens past the stop's token: the stop string does not end it there
    late = await _deltas(_steps(folder, runs), (stop,), min_tokens=31)
    assert late[-1].finish_reason == "length"


class _Backend:
    """What triton_tensors.generate reads of an LLMBackend: its tokenizer and engine."""

    def __init__(self, steps: _Steps) -> None:
        self.tokenizer = steps.tokenizer
        self.async_engine = steps


@pytest.mark.parametrize("runs", [[1] * 32, [5, 10, 17], [32]])
async def test_triton_generate_stops_at_the_token_however_steps_merged(
    folder: Path, runs: list[int]
) -> None:
    from kiln.llm import triton_tensors

    keys = ("return_finish_reason", "return_num_output_tokens", "return_cumulative_logprob",
            "return_num_input_tokens")  # fmt: skip
    returns = dict.fromkeys(keys, True)
    req = triton_tensors.TritonRequest("p", [1, 2], SamplingParams(max_tokens=32), (" four",),
                                       True, False, returns)  # fmt: skip
    backend = _Backend(_steps(folder, runs))
    responses = [r async for r, _ in triton_tensors.generate(backend, req)]  # type: ignore[arg-type]
    text = "".join(r["text_output"][0].decode() for r in responses)
    assert text == WORDS[: WORDS.index(" four")]
    assert responses[-1]["finish_reason"][0] == b"stop"
    # the tokens up to the one that completed " four" (token 14), merged or not
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == 14


def test_the_stream_interval_flag_and_parameter(folder: Path) -> None:
    from kiln.backends.base import InstanceSpec
    from kiln.cli.llm_options import served_models
    from kiln.llm.backend import engine_config

    (config,) = served_models((folder,), ("tiny",), {"stream_interval": 4})
    assert config.parameters["stream_interval"].string_value == "4"
    spec = InstanceSpec(name="tiny_0", kind="cpu", device_id=0, index=0, total_instances=1)
    assert engine_config(config, spec).stream_interval == 4


def test_find_stop_takes_the_stops_in_order_from_start() -> None:
    from kiln.llm.sequence import find_stop

    assert find_stop("one two three", ("three", "two")) == (8, "three")  # list order
    assert find_stop("two and two", ("two",), start=1) == (8, "two")
    assert find_stop("nothing here", ("x", "y")) is None
