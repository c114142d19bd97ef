"""Value objects: the model's shape (from ``config.json``) and the engine's limits."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.llm.lora import LoRAConfig
from kiln.llm.observability import ObservabilityConfig
from kiln.llm.profiler_config import ProfilerConfig
from kiln.llm.spec_config import SpeculativeConfig

# The architectures kiln runs (``config.json``'s ``architectures``): the Llama skeleton's
# and those built on it in kiln.llm.models (registry: kiln.llm.models.MODEL_CLASSES)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
#: sequence classifiers (a decoder with a ``score`` head on its last token: reward models,
#: decoder cross-encoders), as vLLM serves them on ``/classify``: the decoder they run
CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
#: encoder-only models (bidirectional attention, no KV cache: kiln.llm.encoder_runner), as
#: vLLM serves them: embeddings and, with a classification head, /classify, /score and
#: /rerank (cross-encoders); each architecture's family (kiln.llm.models.bert)
ENCODERS = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "RobertaModel": "roberta",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaModel": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    # a label for every token (named entities, parts of speech): vLLM's token_classify
    "BertForTokenClassification": "bert",
    "RobertaForTokenClassification": "roberta",
    "XLMRobertaForTokenClassification": "roberta",
}
#: the activations of an encoder's feed-forward (``hidden_act``) kiln runs
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu")
#: a pair's second-segment tokens (BERT's ``token_type_ids`` of 1) travel inside the token
#: ids, in the bits above this one (as vLLM packs them); the model splits them apart
TOKEN_TYPE_SHIFT = 30
#: whose window (when set) covers every layer, as Mistral's
_WINDOW_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
                       "Qwen3MoeForCausalLM")  # fmt: skip
#: whose window applies only with ``use_sliding_window``, to the layers ``layer_types`` name
_WINDOW_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
#: Gemma's alternating local/global layers: one global layer every this many by default
_GEMMA_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: vLLM's ``--generation-config``: ``auto`` (the checkpoint's generation_config.json),
#: ``vllm`` (none: the engine's defaults), or a folder holding a generation_config.json
GENERATION_CONFIG_MODES = ("auto", "vllm")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flex", "triton")
#: vLLM's names. ``LAST``: the last token's state (a causal decoder's only state that saw
#: the whole input); ``MEAN``: the average over the input's tokens; ``CLS``: the first's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
#: vLLM's ``--runner``: ``pooling`` serves ``/v1/embeddings`` (and not generation)
RUNNERS = ("generate", "pooling")
#: vLLM's ``--tool-call-parser`` names kiln has a parser for (kiln.frontends.openai.tool_parsers)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "phi4_mini_json",
                     "qwen3_coder", "qwen3_json", "qwen3_xml")  # fmt: skip
#: vLLM's reasoning parsers kiln has (``--reasoning-parser``)
REASONING_PARSERS = ("deepseek_r1", "mistral", "qwen3")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """vLLM's ``--pooler-config`` fields kiln serves (its defaults for an embed model)."""

    #: None: the model's default (``modules.json``'s sentence-transformers pooling when
    #: there is one, else ``CLS`` for an encoder, ``LAST`` for a decoder), set by the engine
    pooling_type: str | None = None
    #: None: the model's default (true, or whether ``modules.json`` has a ``Normalize``)
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise KilnError(
                f"llm backend: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got '{self.pooling_type}'",
                Status.INVALID_ARG,
            )

    @classmethod
    def from_json(cls, raw: str) -> PoolerConfig:
        """vLLM's ``--pooler-config`` JSON (``{"pooling_type": "MEAN", "normalize": false}``);
        any other key is refused, naming it."""
        try:
            fields: Any = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise KilnError(
                f"llm backend: pooler_config is not JSON: {exc}", Status.INVALID_ARG
            ) from None
        if not isinstance(fields, dict):
            raise KilnError("llm backend: pooler_config must be a JSON object", Status.INVALID_ARG)
        unknown = sorted(set(fields) - {"pooling_type", "normalize"})
        if unknown:
            raise KilnError(
                f"llm backend: pooler_config field '{unknown[0]}' is not supported by kiln "
                "(supported: pooling_type, normalize)",
                Status.INVALID_ARG,
            )
        normalize = fields.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise KilnError(
                f"llm backend: pooler_config normalize must be true or false, got {normalize!r}",
                Status.INVALID_ARG,
            )
        pooling = fields.get("pooling_type")
        return cls(None if pooling is None else str(pooling).upper(), normalize)


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """What the forward pass needs from a Hugging Face ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    #: Mistral's (and Qwen2's, when ``use_sliding_window``) attention window: the query at
    #: position i sees the keys at positions j with i - sliding_window < j <= i (the window
    #: holds the query itself). None: full causal attention.
    sliding_window: int | None = None
    #: layers that attend causally over the whole context despite ``sliding_window``
    #: (Qwen2's below ``max_window_layers``); every other layer uses the window
    full_attention_layers: tuple[int, ...] = ()
    #: a matryoshka embedding model (``is_matryoshka`` or ``matryoshka_dimensions`` in its
    #: config, as vLLM reads them): its vectors may be cut to a request's ``dimensions``
    is_matryoshka: bool = False
    #: the only sizes it may be cut to (None: any)
    matryoshka_dimensions: tuple[int, ...] | None = None
    #: a sequence classifier's classes (``id2label``'s labels, by id; empty: not one)
    labels: tuple[str, ...] = ()
    #: a pooled vector's width when not ``hidden_size`` (a sentence-transformers Dense
    #: module projects it: set by the engine at load)
    pooled_size: int | None = None
    #: a token classifier's labels (``*ForTokenClassification``: every token classified,
    #: vLLM's ``token_classify``); empty for any other model
    token_labels: tuple[str, ...] = ()
    #: an encoder whose inputs carry segment ids (BERT's ``type_vocab_size`` > 1): a
    #: pair's second text is told apart from its first (``TOKEN_TYPE_SHIFT``)
    token_types: bool = False
    #: Gemma 2's ``attn_logit_softcapping`` (None: none): only the portable attention
    #: backend caps scores, so the model runner picks it
    attn_logit_softcapping: float | None = None
    #: the whole ``config.json``: an architecture's own fields (experts, norms, Gemma's
    #: local rope) are read by its model class (kiln.llm.models)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: the whole causal context)."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    def layer_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]

    @property
    def is_encoder(self) -> bool:
        """An encoder-only model (BERT's family): it pools and never generates."""
        return self.architecture in ENCODERS

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelArgs:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] in ENCODERS:
            return _encoder_args(archs[0], raw)
        arch = CLASSIFIERS.get(archs[0], archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            known = SUPPORTED_ARCHITECTURES + tuple(CLASSIFIERS) + tuple(ENCODERS)
            raise KilnError(
                f"llm backend: architecture '{arch}' is not supported "
                f"(kiln runs {', '.join(known)})",
                Status.INVALID_ARG,
            )
        labels = _labels(raw) if archs[0] in CLASSIFIERS else ()
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers >= 5 nests theta and scaling under ``rope_parameters`` (Gemma 3: one
        # for each layer type; the global layers' here, the local ones' in kiln.llm.models)
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if isinstance(rope.get("full_attention"), dict):
            rope = dict(rope["full_attention"])
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if arch == "Gemma3ForCausalLM" and "rope_theta" not in raw and "rope_parameters" not in raw:
            theta = 1_000_000.0  # Gemma 3's global default
        eos = raw.get("eos_token_id")
        layers = int(raw["num_hidden_layers"])
        window, full_layers = _sliding_window(arch, raw, layers)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            # Gemma ties its head to the embeddings unless the config says otherwise
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in _GEMMA_PATTERN)),
            # Qwen2 has q/k/v biases without saying so in its config
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            sliding_window=window,
            full_attention_layers=full_layers,
            **_matryoshka(raw),
            # Gemma 3's config carries the field, but its attention does not read it
            attn_logit_softcapping=_float_or_none(raw.get("attn_logit_softcapping", 50.0))
            if arch == "Gemma2ForCausalLM"
            else None,
            labels=labels,
            hf_config=dict(raw),
        )

    @property
    def num_labels(self) -> int:
        """A sequence classifier's classes (0: a language model)."""
        return len(self.labels)

    @property
    def embedding_size(self) -> int:
        """The width of the vectors the model pools (its hidden size, or its Dense
        modules' output)."""
        return self.pooled_size or self.hidden_size

    @property
    def is_token_classifier(self) -> bool:
        """A label for every token (``*ForTokenClassification``)."""
        return bool(self.token_labels)

    @classmethod
    def load(cls, folder: Path) -> ModelArgs:
        from kiln.llm.checkpoint import open_checkpoint

        return cls.from_dict(open_checkpoint(folder).config())


