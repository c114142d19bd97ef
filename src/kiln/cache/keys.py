"""A cache key: a digest of everything that decides a response (model, version, inputs,
requested outputs), and a shared cache's fingerprint of a model's files.

Two requests share an entry only when the model would see the same call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.types import DataType, InferenceRequest

# Output parameters that only say how the response travels back, not what it holds:
# a JSON client and a binary client asking the same question share one entry.
_TRANSPORT_PARAMETERS = frozenset(
    {"binary_data", "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"}
)


def request_key(
    model: str,
    version: str,
    request: InferenceRequest,
    output_names: Sequence[str],
    owner: int = 0,
) -> bytes:
    """Digest of everything that decides a response: model, version, inputs, outputs.

    ``owner`` tells loads of the same version apart, so a reloaded model never answers
    with what its predecessor computed.
    """
    digest = hashlib.blake2b(digest_size=32)
    digest.update(owner.to_bytes(8, "little"))

    def field(value: str | bytes) -> None:
        # Length-prefixed, so ("ab", "c") and ("a", "bc") never digest alike.
        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)

    field(model)
    field(version)
    # Input order on the wire does not change what the model computes.
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        field(tensor.name)
        field(tensor.datatype.value)
        field(",".join(str(d) for d in tensor.shape))
        _digest_data(digest, tensor.datatype, tensor.data)
    requested = {o.name: o.parameters for o in request.outputs}
    for name in output_names:
        field(name)
        params = requested.get(name, {})
        for key in sorted(params):
            if key not in _TRANSPORT_PARAMETERS:
                field(key)
                field(repr(params[key]))
    return digest.digest()


# Config fields that say how a model is run, not what it answers: servers that run the
# same model differently (instances, batching, warm-up) still share its cache entries.
_RUNNING_FIELDS = (
    "instance_group",
    "dynamic_batching",
    "model_warmup",
    "response_cache",
    "version_policy",
    "rate_limiter",
)


def model_fingerprint(config: ModelConfig, version_dir: Path) -> int:
    """What a shared cache's keys say of a model: its config (less how it is run) and the
    bytes of every file in its version folder, so that every server with the same model
    computes the same value, and a changed model file a different one."""
    digest = hashlib.blake2b(digest_size=8)
    trimmed = ModelConfig()
    trimmed.CopyFrom(config)
    for name in _RUNNING_FIELDS:
        if trimmed.DESCRIPTOR.fields_by_name.get(name) is not None:
            trimmed.ClearField(name)
    digest.update(trimmed.SerializeToString(deterministic=True))
    if version_dir.is_dir():
        files = sorted(
            p for p in version_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
        for path in files:
            name_bytes = path.relative_to(version_dir).as_posix().encode()
            digest.update(len(name_bytes).to_bytes(8, "little") + name_bytes)
            digest.update(path.stat().st_size.to_bytes(8, "little"))
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
    return int.from_bytes(digest.digest(), "little")


def _digest_data(digest: hashlib.blake2b, datatype: DataType, data: np.ndarray) -> None:
    if datatype is DataType.BYTES:
        for item in data.ravel():
            raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
            digest.update(len(raw).to_bytes(8, "little"))
            digest.update(raw)
        return
    digest.update(len(data.shape).to_bytes(8, "little"))
    digest.update(np.ascontiguousarray(data).data)
