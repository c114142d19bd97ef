"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): kiln's engine pools them outside any
KV cache, equal to ``transformers``' hidden states and logits, whatever the batching; a
cross-encoder reads a pair's segments (BERT's token types); sentence-transformers'
``modules.json`` sets the default pooling; what an encoder cannot do is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
import torch.nn.functional as F

from kiln.core.errors import KilnError
from kiln.llm.config import TOKEN_TYPE_SHIFT, EngineConfig, ModelArgs, PoolerConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.models.bert import rename
from kiln.llm.sequence import SamplingParams
from kiln.llm.tokenizer import Tokenizer
from tests.llm_models import build_tiny_encoder, encoder_inputs, reference_encoder

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "a sequence of tokens is generated one step at a time, then another",
    "kiln",
]
PAIRS = [("what jumps over the dog", t) for t in TEXTS]


def _ids(folder: Path, texts: list[str]) -> list[list[int]]:
    return [enc.ids for enc in encoder_inputs(folder, texts)]


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "mkl"])
@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_embeddings_equal_transformers_cls_pooled(
    tmp_path: Path, family: str, onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.llm import cpu_linear, encoder_runner

    if onednn and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN")
    # both product paths on any CPU: oneDNN's packed weights with GELU and the residual
    # sums fused into them (what an AVX-512 CPU runs), and MKL's F.linear (the others)
    monkeypatch.setattr(encoder_runner, "_onednn_wins", lambda: onednn)
    folder = build_tiny_encoder(tmp_path / family, family)
    engine = LLMEngine(folder, EngineConfig())
    packed = isinstance(engine.runner.model.layers[0].up, cpu_linear.PackedLinear)  # type: ignore[union-attr]
    assert packed == onednn
    assert engine.args.is_encoder and engine.config.runner == "pooling"
    # an encoder's default: [CLS] (the first token), L2-normalized, as vLLM's
    assert engine.config.pooler_config == PoolerConfig("CLS", True)
    # RoBERTa's positions start past its padding id: 130 - 2 tokens
    assert engine.config.max_model_len == 128
    got = engine.pool(_ids(folder, TEXTS))  # four lengths: one padded batch
    want = torch.stack([h[0] for h in reference_encoder(folder, TEXTS)])
    assert got.shape == (4, 64)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu"])
def test_other_activations(tmp_path: Path, act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.llm import cpu_linear, encoder_runner

    # tanh-approximated GELU fused into oneDNN's product; ReLU after it, unfused
    monkeypatch.setattr(encoder_runner, "_onednn_wins", cpu_linear.available)
    folder = build_tiny_encoder(tmp_path / act, hidden_act=act)
    got = LLMEngine(folder, EngineConfig()).pool(_ids(folder, TEXTS))
    want = torch.stack([h[0] for h in reference_encoder(folder, TEXTS)])
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("pooling", ["MEAN", "LAST"])
def test_other_poolings_over_padded_batches(tmp_path: Path, pooling: str) -> None:
    folder = build_tiny_encoder(tmp_path / "bert")
    # a small token budget: each batch holds one or two inputs
    config = EngineConfig(pooler_config=PoolerConfig(pooling), max_num_batched_tokens=24)
    engine = LLMEngine(folder, config)
    got = engine.pool(_ids(folder, TEXTS))
    hidden = reference_encoder(folder, TEXTS)
    want = torch.stack([h.mean(0) if pooling == "MEAN" else h[-1] for h in hidden])
    assert torch.allclose(got, want, atol=1e-4)
    # the same inputs one at a time agree with the batched answer
    alone = torch.cat([engine.pool([p]) for p in _ids(folder, TEXTS)])
    assert torch.allclose(alone, got, atol=1e-5)


def test_batches_stay_within_the_token_budget(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "bert")
    engine = LLMEngine(folder, EngineConfig(max_num_batched_tokens=20))
    lengths = [12, 3, 5, 9, 4, 30, 2]
    batches = engine.runner._batches(lengths)  # type: ignore[union-attr]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= 20
    assert [5] in batches  # longer than the budget: alone


def test_sentence_transformers_pooling_is_the_default(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "st", st_pooling="mean_tokens", st_normalize=False)
    engine = LLMEngine(folder, EngineConfig())
    assert engine.config.pooler_config == PoolerConfig("MEAN", False)
    want = torch.stack([h.mean(0) for h in reference_encoder(folder, TEXTS[:2])])
    assert torch.allclose(engine.pool(_ids(folder, TEXTS[:2])), want, atol=1e-4)
    # what the deployment asks wins over the checkpoint's defaults
    asked = LLMEngine(folder, EngineConfig(pooler_config=PoolerConfig("CLS")))
    assert asked.config.pooler_config == PoolerConfig("CLS", False)
    # a decoder embedding model's modules.json (Qwen3-Embedding's lasttoken) is read too
    folder2 = build_tiny_encoder(tmp_path / "st2", st_pooling="lasttoken")
    assert LLMEngine(folder2, EngineConfig()).config.pooler_config == PoolerConfig("LAST", True)


def test_sentence_transformers_dense_modules_project_the_pooled_vectors(
    tmp_path: Path,
) -> None:
    """LaBSE's layout: pooling, a Dense module (64 -> 24, tanh), normalization: the
    vectors are normalize(tanh(W mean + b)), as vLLM's projector and sentence-transformers
    write them; their width is the Dense module's."""
    from safetensors.torch import load_file

    from kiln.llm import LLM

    folder = build_tiny_encoder(tmp_path / "labse", st_pooling="mean_tokens", st_dense=24)
    dense = load_file(str(folder / "2_Dense" / "model.safetensors"))
    hidden = reference_encoder(folder, TEXTS)
    pooled = torch.stack([h.mean(0) for h in hidden])
    want = F.normalize(torch.tanh(pooled @ dense["linear.weight"].T + dense["linear.bias"]), dim=-1)
    llm = LLM(model=str(folder))
    assert llm.engine.args.embedding_size == 24
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert got.shape == (len(TEXTS), 24)
    assert torch.allclose(got, want, atol=1e-5)
    # token_embed: every token's state projected too
    first = llm.encode(TEXTS[:1])[0].outputs.data
    tokens = torch.tanh(hidden[0] @ dense["linear.weight"].T + dense["linear.bias"])
    assert torch.allclose(first, F.normalize(tokens, dim=-1), atol=1e-5)


def test_a_dense_module_kiln_cannot_read_is_refused(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "m", st_pooling="mean_tokens", st_dense=8)
    config_file = folder / "2_Dense" / "config.json"
    config = json.loads(config_file.read_text())
    cases = [
        ({**config, "activation_function": "torch.nn.modules.activation.Softsign"}, "Softsign"),
        ({**config, "in_features": 32}, "config says"),
    ]
    for bad, message in cases:
        config_file.write_text(json.dumps(bad))
        with pytest.raises(KilnError, match=message):
            LLMEngine(folder, EngineConfig())
    config_file.write_text(json.dumps(config))
    weights = folder / "2_Dense" / "model.safetensors"
    weights.rename(folder / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(KilnError, match=r"no model\.safetensors"):
        LLMEngine(folder, EngineConfig())
    modules = json.loads((folder / "modules.json").read_text())
    modules[2]["path"] = "../elsewhere"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(KilnError, match=r"Dense module names no config\.json inside"):
        LLMEngine(folder, EngineConfig())


def test_a_pooling_mode_kiln_lacks_falls_back_to_the_default(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "max", st_pooling="max_tokens")
    assert LLMEngine(folder, EngineConfig()).config.pooler_config.pooling_type == "CLS"


def test_a_pooling_module_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "bad", st_pooling="cls_token")
    modules = json.loads((folder / "modules.json").read_text())
    modules[1]["path"] = "../../etc"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(KilnError, match=r"Pooling module names no config\.json inside"):
        LLMEngine(folder, EngineConfig())


def test_bert_cross_encoder_reads_the_pair_token_types(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "ce", "bert", labels=("relevance",))
    engine = LLMEngine(folder, EngineConfig())
    assert engine.args.token_types and engine.args.num_labels == 1
    assert engine.config.pooler_config == PoolerConfig("CLS", False)
    tok = Tokenizer(folder)
    packed = [tok.encode_pair(a, b, token_types=True) for a, b in PAIRS]
    plain = [tok.encode_pair(a, b) for a, b in PAIRS]
    # the second segment's ids carry type 1; the first's are the plain ids
    assert packed[0][0] == plain[0][0] and packed[0][-1] == plain[0][-1] | (1 << TOKEN_TYPE_SHIFT)
    got = engine.pool(packed)
    want = torch.stack(reference_encoder(folder, PAIRS))
    assert got.shape == (4, 1)
    assert torch.allclose(got, want, atol=1e-4)
    # without the segments the logits differ: the types are read, not ignored
    assert not torch.allclose(engine.pool(plain), want, atol=1e-2)


@pytest.mark.parametrize("family", ["xlm-roberta", "bert"])
def test_sequence_classifier_logits(tmp_path: Path, family: str) -> None:
    labels = ("negative", "neutral", "positive")
    folder = build_tiny_encoder(tmp_path / family, family, labels=labels)
    engine = LLMEngine(folder, EngineConfig())
    assert engine.args.labels == labels and engine.args.token_types == (family == "bert")
    got = engine.pool(_ids(folder, TEXTS))
    want = torch.stack(reference_encoder(folder, TEXTS))
    assert torch.allclose(got, want, atol=1e-4)
    assert F.softmax(got, -1).argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_token_classifier_labels_every_token(tmp_path: Path, family: str) -> None:
    """``*ForTokenClassification`` (named entities): every token's label logits, equal to
    transformers' per input, the inputs packed one after another; its only pooling."""
    labels = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
    folder = build_tiny_encoder(tmp_path / family, family, labels=labels, per_token=True)
    engine = LLMEngine(folder, EngineConfig())
    assert engine.args.token_labels == labels and engine.args.num_labels == 0
    assert engine.config.runner == "pooling"
    ids = _ids(folder, TEXTS)
    got = engine.pool(ids, tokens=True)
    want = torch.cat(reference_encoder(folder, TEXTS))
    assert got.shape == (sum(map(len, ids)), len(labels))
    assert torch.allclose(got, want, atol=1e-4)
    with pytest.raises(KilnError, match="only with task token_classify"):
        engine.pool(ids)  # one vector an input: not a token classifier's answer
    with pytest.raises(KilnError, match="encoder: it embeds"):
        engine.check_request(3, SamplingParams())


def test_the_offline_api_classifies_tokens(tmp_path: Path) -> None:
    from kiln.llm import LLM

    folder = build_tiny_encoder(tmp_path / "ner", labels=("O", "B-PER", "I-PER"), per_token=True)
    llm = LLM(model=str(folder))
    outs = llm.encode(TEXTS, pooling_task="token_classify")
    for out, want in zip(outs, reference_encoder(folder, TEXTS), strict=True):
        assert torch.allclose(out.outputs.data, want.softmax(-1), atol=1e-5)
    for call in (lambda: llm.embed(TEXTS), lambda: llm.classify(TEXTS), lambda: llm.encode(TEXTS)):
        with pytest.raises(ValueError, match="token classifier"):
            call()
    plain = LLM(model=str(build_tiny_encoder(tmp_path / "bert")))
    with pytest.raises(ValueError, match="no token classifier"):
        plain.encode(TEXTS, pooling_task="token_classify")


def test_an_encoder_does_not_generate(tmp_path: Path) -> None:
    engine = LLMEngine(build_tiny_encoder(tmp_path / "bert"), EngineConfig())
    with pytest.raises(KilnError, match="BertModel is an encoder: it embeds"):
        engine.check_request(3, SamplingParams())
    with pytest.raises(KilnError, match="does not generate"):
        engine.runner.run(None)  # type: ignore[arg-type]


def test_token_types_past_the_vocabulary_are_refused(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "bert")
    engine = LLMEngine(folder, EngineConfig())
    with pytest.raises(KilnError, match="token type past the model's type_vocab_size 2"):
        engine.pool([[2, 5 | (2 << TOKEN_TYPE_SHIFT), 3]])


def test_what_an_encoder_cannot_take_is_refused(tmp_path: Path) -> None:
    folder = build_tiny_encoder(tmp_path / "bert")
    with pytest.raises(KilnError, match=r"encoder .* kv_cache_dtype does not apply"):
        LLMEngine(folder, EngineConfig(kv_cache_dtype="fp8"))
    # learned positions end at the table's size: a longer context cannot be served
    with pytest.raises(KilnError, match="max_model_len 200 is more than BertModel's 128"):
        LLMEngine(folder, EngineConfig(max_model_len=200))
    assert LLMEngine(folder, EngineConfig(max_model_len=64)).config.max_model_len == 64


def _config(**over: object) -> dict[str, object]:
    base: dict[str, object] = {"architectures": ["BertModel"], "vocab_size": 10,
                               "hidden_size": 8, "intermediate_size": 16,
                               "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    return {**base, **over}


def test_encoder_configs_kiln_cannot_run_are_refused() -> None:
    args = ModelArgs.from_dict(_config())
    assert args.is_encoder and args.max_position_embeddings == 512 and args.token_types
    xlmr = {"architectures": ["XLMRobertaModel"], "pad_token_id": 1, "type_vocab_size": 1}
    roberta = ModelArgs.from_dict(_config(**xlmr, max_position_embeddings=514))
    assert roberta.max_position_embeddings == 512 and not roberta.token_types
    # a matryoshka encoder (its vectors may be cut to these sizes), as for a decoder
    mrl = ModelArgs.from_dict(_config(matryoshka_dimensions=[4, 8]))
    assert mrl.is_matryoshka and mrl.matryoshka_dimensions == (4, 8)
    assert ModelArgs.from_dict(_config(is_matryoshka=True)).matryoshka_dimensions is None
    with pytest.raises(KilnError, match="position_embedding_type 'relative_key' is not supported"):
        ModelArgs.from_dict(_config(position_embedding_type="relative_key"))
    with pytest.raises(KilnError, match="hidden_act 'swish_beta' is not supported"):
        ModelArgs.from_dict(_config(hidden_act="swish_beta"))
    with pytest.raises(KilnError, match="hidden_size 8 is not a multiple of its num_attention"):
        ModelArgs.from_dict(_config(num_attention_heads=3))
    with pytest.raises(KilnError, match=r"kiln runs .*XLMRobertaModel"):
        ModelArgs.from_dict(_config(architectures=["DebertaV2Model"]))


def test_unknown_or_missing_weights_are_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = build_tiny_encoder(tmp_path / "bert")
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "encoder.layer.0.attention.self.rotary.weight": torch.zeros(2)},
              str(folder / "model.safetensors"))  # fmt: skip
    with pytest.raises(
        KilnError, match=r"does not have: encoder\.layer\.0\.attention\.self\.rotary"
    ):
        LLMEngine(folder, EngineConfig())
    del weights["embeddings.word_embeddings.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(KilnError, match=r"weights missing .*\['embed.weight'\]"):
        LLMEngine(folder, EngineConfig())


def test_hugging_face_names_map_onto_the_encoder() -> None:
    assert rename("bert.encoder.layer.3.attention.self.query.weight") == "layers.3.q.weight"
    assert rename("roberta.encoder.layer.0.output.LayerNorm.bias") == "layers.0.out_norm.bias"
    # pre-2020 checkpoints: LayerNorm's gamma and beta
    assert rename("bert.embeddings.LayerNorm.gamma") == "embed_norm.weight"
    assert rename("classifier.out_proj.weight") == "classifier.weight"
    assert rename("pooler.dense.bias") == "head_dense.bias"
    # a masked-LM head and the position-id buffer are not read
    assert rename("cls.predictions.bias") is None
    assert rename("embeddings.position_ids") is None
    # one kiln does not know keeps its name, for the loader to refuse
    odd = "encoder.layer.0.attention.self.distance_embedding.weight"
    assert rename(odd) == odd


def test_the_offline_api_embeds_and_scores(tmp_path: Path) -> None:
    from kiln.llm import LLM

    folder = build_tiny_encoder(tmp_path / "bert")
    vectors = [o.outputs.embedding for o in LLM(model=str(folder)).embed(TEXTS[:2])]
    want = F.normalize(torch.stack([h[0] for h in reference_encoder(folder, TEXTS[:2])]), dim=-1)
    assert torch.allclose(torch.tensor(vectors), want, atol=1e-4)
    # vLLM's encode(pooling_task="token_embed"): each prompt's token vectors, normalized
    (first, second) = LLM(model=str(folder)).encode(TEXTS[:2])
    hidden = reference_encoder(folder, TEXTS[:2])
    assert torch.allclose(first.outputs.data, F.normalize(hidden[0], dim=-1), atol=1e-4)
    assert second.outputs.data.shape == hidden[1].shape
    pooled = LLM(model=str(folder)).encode(TEXTS[:1], pooling_task="embed")[0].outputs.data
    assert torch.allclose(pooled, torch.tensor(vectors[0]), atol=1e-6)
    ce = build_tiny_encoder(tmp_path / "ce", labels=("relevance",))
    query, docs = PAIRS[0][0], [b for _, b in PAIRS]
    scores = [o.outputs.score for o in LLM(model=str(ce)).score(query, docs)]
    logits = torch.stack(reference_encoder(ce, PAIRS))[:, 0]
    assert scores == pytest.approx(logits.sigmoid().tolist(), abs=1e-5)


def test_attention_groups_cover_every_token_once_with_bounded_padding() -> None:
    from kiln.llm.models.bert import MAX_PADDING, attention_groups

    lengths = [16, 250, 17, 3, 3, 3, 120, 100, 18, 256]
    groups = attention_groups(lengths, torch.device("cpu"))
    covered = torch.cat([g.tokens for g in groups]).sort().values
    assert covered.tolist() == list(range(sum(lengths)))  # each packed token exactly once
    for g in groups:
        b, n = g.gather.shape
        real = g.tokens.numel()
        assert b * n - real <= MAX_PADDING * real
        assert (g.mask is None) == (b * n == real)
    # the three inputs of 3 tokens: one group with no padding and so no mask
    assert any(g.gather.shape == (3, 3) and g.mask is None for g in groups)