def _encoder_args(arch: str, raw: dict[str, Any]) -> ModelArgs:
    """A BERT-family ``config.json``: post-norm layers with learned absolute positions.
    RoBERTa's positions start past its padding id (``pad_token_id + 1``), so it reads
    ``max_position_embeddings - pad_token_id - 1`` tokens (512 of its 514)."""
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise KilnError(
            f"llm backend: {arch} with position_embedding_type '{kind}' is not supported "
            "(kiln runs 'absolute')",
            Status.INVALID_ARG,
        )
    act = raw.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise KilnError(
            f"llm backend: {arch} with hidden_act '{act}' is not supported "
            f"(kiln runs {', '.join(ENCODER_ACTIVATIONS)})",
            Status.INVALID_ARG,
        )
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    if hidden % heads:
        raise KilnError(
            f"llm backend: {arch}'s hidden_size {hidden} is not a multiple of its "
            f"num_attention_heads {heads}",
            Status.INVALID_ARG,
        )
    positions = int(raw.get("max_position_embeddings", 512))
    if ENCODERS[arch] == "roberta":
        positions -= int(raw.get("pad_token_id", 1)) + 1
    if positions <= 0:
        raise KilnError(
            f"llm backend: {arch} leaves no positions for tokens (max_position_embeddings "
            f"{raw.get('max_position_embeddings')})",
            Status.INVALID_ARG,
        )
    return ModelArgs(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        rope_theta=0.0,
        rope_scaling=None,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        attention_bias=True,
        eos_token_ids=(),
        labels=_labels(raw) if arch.endswith("ForSequenceClassification") else (),
        token_labels=_labels(raw) if arch.endswith("ForTokenClassification") else (),
        token_types=int(raw.get("type_vocab_size", 2)) > 1,
        **_matryoshka(raw),
        hf_config=dict(raw),
    )


