"""Triton's vLLM-backend tensors on kiln's engine: ``text_input`` in, ``text_output`` out.

The inputs and outputs are those Triton's vLLM backend auto-completes (names, datatypes,
dims, optional flags), with its meaning: ``sampling_parameters`` is a JSON string of vLLM
``SamplingParams`` (values may be strings, converted to the field's type, as the backend
converts them; without the tensor the request's own parameters are read); a streamed
request answers one response per engine step with the new text, the last one flagged
final; otherwise one response with the prompt followed by the completion unless
``exclude_input_in_output``. ``return_*`` booleans add the optional outputs.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.llm.params import SAMPLING_FIELDS, InvalidField, integer, sampling_fields
from kiln.llm.sequence import SamplingParams, find_stop, token_by_token
from kiln.llm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kiln.llm.backend import LLMBackend
    from kiln.llm.lora import LoRARequest

#: (name, datatype, dims, optional) as Triton's vLLM backend auto-completes them; its
#: ``image``, ``return_logprobs`` and ``embedding_request`` inputs are left out, so a
#: request sending them is refused by name (kiln has no images, sampled-token ranks or
#: embeddings on this path)
INPUTS = (
    ("text_input", PbDataType.TYPE_STRING, (1,), False),
    ("stream", PbDataType.TYPE_BOOL, (1,), True),
    ("sampling_parameters", PbDataType.TYPE_STRING, (1,), True),
    ("exclude_input_in_output", PbDataType.TYPE_BOOL, (1,), True),
    ("return_finish_reason", PbDataType.TYPE_BOOL, (1,), True),
    ("return_cumulative_logprob", PbDataType.TYPE_BOOL, (1,), True),
    ("return_num_input_tokens", PbDataType.TYPE_BOOL, (1,), True),
    ("return_num_output_tokens", PbDataType.TYPE_BOOL, (1,), True),
)
OUTPUTS = (
    ("text_output", PbDataType.TYPE_STRING, (-1,)),
    ("finish_reason", PbDataType.TYPE_STRING, (-1,)),
    ("cumulative_logprob", PbDataType.TYPE_FP32, (-1,)),
    ("num_input_tokens", PbDataType.TYPE_UINT32, (1,)),
    ("num_output_tokens", PbDataType.TYPE_UINT32, (-1,)),
)
_RETURNS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which Triton's vLLM backend keeps
MAX_STOP_STRINGS = 64
#: request parameters that are Triton's own, not sampling fields (when the request's
#: parameters stand in for ``sampling_parameters``)
_TRITON_PARAMETERS = frozenset(
    ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers")
)
#: the JSON type each supported field converts a string to (vLLM backend's type mapping)
_FLOATS = frozenset(
    ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
)
_INTS = frozenset(("top_k", "seed", "max_tokens"))
_BOOLS = frozenset(("ignore_eos",))
_SUPPORTED = frozenset((*SAMPLING_FIELDS, "max_tokens", "stop"))
#: vLLM SamplingParams fields kiln does not implement here, with vLLM's default: the
#: default is accepted (it asks for nothing), any other value is refused by name
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "best_of": None,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
    "bad_words": None,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "structured_outputs": None,
    "guided_decoding": None,
    "logits_processors": None,
    "output_kind": None,
    "extra_args": None,
}


def auto_complete(config: ModelConfig) -> None:
    """Add the inputs and outputs the config lacks (as Triton's vLLM backend does), no
    batching (the engine batches), and the decoupled policy unless the config sets one."""
    have = {t.name for t in config.input}
    for name, datatype, dims, optional in INPUTS:
        if name not in have:
            config.input.add(name=name, data_type=datatype, dims=dims, optional=optional)
    have = {t.name for t in config.output}
    for name, datatype, dims in OUTPUTS:
        if name not in have:
            config.output.add(name=name, data_type=datatype, dims=dims)
    config.max_batch_size = 0
    if not config.HasField("model_transaction_policy"):
        config.model_transaction_policy.decoupled = True


def _invalid(model: str, message: str) -> KilnError:
    return KilnError(f"model '{model}': {message}", Status.INVALID_ARG)


def _flag(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    value = inputs.get(name)
    return None if value is None or value.size == 0 else bool(value.reshape(-1)[0])


def _text(inputs: Mapping[str, np.ndarray], name: str, model: str) -> str | None:
    value = inputs.get(name)
    if value is None:
        return None
    if value.size != 1:
        raise _invalid(model, f"input '{name}' must hold one string, got {value.size} elements")
    item = value.reshape(-1)[0]
    try:
        return item.decode() if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise _invalid(model, f"input '{name}' is not valid UTF-8") from None


def _coerce(key: str, value: Any) -> Any:
    """A string value as the field's type, as Triton's vLLM backend converts them."""
    if not isinstance(value, str):
        return value
    try:
        if key in _FLOATS:
            return float(value)
        if key in _INTS:
            return int(value)
    except ValueError:
        raise InvalidField(key, f"'{key}' must be a number, got {value!r}") from None
    if key in _BOOLS or isinstance(_UNSUPPORTED_DEFAULTS.get(key), bool):
        low = value.strip().lower()
        if low in ("true", "false"):
            return low == "true"
    return value


def sampling_dict(
    inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any], model: str
) -> dict[str, Any]:
    """The request's sampling fields: the ``sampling_parameters`` JSON object, or without
    that tensor the request's parameters (Triton's own left out)."""
    raw = _text(inputs, "sampling_parameters", model)
    if raw is None:
        return {
            k: v
            for k, v in parameters.items()
            if k not in _TRITON_PARAMETERS and not k.startswith(("triton_", "binary_data"))
        }
    try:
        fields = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _invalid(model, f"input 'sampling_parameters' is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise _invalid(model, "input 'sampling_parameters' must be a JSON object of vLLM "
                       "SamplingParams fields")  # fmt: skip
    return fields


@dataclass(slots=True)
class TritonRequest:
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    #: the prompt starts ``text_output`` (a whole response only)
    prepend_input: bool
    returns: dict[str, bool]
    #: the adapter ``lora_name`` chose (Triton's vLLM backend's field); None: the base model
    lora: LoRARequest | None = None


def parse(
    llm: LLMBackend, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any],
    decoupled: bool,
) -> TritonRequest:  # fmt: skip
    """Check and tokenize one request (off the event loop: tokenizing takes time in
    proportion to the prompt). Errors are INVALID_ARG and name the input or field."""
    model = llm.config.name
    prompt = _text(inputs, "text_input", model)
    if not prompt:
        raise _invalid(model, "input 'text_input' must be a non-empty string")
    stream = bool(_flag(inputs, "stream"))
    if stream and not decoupled:
        raise _invalid(
            model,
            "input 'stream' is true, which sends several responses: use the gRPC stream "
            "(ModelStreamInfer) or generate_stream, on a model with the decoupled policy",
        )
    exclude = _flag(inputs, "exclude_input_in_output")
    if stream and exclude is False:
        raise _invalid(  # Triton's vLLM backend's refusal
            model, "When streaming, `exclude_input_in_output` = False is not allowed."
        )
    returns = {name: bool(_flag(inputs, name)) for name in _RETURNS}
    try:
        fields = {k: _coerce(k, v) for k, v in sampling_dict(inputs, parameters, model).items()}
        lora = _adapter(llm, fields.pop("lora_name", None))
        for key, value in fields.items():
            if key in _SUPPORTED:
                continue
            if key in _UNSUPPORTED_DEFAULTS:
                if value == _UNSUPPORTED_DEFAULTS[key]:
                    continue
                raise InvalidField(key, f"sampling parameter '{key}' is not supported by kiln")
            raise InvalidField(
                key,
                f"unknown sampling parameter '{key}' (kiln takes {', '.join(sorted(_SUPPORTED))})",
            )
        sampling = sampling_fields(fields)
        max_tokens = integer(fields, "max_tokens")
        stops = _stops(fields.get("stop"))
    except InvalidField as exc:
        raise _invalid(model, f"sampling_parameters: {exc.message}") from None
    ids = llm.tokenizer.encode(prompt)
    limit = llm.engine.config.max_model_len
    room = limit - len(ids)
    if max_tokens is not None and not 0 < max_tokens <= max(room, 1):
        raise _invalid(
            model,
            f"sampling_parameters: max_tokens must be in [1, {max(room, 1)}] (the context "
            f"holds {limit} tokens, the prompt has {len(ids)}), got {max_tokens}",
        )
    if returns["return_cumulative_logprob"]:
        sampling["logprobs"] = 0  # the sampled tokens' own logprobs, no alternatives
    params = SamplingParams(
        max_tokens=max_tokens or min(DEFAULT_MAX_TOKENS, max(room, 1)), **sampling
    )
    try:
        llm.engine.check_request(len(ids), params, 0, lora)
    except InvalidField as exc:
        raise _invalid(model, exc.message) from None
    prepend = not stream and exclude is not True
    return TritonRequest(prompt, ids, params, stops, stream, prepend, returns, lora)


def _adapter(llm: LLMBackend, name: Any) -> LoRARequest | None:
    """The served adapter ``lora_name`` names (``--lora-modules``, or loaded at run time)."""
    if name is None:
        return None
    if llm.loras is None:
        raise InvalidField("lora_name", f"lora_name {name!r}: LoRA is not enabled on this "
                           "model (--enable-lora, or enable_lora in model.json)")  # fmt: skip
    try:
        return llm.loras.named(name)
    except KilnError as exc:
        raise InvalidField("lora_name", exc.message) from None


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidField("stop", "'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidField(
            "stop", f"'stop' holds {len(stops)} strings, more than {MAX_STOP_STRINGS}"
        )
    return tuple(stops)


@dataclass(slots=True)
class _State:
    text: str = ""  # released, not yet sent
    held: str = ""  # could begin a stop string
    tokens: int = 0  # generated so far
    sent_tokens: int = 0
    logprob: float = 0.0


def _outputs(
    req: TritonRequest, text: str, finish: str | None, state: _State, whole: bool
) -> dict[str, np.ndarray]:
    out = {"text_output": np.array([text.encode()], dtype=np.object_)}
    r = req.returns
    if r["return_finish_reason"]:
        # str() of vLLM's None on the responses before the last, as the backend sends it
        out["finish_reason"] = np.array([str(finish).encode()], dtype=np.object_)
    if r["return_cumulative_logprob"]:
        out["cumulative_logprob"] = np.array([state.logprob], dtype=np.float32)
    if r["return_num_input_tokens"]:
        out["num_input_tokens"] = np.array([len(req.prompt_ids)], dtype=np.uint32)
    if r["return_num_output_tokens"]:
        count = state.tokens if whole else state.tokens - state.sent_tokens
        out["num_output_tokens"] = np.array([count], dtype=np.uint32)
    state.sent_tokens = state.tokens
    return out


async def generate(
    llm: LLMBackend, req: TritonRequest
) -> AsyncGenerator[tuple[dict[str, np.ndarray], bool], None]:
    """(outputs, final) per response: one per engine step when streaming, else one."""
    state = _State()
    detok = IncrementalDetokenizer(llm.tokenizer, prompt_ids=req.prompt_ids)
    hold = max((len(s) for s in req.stops), default=1) - 1
    rid = f"triton-{uuid.uuid4().hex}"
    engine_outputs = llm.async_engine.generate(
        req.prompt_ids, req.params, rid, lora_request=req.lora
    )
    async with aclosing(engine_outputs) as outputs:
        async for out in outputs:
            finish = out.finish_reason if out.finished else None
            pending = state.held
            # several steps' tokens and a stop string: token by token, so that the stop
            # ends the output (and its count) at the token that completes it
            pieces = (
                token_by_token(out, False)
                if req.stops and len(out.new_token_ids) > 1
                else ((out.new_token_ids, out.logprobs or [], out.num_output_tokens, out.finished),)
            )
            for ids, entries, tokens, final in pieces:
                state.tokens = tokens
                state.logprob += sum(lp.logprob for lp in entries)
                start = max(len(pending) - hold, 0)  # what a step of its own would hold
                pending += detok.add(ids, final=final)
                found = find_stop(pending, req.stops, start)
                if found is not None:
                    pending, finish = pending[: found[0]], "stop"
                    break
            cut = len(pending) if finish is not None else max(len(pending) - hold, 0)
            state.held = pending[cut:]
            if req.stream:
                yield _outputs(req, pending[:cut], finish, state, False), finish is not None
            else:
                state.text += pending[:cut]
            if finish is not None:
                if not req.stream:
                    text = (req.prompt if req.prepend_input else "") + state.text
                    yield _outputs(req, text, finish, state, True), True
                return  # leaving closes the engine's stream: a stop string aborts the rest
