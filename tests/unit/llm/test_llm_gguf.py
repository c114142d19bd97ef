"""A tiny Llama written as a GGUF file the way llama.cpp's converter writes one (q/k rows
permuted, F16 and F32 tensors, a SentencePiece-style ``llama`` vocabulary with scores and
byte tokens): kiln's tokenizer and greedy tokens must be those of transformers loading the
same file."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file

from kiln.core.errors import KilnError  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from kiln.llm.tokenizer import Tokenizer  # noqa: E402
from tests.llm_models import VOCAB, build_tiny_llm  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
TEXTS = ["the quick brown fox", "hello world jumps", " two  spaces", "xyz ü"]
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, the 256 byte tokens, then pieces (scored: longer merges later)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *[6] * 256]
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz"]
    for word in WORDS:
        for end in range(2, len(word) + 1):
            pieces.append("\u2581" + word[:end])
    pieces = list(dict.fromkeys(pieces))[: VOCAB - len(tokens)]
    tokens += pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types += [1] * len(pieces)
    return tokens, scores, types


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp's convert_hf_to_gguf row order for q_proj / k_proj
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_gguf(folder: Path, path: Path, arch: str = "llama", matrices: str = "F16") -> None:
    import json

    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_vocab_size(VOCAB)
    tokens, scores, types = _vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            target = f"blk.{layer}.{_NAMES[module]}.{kind}"
            # q and k scaled up: random attention is near uniform, and greedy tokens would
            # not see RoPE or the row order at all; llama.cpp permutes Llama's rows only
            permute = arch == "llama" and kind == "weight"
            if module == "self_attn.q_proj":
                w = _permute(w * 6, heads) if permute else w * 6
            elif module == "self_attn.k_proj":
                w = _permute(w * 6, kv) if permute else w * 6
        else:
            target = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        # matrices in F16 (as most files), norms in F32 (as llama.cpp keeps them)
        array = w.numpy().astype("float16" if w.dim() == 2 else "float32")
        if w.dim() == 2 and matrices != "F16":  # a quantized file (test_llm_quant_gguf.py)
            qtype = gguf.GGMLQuantizationType[matrices]
            array = gguf.quants.quantize(w.numpy().astype("float32"), qtype)
            writer.add_tensor(target, array, raw_dtype=qtype)
            continue
        writer.add_tensor(target, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.gguf"
    _write_gguf(build_tiny_llm(root / "hf"), path)
    return path


def test_sentencepiece_tokenizer_matches_transformers(gguf_path: Path) -> None:
    ours = Tokenizer.load(gguf_path)
    ref = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == 1  # llama.cpp's default for a SentencePiece vocabulary: BOS
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("the fox") == ref("the fox", add_special_tokens=False)["input_ids"]
    assert ours.chat_template is not None and ours.eos_token == "</s>"


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf-qwen2")
    path = root / "tiny-qwen2.gguf"
    _write_gguf(build_tiny_llm(root / "hf", arch="qwen2"), path, arch="qwen2")
    return path


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers_on_the_same_file(
    which: str, request: pytest.FixtureRequest
) -> None:
    gguf_path: Path = request.getfixturevalue("gguf_path" if which == "llama" else "qwen2_path")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    prompts = [[1, 270, 280, 290, 3], [1, 5, 9]]
    engine = LLMEngine(gguf_path, EngineConfig(num_gpu_blocks=32, block_size=4))
    assert engine.config.dtype == "float32"  # auto, on the CPU
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, [params, params])
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == [int(t) for t in out[0, len(prompt) :]]


def test_unsupported_files_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(KilnError, match="'bert' model; kiln serves GGUF architectures llama"):
        LLMEngine(path, EngineConfig(num_gpu_blocks=4))
