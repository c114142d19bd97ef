"""A ``.gguf`` file as a checkpoint: the config, the tokenizer and the chat template from its
metadata, the weights dequantized (by the ``gguf`` package) to the serving dtype at load.

llama.cpp's names become Hugging Face's, and llama.cpp's converter permutes the rows of
Llama's ``q_proj``/``k_proj`` (each head's two RoPE halves interleaved, for its own RoPE
kernel): the permutation is undone here, as transformers' GGUF loader undoes it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.core.errors import KilnError, Status

#: GGUF architecture -> Hugging Face's (the Llama skeleton kiln runs)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

#: llama.cpp's pre-tokenizer names -> the split regex the vocabulary's merges were learned
#: with (names without an entry split as GPT-2 does)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
#: ``tokenizer.ggml.token_type`` values
_CONTROL, _USER_DEFINED = 3, 4


def _hf_name(name: str) -> str | None:
    match = _BLOCK.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    base, _, kind = name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(base)
    return f"{mapped}.{kind}" if mapped else None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a q/k projection: each head's rows, read as
    [head_dim / 2, 2], back to [2, head_dim / 2] (the two RoPE halves one after the other)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reader(path: Path) -> Any:
    """The file's reader, shared by the tokenizer and the weights: parsing the metadata of
    a 50,000-token vocabulary takes seconds."""
    path = path.resolve()
    return _cached_reader(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int) -> Any:
    try:
        import gguf
    except ImportError:
        raise KilnError(
            f"llm backend: {path} is a GGUF file, which needs the gguf package "
            "(pip install 'kiln-serve[llm]')",
            Status.UNAVAILABLE,
        ) from None
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise KilnError(f"llm backend: cannot read {path}: {exc}", Status.INVALID_ARG) from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _reader(path)
        self.arch = str(_field(self.reader, "general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise KilnError(
                f"llm backend: {path.name} holds a '{self.arch}' model; kiln serves GGUF "
                f"architectures {', '.join(ARCHITECTURES)}",
                Status.INVALID_ARG,
            )
        self.names = {t.name for t in self.reader.tensors}
        #: Hugging Face names whose blocks ``weights`` yields as stored (raw bytes, rows
        #: unpermuted), for a quantized projection to keep (kiln.llm.quantization)
        self.keep_quantized: set[str] = set()
        if "rope_freqs.weight" in self.names:
            raise KilnError(
                f"llm backend: {path.name} scales RoPE with a rope_freqs tensor (Llama 3.1 "
                "style), which kiln does not read from GGUF yet; serve the Hugging Face folder",
                Status.INVALID_ARG,
            )

    def _meta(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, f"{self.arch}.{key}", default)

    def config(self) -> dict[str, Any]:
        heads = int(self._meta("attention.head_count"))
        hidden = int(self._meta("embedding_length"))
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._meta("vocab_size") or (len(tokens.data) if tokens is not None else 0)
        types = {t.tensor_type.name for t in self.reader.tensors}
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._meta("feed_forward_length")),
            "num_hidden_layers": int(self._meta("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._meta("attention.head_count_kv", heads)),
            "head_dim": int(self._meta("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._meta("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.names,
            "attention_bias": "blk.0.attn_q.bias" in self.names,
            "eos_token_id": _field(self.reader, "tokenizer.ggml.eos_token_id"),
            "bos_token_id": _field(self.reader, "tokenizer.ggml.bos_token_id"),
            # dtype auto on a GPU: bf16 files stay bf16, others (f16, quantized) go to f16
            "torch_dtype": "bfloat16"
            if "BF16" in types
            else "float32"
            if types <= {"F32"}
            else "float16",
        }
        scaling = self._meta("rope.scaling.type")
        if scaling == "linear":
            config["rope_scaling"] = {
                "rope_type": "linear",
                "factor": float(self._meta("rope.scaling.factor", 1.0)),
            }
        elif scaling not in (None, "none"):
            raise KilnError(
                f"llm backend: {self.path.name}: RoPE scaling '{scaling}' from GGUF is not "
                "supported; serve the Hugging Face folder",
                Status.INVALID_ARG,
            )
        return config

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        from gguf.quants import dequantize

        config = self.config()
        heads = {
            "attn_q": config["num_attention_heads"],
            "attn_k": config["num_key_value_heads"],
        }
        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                raise KilnError(
                    f"llm backend: {self.path.name} holds tensor '{tensor.name}', which kiln's "
                    f"{config['architectures'][0]} does not have",
                    Status.INVALID_ARG,
                )
            if name in self.keep_quantized:
                array = np.asarray(tensor.data)
                part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
                if self.arch == "llama" and part in heads:
                    array = _unpermute(array, heads[part])  # whole rows: blocks stay intact
                yield tensor.name, {name: torch.from_numpy(np.array(array))}
                continue
            try:
                array = dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise KilnError(
                    f"llm backend: {self.path.name}: tensor '{tensor.name}' is "
                    f"{tensor.tensor_type.name}, which the gguf package cannot dequantize",
                    Status.INVALID_ARG,
                ) from None
            part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            if self.arch == "llama" and part in heads:
                array = _unpermute(array, heads[part])
            # unquantized tensors are read-only views of the memory-mapped file: copied
            array = np.require(array, requirements=["C", "W"])
            yield tensor.name, {name: torch.from_numpy(array).to(dtype)}

    def quantized_weights(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Hugging Face name -> (GGML type, stored byte shape) of every quantized tensor."""
        out = {}
        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            if name is not None and tensor.tensor_type.name.startswith(("Q", "IQ", "TQ")):
                out[name] = (tensor.tensor_type.name, tuple(np.asarray(tensor.data).shape))
        return out

    def generation_config(self) -> dict[str, Any]:
        return {}  # a GGUF file carries no sampling defaults


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1)]
    printable += range(ord("\xae"), ord("\xff") + 1)
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return chars


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE files keep scores, not merges: every split of a token into two
    known pieces is a merge ranked by the token's score (higher first), then by the
    pieces' lengths (how transformers and tokenizers' converters order them)."""
    found: list[tuple[float, str, str]] = []
    for token, token_id in vocab.items():
        score = scores[token_id]
        pairs = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((score, left, right) for left, right in pairs)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def gguf_tokenizer(path: Path) -> tuple[Any, str, str, str | None, bool]:
    """(a ``tokenizers.Tokenizer``, BOS text, EOS text, chat template, whether it is
    byte-level) from the file's metadata: GPT-2 byte-level BPE (``gpt2``) or
    SentencePiece-style BPE (``llama``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors
    from tokenizers import pre_tokenizers as pre

    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise KilnError(f"llm backend: {path.name} holds no tokenizer", Status.INVALID_ARG)
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))

    def special(key: str) -> tuple[str, int | None]:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return (tokens[index], int(index)) if index is not None else ("", None)

    bos, bos_id = special("bos_token_id")
    eos, _ = special("eos_token_id")
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # a token outside the byte alphabet (a control token llama.cpp wrote as text) is
        # spelled in it, so that the vocabulary keeps one id per entry
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
            for i, t in enumerate(tokens)
        }
        raw_merges = _field(reader, "tokenizer.ggml.merges") or []
        merges = [tuple(m.split(" ", 1)) for m in raw_merges]
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
        split = _SPLITS.get(str(_field(reader, "tokenizer.ggml.pre", "")))
        if split is None:
            tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre.Sequence(
                [
                    pre.Split(Regex(split), behavior="isolated"),
                    pre.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        scores = list(_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        raw_merges = _field(reader, "tokenizer.ggml.merges")
        merges = (
            [tuple(m.split(" ", 1)) for m in raw_merges]
            if raw_merges
            else _merges_from_scores(vocab, scores)
        )
        unk, _ = special("unknown_token_id")
        tok = Tokenizer(
            models.BPE(vocab, merges, unk_token=unk or None, fuse_unk=True, byte_fallback=True)
        )
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    else:
        raise KilnError(
            f"llm backend: {path.name} uses the '{kind}' tokenizer; kiln builds 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece BPE) tokenizers from GGUF files",
            Status.INVALID_ARG,
        )
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _CONTROL and t in vocab
    ]
    tok.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)
    if add_bos and bos_id is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    template = _field(reader, "tokenizer.chat_template")
    return tok, bos, eos, str(template) if template else None, kind == "gpt2"