def _matryoshka(raw: dict[str, Any]) -> dict[str, Any]:
    """``is_matryoshka`` and ``matryoshka_dimensions`` as vLLM reads them from config.json."""
    dims = raw.get("matryoshka_dimensions")
    return {
        "is_matryoshka": bool(raw.get("is_matryoshka") or dims),
        "matryoshka_dimensions": tuple(int(d) for d in dims) if dims else None,
    }


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels by class id: ``id2label`` (transformers writes it), else
    ``num_labels`` of ``LABEL_<i>`` (transformers' names), else its default two."""
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except ValueError:
            by_id = {}
        if sorted(by_id) == list(range(len(by_id))):
            return tuple(by_id[i] for i in range(len(by_id)))
        raise KilnError(
            "llm backend: config.json's id2label must map the class ids 0..n-1 to labels",
            Status.INVALID_ARG,
        )
    count = int(raw.get("num_labels") or 2)
    return tuple(f"LABEL_{i}" for i in range(count))


def _sliding_window(
    arch: str, raw: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers exempt from it, as transformers reads them: Mistral
    applies ``sliding_window`` to every layer; Qwen2 only with ``use_sliding_window``, and
    then to the layers its ``layer_types`` call ``sliding_attention`` (when absent: layers
    ``max_window_layers`` (default 28) and above)."""
    window = raw.get("sliding_window", 4096 if arch in _GEMMA_PATTERN else None)
    if arch == "LlamaForCausalLM" or window is None:
        return None, ()  # Llama has no window; null: full attention everywhere
    if arch in _WINDOW_QWEN and not raw.get("use_sliding_window", False):
        return None, ()  # Qwen2 configs carry a window they do not use
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise KilnError(
            f"llm backend: sliding_window must be a positive integer, got {window!r}",
            Status.INVALID_ARG,
        )
    if arch in _WINDOW_EVERY_LAYER:
        return window, ()
    kinds = raw.get("layer_types")
    if kinds is None and arch in _GEMMA_PATTERN:
        # every pattern-th layer global, the others local (transformers' default)
        pattern = int(raw.get("sliding_window_pattern", _GEMMA_PATTERN[arch]))
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(num_layers)]  # fmt: skip
    elif kinds is None:
        first = int(raw.get("max_window_layers", 28))
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown or len(kinds) != num_layers:
        raise KilnError(
            "llm backend: kiln supports layer_types 'full_attention' and 'sliding_attention', "
            f"one per layer ({num_layers}); got {kinds}",
            Status.INVALID_ARG,
        )
    return window, tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def batch_invariant_env() -> bool:
    """vLLM's switch, ``VLLM_BATCH_INVARIANT=1`` (``0``, unset: off)."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("1", "true")


#: vLLM's ``--kv-cache-dtype`` values (kiln.llm.quantization.kv_cache)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(slots=True)
class EngineConfig:
    """The engine's limits, named as vLLM names them."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    #: blocks in the KV cache; 0: derived from ``kv_cache_memory_bytes``
    num_gpu_blocks: int = 0
    #: the KV cache's size; 0: sized by the device (CPU: a share of the free memory; GPU:
    #: ``gpu_memory_utilization`` of the device after a profiling pass, as vLLM)
    kv_cache_memory_bytes: int = 0
    #: the share of the GPU's memory this engine may hold: weights, activations, KV cache
    gpu_memory_utilization: float = 0.9
    #: 0: the model's ``max_position_embeddings``
    max_model_len: int = 0
    max_waiting: int = 1024
    #: ``auto``: the checkpoint's dtype on GPU, float32 on the CPU (kiln's CPU kernels are
    #: float32); or float32 | float16 | bfloat16
    dtype: str = "auto"
    device: str = "cpu"
    #: reuse the KV of full blocks shared with earlier requests (vLLM V1's default: on)
    enable_prefix_caching: bool = True
    #: ``fcfs``, or ``priority`` (requests' ``priority`` field, lower first)
    scheduling_policy: str = "fcfs"
    #: vLLM's ``--scheduler-reserve-full-isl``: a waiting request is admitted only when the
    #: KV cache holds its whole prompt, not only the first chunk a step prefills (without
    #: it a long prompt admitted in chunks preempts others later, or itself)
    scheduler_reserve_full_isl: bool = True
    #: vLLM's ``--watermark``: the share of KV blocks a waiting (or preempted) request must
    #: leave free to be admitted while others run, headroom against preemption thrash
    watermark: float = 0.0
    #: ``auto`` (flex on CUDA, torch elsewhere), ``torch`` (portable SDPA) or ``flex``
    attention_backend: str = "auto"
    #: no CUDA graphs: every step runs eagerly (vLLM's name)
    enforce_eager: bool = False
    #: decode batch sizes to capture as CUDA graphs; empty: 1, 2, 4, ... up to max_num_seqs
    cuda_graph_sizes: tuple[int, ...] = ()
    #: a Jinja chat template (the text, or a file holding it) replacing the tokenizer's
    chat_template: str = ""
    #: ``auto``, ``vllm`` or a folder (GENERATION_CONFIG_MODES)
    generation_config: str = "auto"
    #: vLLM's ``--runner``: ``generate``, or ``pooling`` (``/v1/embeddings``)
    runner: str = "generate"
    #: how a ``pooling`` model pools (vLLM's ``--pooler-config``)
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    #: vLLM's ``--speculative-config`` (None: no speculative decoding)
    speculative_config: SpeculativeConfig | None = None
    #: vLLM's ``--profiler-config`` (None: ``/start_profile`` is not served)
    profiler_config: ProfilerConfig | None = None
    #: vLLM's ``--quantization``: ``auto`` (the checkpoint's ``quantization_config``) or a
    #: method that must be the checkpoint's (kiln.llm.quantization.METHODS)
    quantization: str = "auto"
    #: vLLM's ``--kv-cache-dtype``: ``auto`` (the model's dtype), ``fp8`` (= ``fp8_e4m3``),
    #: ``fp8_e5m2`` (kiln.llm.quantization.kv_cache)
    kv_cache_dtype: str = "auto"
    #: vLLM's ``--enable-lora`` and its settings (None: no adapters; kiln.llm.lora)
    lora_config: LoRAConfig | None = None
    #: vLLM's ``--tensor-parallel-size``: ranks the weights and KV heads are split over
    #: (kiln.llm.parallel), one process each
    tensor_parallel_size: int = 1
    #: vLLM's ``--max-logprobs``: the most top alternatives a request's ``logprobs`` (or
    #: ``prompt_logprobs``) may ask per token; -1: the vocabulary
    max_logprobs: int = 20
    #: vLLM's ``--seed``: torch's generators are seeded with it when the engine is built, so
    #: requests without a ``seed`` of their own draw the same numbers from one start to the
    #: next (None: torch's own default seed)
    seed: int | None = None
    #: vLLM's ``--stream-interval``: a stream's tokens reach its reader in runs of this
    #: many (fewer events and socket writes per token; the first token is never held)
    stream_interval: int = 1
    #: vLLM's ``--max-num-queued-reqs``: requests in flight (waiting or running; one with
    #: ``n`` samples counts ``n``) beyond which a new one is refused with 503 (None: only
    #: ``max_waiting + max_num_seqs`` bounds them)
    max_num_queued_reqs: int | None = None
    #: vLLM's ``--max-num-queued-tokens``: a new request is refused with 503 while the
    #: requests still in prefill (no output yet) hold this many prompt tokens (None: off)
    max_num_queued_tokens: int | None = None
    #: vLLM's ``VLLM_BATCH_INVARIANT``: a request's logprobs are the same bits whatever
    #: else runs in its steps (kiln.llm.cpu_linear.TILE_ROWS; the CPU's float32 path)
    batch_invariant: bool = field(default_factory=batch_invariant_env)
    #: the model's API name, for messages that must name it (a tensor-parallel worker's)
    served_model_name: str = ""
    #: vLLM's ``--kv-cache-metrics``, ``--enable-mfu-metrics``, ... (kiln.llm.observability)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    extra: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "stream_interval"):
            if getattr(self, name) <= 0:
                raise KilnError(
                    f"llm backend: {name} must be positive, got {getattr(self, name)}",
                    Status.INVALID_ARG,
                )
        if self.dtype not in DTYPES:
            raise KilnError(
                f"llm backend: dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'",
                Status.INVALID_ARG,
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise KilnError(
                "llm backend: gpu_memory_utilization must be in (0, 1], got "
                f"{self.gpu_memory_utilization}",
                Status.INVALID_ARG,
            )
        if self.kv_cache_memory_bytes < 0 or self.num_gpu_blocks < 0 or self.max_model_len < 0:
            raise KilnError(
                "llm backend: kv_cache_memory_bytes, num_gpu_blocks and max_model_len must "
                "not be negative",
                Status.INVALID_ARG,
            )
        if self.max_logprobs < -1:
            raise KilnError(
                f"llm backend: max_logprobs must be -1 (the vocabulary) or at least 0, got "
                f"{self.max_logprobs}",
                Status.INVALID_ARG,
            )
        if not 0 <= self.watermark < 1:
            raise KilnError(
                f"llm backend: watermark must be in [0, 1), got {self.watermark}",
                Status.INVALID_ARG,
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise KilnError(
                f"llm backend: scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got '{self.scheduling_policy}'",
                Status.INVALID_ARG,
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise KilnError(
                f"llm backend: attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got '{self.attention_backend}'",
                Status.INVALID_ARG,
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise KilnError(
                f"llm backend: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got '{self.kv_cache_dtype}'",
                Status.INVALID_ARG,
            )
        if self.runner not in RUNNERS:
            raise KilnError(
                f"llm backend: runner must be one of {', '.join(RUNNERS)}, got '{self.runner}'",
                Status.INVALID_ARG,
            )
        if self.speculative_config is not None:
            self.speculative_config.check(self.max_num_batched_tokens)
        if self.lora_config is not None:
            self.lora_config.check()
        self.observability.check()
        if self.tensor_parallel_size < 1:
            raise KilnError(
                "llm backend: tensor_parallel_size must be at least 1, got "
                f"{self.tensor_parallel_size}",
                Status.INVALID_ARG,
            )
        if self.batch_invariant:
            # the adapters' and the drafts' products are batched by their own rules
            others = {
                "enable_lora": self.lora_config is not None,
                "speculative_config": self.speculative_config is not None,
                "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
            }
            for what, on in others.items():
                if on:
                    raise KilnError(
                        f"llm backend: batch_invariant is not supported with {what}",
                        Status.INVALID_ARG,
                    )
        if self.tensor_parallel_size > 1 and self.lora_config is not None:
            # the adapters' A/B weights are not split over the ranks (kiln.llm.lora)
            raise KilnError(
                "llm backend: enable_lora with tensor_parallel_size > 1 is not supported",
                Status.INVALID_ARG,
            )
        if any(s <= 0 for s in self.cuda_graph_sizes):
            raise KilnError(
                "llm backend: cuda_graph_sizes must be positive, got "
                f"{list(self.cuda_graph_sizes)}",
                Status.INVALID_ARG,
            )
