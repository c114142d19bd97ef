"""Sequence classifiers (``*ForSequenceClassification``): kiln's engine runs the decoder
and its ``score`` head on the last token, equal to ``transformers``' logits, and serves
them as a pooling model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_classifier, reference_logits

PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [100] * 30]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_classifier_logits_equal_transformers(tmp_path: Path, arch: str) -> None:
    folder = build_tiny_classifier(tmp_path / arch, arch=arch)
    engine = LLMEngine(folder, EngineConfig())
    assert engine.args.labels == ("negative", "neutral", "positive")
    assert engine.config.runner == "pooling"  # a classifier pools, as vLLM's runner does
    got = engine.pool(PROMPTS)
    assert got.shape == (3, 3)
    want = reference_logits(folder, PROMPTS)
    with pytest.raises(KilnError, match="sequence classifier: it classifies"):
        engine.check_request(3, SamplingParams())  # Triton's generate and KServe too
    for row, ref in zip(got.tolist(), want, strict=True):
        assert row == pytest.approx(ref, abs=1e-5)


def test_labels_from_id2label_or_num_labels() -> None:
    base = {"architectures": ["LlamaForSequenceClassification"], "vocab_size": 10,
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}  # fmt: skip
    read = ModelArgs.from_dict({**base, "id2label": {"1": "yes", "0": "no"}})
    assert read.labels == ("no", "yes") and read.num_labels == 2
    assert read.architecture == "LlamaForCausalLM"  # the decoder it runs
    assert ModelArgs.from_dict({**base, "num_labels": 1}).labels == ("LABEL_0",)
    assert ModelArgs.from_dict({**base}).num_labels == 2  # transformers' default
    plain = {**base, "architectures": ["LlamaForCausalLM"], "id2label": {"0": "a"}}
    assert ModelArgs.from_dict(plain).num_labels == 0  # a language model's id2label: unused
    with pytest.raises(KilnError, match=r"id2label must map the class ids 0\.\.n-1"):
        ModelArgs.from_dict({**base, "id2label": {"0": "a", "2": "c"}})


def test_a_classifier_without_its_score_weights_is_refused(tmp_path: Path) -> None:
    folder = build_tiny_classifier(tmp_path / "c")
    raw = json.loads((folder / "config.json").read_text())
    # the same weights read as a language model: its score head is unknown to that
    (folder / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(KilnError, match=r"does not have: \['score.weight'\]"):
        LLMEngine(folder, EngineConfig())
