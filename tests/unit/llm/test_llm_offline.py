"""vLLM's offline API on kiln's engine (``from kiln.llm import LLM, SamplingParams``):
greedy tokens equal ``transformers``', text the tokens' text, stop strings and stop
tokens as vLLM reports them, ``n`` samples, chat through the template, embeddings and
classification, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from kiln.core.errors import KilnError
from kiln.llm import LLM, SamplingParams
from tests.llm_models import (
    build_tiny_classifier,
    build_tiny_llm,
    reference_generate,
    reference_logits,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(folder, max_num_seqs=4, kv_cache_memory_bytes=16 << 20)


def test_greedy_tokens_equal_transformers_in_the_prompts_order(llm: LLM, folder: Path) -> None:
    prompts = ["the quick brown fox", "hello", "a sequence of tokens is", "kiln serves"]
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outputs] == prompts
    for out in outputs:
        ids = llm.tokenizer.encode(out.prompt or "", add_special_tokens=True)
        assert out.prompt_token_ids == ids
        (sample,) = out.outputs
        assert sample.token_ids == reference_generate(folder, ids, 12)
        assert sample.text == llm.tokenizer.decode(sample.token_ids)
        assert sample.finish_reason == "length" and sample.stop_reason is None
    # token ids, the dict forms, and one sampling_params per prompt
    ids = outputs[0].prompt_token_ids
    again = llm.generate([ids, {"prompt_token_ids": ids}, {"prompt": "hello"}],
                         [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=3)])  # fmt: skip
    assert again[0].outputs[0].token_ids == again[1].outputs[0].token_ids
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert again[0].prompt is None and len(again[2].outputs[0].token_ids) <= 3


def test_stop_strings_and_stop_tokens_as_vllm_reports_them(llm: LLM) -> None:
    (free,) = llm.generate("the quick brown fox", GREEDY)
    text, tokens = free.outputs[0].text, free.outputs[0].token_ids
    stop = text[3:6]
    (cut,) = llm.generate("the quick brown fox", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))  # fmt: skip
    sample = cut.outputs[0]
    assert sample.text == text[: text.index(stop)]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)
    assert sample.token_ids == tokens[: len(sample.token_ids)] and len(sample.token_ids) < 12
    (kept,) = llm.generate("the quick brown fox", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=stop,
        include_stop_str_in_output=True))  # fmt: skip
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    # a stop token: in token_ids, not in the text, named by stop_reason
    token = tokens[4]
    (ended,) = llm.generate("the quick brown fox", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[token]))  # fmt: skip
    sample = ended.outputs[0]
    first = tokens.index(token)
    assert sample.token_ids == tokens[: first + 1]
    assert sample.text == llm.tokenizer.decode(tokens[:first])
    assert (sample.finish_reason, sample.stop_reason) == ("stop", token)


def test_n_samples_seeds_and_logprobs(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    (out,) = llm.generate("hello", params)
    assert [s.index for s in out.outputs] == [0, 1, 2]
    (again,) = llm.generate("hello", params)
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]
    sample = out.outputs[0]
    assert sample.logprobs is not None and len(sample.logprobs) == 6
    for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
        assert token in entry and len(entry) <= 3  # the sampled token and the top 2
    assert sample.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True))
    )


def test_chat_renders_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hello"}]
    (out,) = llm.chat(messages, GREEDY)
    text = llm.tokenizer.apply_chat_template(messages, True)
    assert out.prompt == text
    (same,) = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text)}, GREEDY)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    both = llm.chat([messages, messages], GREEDY)
    assert len(both) == 2


def test_bad_prompts_and_params_are_refused(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([], GREEDY)
    with pytest.raises(ValueError, match="prompt 1 must be"):
        llm.generate(["ok", ""], GREEDY)
    with pytest.raises(ValueError, match="top_p must be in"):
        llm.generate("ok", SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate("ok", [GREEDY, GREEDY])
    with pytest.raises(KilnError, match="maximum context length"):
        llm.generate([[5] * 300], GREEDY)
    with pytest.raises(TypeError, match="swap_space"):
        LLM(tmp_path, swap_space=4)
    with pytest.raises(KilnError, match="no such folder"):
        LLM(tmp_path / "missing")
    with pytest.raises(ValueError, match="classify"):
        llm.classify("hello")


def test_embed_and_classify(folder: Path, tmp_path: Path) -> None:
    embedder = LLM(folder, runner="pooling", kv_cache_memory_bytes=16 << 20)
    (out,) = embedder.embed("hello world")
    vector = torch.tensor(out.outputs.embedding)
    assert vector.shape == (64,) and float(vector.norm()) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="generating model"):
        embedder.generate("hi", GREEDY)
    classifier_folder = build_tiny_classifier(tmp_path / "cls")
    classifier = LLM(classifier_folder, kv_cache_memory_bytes=16 << 20)
    texts = ["the quick brown fox", "hello"]
    outs = classifier.classify(texts)
    ids = [o.prompt_token_ids for o in outs]
    want = torch.tensor(reference_logits(classifier_folder, ids)).softmax(-1)
    got = torch.tensor([o.outputs.probs for o in outs])
    assert torch.allclose(got, want, atol=1e-5) and outs[0].outputs.num_classes == 3


def test_score_by_cosine_or_as_a_cross_encoder(folder: Path, tmp_path: Path) -> None:
    import transformers

    embedder = LLM(folder, runner="pooling", kv_cache_memory_bytes=16 << 20)
    scored = embedder.score("the quick brown fox", ["hello", "the lazy dog"])
    vectors = [torch.tensor(o.outputs.embedding) for o in embedder.embed(
        ["the quick brown fox", "hello", "the lazy dog"])]  # fmt: skip
    want = [float(vectors[0] @ vectors[i]) for i in (1, 2)]
    assert [o.outputs.score for o in scored] == pytest.approx(want, abs=1e-5)
    ce_folder = build_tiny_classifier(tmp_path / "ce", ("relevance",))
    ce = LLM(ce_folder, kv_cache_memory_bytes=16 << 20)
    pairs = ce.score(["what is kiln", "a query"], ["a server", "a furnace"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ce_folder))
    ids = [tokenizer("what is kiln", "a server")["input_ids"],
           tokenizer("a query", "a furnace")["input_ids"]]  # fmt: skip
    assert [o.prompt_token_ids for o in pairs] == ids
    want = torch.tensor(reference_logits(ce_folder, ids))[:, 0].sigmoid().tolist()
    assert [o.outputs.score for o in pairs] == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="one text_1 with every text_2, or N with N"):
        ce.score(["a", "b"], ["c", "d", "e"])
