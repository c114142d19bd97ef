"""A model's inputs and outputs as core checks them, built once at load time.

Every frontend funnels into :meth:`ModelSignature.validate`, so HTTP, gRPC and the Python
API accept and refuse the same requests with the same messages. Wording follows Triton's
where Triton has one, because scripts written for Triton match on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.sequence_config import scheduler_inputs, state_outputs
from kiln.core.errors import invalid_arg
from kiln.core.limits import tensor_elements
from kiln.core.types import DataType, InferenceRequest


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: DataType
    dims: tuple[int, ...]  # without the batch dim
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    label_filename: str = ""

    def full_shape(self, max_batch_size: int) -> list[int]:
        return ([-1] if max_batch_size > 0 else []) + list(self.dims)


def _fmt(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


class ModelSignature:
    def __init__(self, config: ModelConfig) -> None:
        self.name = config.name
        self.max_batch_size = config.max_batch_size
        self.inputs: dict[str, TensorSpec] = {}
        self.outputs: dict[str, TensorSpec] = {}
        # The sequence batcher supplies control and state inputs and keeps state outputs:
        # they are no part of what a client sends or receives.
        # So are batch inputs (ragged batching): kiln builds them for each batch.
        built = {target for b in config.batch_input for target in b.target_name}
        own_inputs = scheduler_inputs(config) | built
        own_outputs = state_outputs(config)
        for i in config.input:
            if i.name in own_inputs:
                continue
            self.inputs[i.name] = TensorSpec(
                i.name,
                DataType.from_config(_enum_name(i.data_type)),
                tuple(i.dims),
                tuple(i.reshape.shape) if i.HasField("reshape") else None,
                i.optional,
            )
        for o in config.output:
            if o.name in own_outputs:
                continue
            self.outputs[o.name] = TensorSpec(
                o.name,
                DataType.from_config(_enum_name(o.data_type)),
                tuple(o.dims),
                tuple(o.reshape.shape) if o.HasField("reshape") else None,
                label_filename=o.label_filename,
            )
        self.required = [s.name for s in self.inputs.values() if not s.optional]
        self.output_names = list(self.outputs)

    def validate(self, request: InferenceRequest) -> int:
        """Check a request against the model; return its batch size (1 if not batching)."""
        model = self.name
        names = [t.name for t in request.inputs]
        seen: set[str] = set()
        for name in names:
            if name not in self.inputs:
                raise invalid_arg(f"unexpected inference input '{name}' for model '{model}'")
            if name in seen:
                raise invalid_arg(f"input '{name}' given more than once for model '{model}'")
            seen.add(name)
        missing = [n for n in self.required if n not in seen]
        if missing:
            raise invalid_arg(
                f"expected {len(self.required)} inputs but got {len(names)} inputs for model "
                f"'{model}'. Got input(s) {names}, but missing required input(s) {missing}. "
                "Please provide all required input(s)."
            )
        batch = 0
        for tensor in request.inputs:
            spec = self.inputs[tensor.name]
            if tensor.datatype is not spec.datatype:
                raise invalid_arg(
                    f"unexpected datatype {tensor.datatype.config_name} for inference input "
                    f"'{tensor.name}', expecting {spec.datatype.config_name} for model '{model}'"
                )
            shape = tensor.shape
            dims = shape
            if self.max_batch_size > 0:
                if len(shape) == 0:
                    raise invalid_arg(
                        f"input '{tensor.name}' for model '{model}' has no batch dimension: "
                        f"the model supports batching, so the shape must be "
                        f"{_fmt(spec.full_shape(self.max_batch_size))}"
                    )
                this_batch = shape[0]
                if batch and this_batch != batch:
                    raise invalid_arg(
                        f"inputs of model '{model}' disagree on the batch size: "
                        f"'{tensor.name}' has {this_batch}, others have {batch}"
                    )
                batch = this_batch
                dims = shape[1:]
            # config dims are what the client sends; `reshape` is what the model receives
            if not _matches(dims, spec.dims):
                raise invalid_arg(
                    f"unexpected shape for input '{tensor.name}' for model '{model}'. "
                    f"Expected {_fmt(spec.full_shape(self.max_batch_size))}, got {_fmt(shape)}"
                )
        if self.max_batch_size > 0:
            if batch < 1 and request.inputs:
                raise invalid_arg(f"inference request batch-size must be >= 1 for '{model}'")
            if batch > self.max_batch_size:
                raise invalid_arg(
                    f"inference request batch-size must be <= {self.max_batch_size} for '{model}'"
                )
        wanted: set[str] = set()
        for out in request.outputs:
            if out.name not in self.outputs:
                raise invalid_arg(f"unexpected inference output '{out.name}' for model '{model}'")
            # Each copy would be answered (and encoded) again: a body of one output
            # repeated costs the server work quadratic in its length.
            if out.name in wanted:
                raise invalid_arg(
                    f"output '{out.name}' requested more than once for model '{model}'"
                )
            wanted.add(out.name)
        return max(batch, 1)


def _matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    if len(shape) != len(dims):
        return False
    return all(d == -1 or d == s for s, d in zip(shape, dims, strict=True))


def _enum_name(value: int) -> str:
    return str(PbDataType.Name(value))


def check_request_limits(request: InferenceRequest, max_tensors: int, max_elements: int) -> None:
    """Server-wide limits (``--max-input-tensors``, ``--max-tensor-elements``; 0 = none),
    checked before the model's own signature so every model and frontend agrees."""
    model = request.model_name
    if max_tensors and len(request.inputs) > max_tensors:
        raise invalid_arg(
            f"inference request for model '{model}' has {len(request.inputs)} inputs, more "
            f"than the server's limit of {max_tensors} (--max-input-tensors)"
        )
    for tensor in request.inputs:
        # shape, rank and element count: the frontends checked them while decoding; a
        # request built in Python (the API, BLS) is checked here
        tensor_elements(model, tensor.name, tensor.shape, max_elements)
