"""Where a checkpoint's pieces are: ``config.json``, the weight files, the generation
defaults. A checkpoint is a Hugging Face folder or one ``.gguf`` file (``gguf_file.py``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kiln.core.errors import KilnError, Status

log = logging.getLogger(__name__)

#: ``generation_config.json`` fields that become default sampling values (vLLM's
#: ``--generation-config auto``), by their request field name
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Checkpoint(Protocol):
    path: Path

    def config(self) -> dict[str, Any]:
        """``config.json``'s content (for GGUF: built from the file's metadata)."""
        ...

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(where from, tensors by Hugging Face name) in pieces, so that a large model is
        never held twice in memory."""
        ...

    def generation_config(self) -> dict[str, Any]: ...


def open_checkpoint(path: Path) -> Checkpoint:
    if path.is_file() and path.suffix == ".gguf":
        from kiln.llm.gguf_file import GGUFCheckpoint

        return GGUFCheckpoint(path)
    if path.is_file():
        raise KilnError(
            f"llm backend: {path} is a file but not a .gguf file; give a Hugging Face folder "
            "or a .gguf file",
            Status.INVALID_ARG,
        )
    return FolderCheckpoint(path)


def _json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(f"llm backend: cannot read {path}: {exc}", Status.INVALID_ARG) from None
    if not isinstance(raw, dict):
        raise KilnError(f"llm backend: {path} is not a JSON object", Status.INVALID_ARG)
    return raw


class FolderCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path

    def config(self) -> dict[str, Any]:
        path = self.path / "config.json"
        if not path.is_file():
            raise KilnError(f"llm backend: no config.json in {self.path}", Status.INVALID_ARG)
        return _json(path)

    def weight_files(self) -> list[Path]:
        """The index's files when there is one (vLLM's rule): a folder may also ship the
        same weights in another layout (Mistral's ``consolidated.safetensors``), whose
        names kiln does not know."""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise KilnError(f"llm backend: {index} has no weight_map", Status.INVALID_ARG)
            names = sorted(set(map(str, weight_map.values())))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise KilnError(
                    f"llm backend: {index.name} names files missing from {self.path}: {missing}",
                    Status.INVALID_ARG,
                )
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        # without an index, the Hugging Face files when both layouts are present
        hf = [f for f in files if f.name.startswith("model")]
        return hf or files

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        from safetensors.torch import load_file

        files = self.weight_files()
        if not files:
            raise KilnError(
                f"llm backend: no *.safetensors file in {self.path}", Status.INVALID_ARG
            )
        for path in files:
            yield path.name, load_file(str(path))

    def generation_config(self) -> dict[str, Any]:
        path = self.path / "generation_config.json"
        return _json(path) if path.is_file() else {}


def torch_dtype_name(config: dict[str, Any]) -> str | None:
    """The checkpoint's own dtype (``torch_dtype``, or ``dtype`` in transformers >= 5)."""
    raw = config.get("torch_dtype") or config.get("dtype")
    return str(raw).removeprefix("torch.") if raw else None


def sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The default sampling values a ``generation_config.json`` gives (vLLM's ``auto``)."""
    return {k: generation[k] for k in GENERATION_DEFAULTS if generation.get(k) is not None}


def generation_eos_ids(generation: dict[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


#: sentence-transformers' pooling modes (``1_Pooling/config.json``) vLLM maps to its own
_ST_POOLING = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


#: sentence-transformers' Dense module types (vLLM's list)
_DENSE_TYPES = (
    "sentence_transformers.models.Dense",
    "sentence_transformers.base.modules.dense.Dense",
    "pylate.models.Dense.Dense",
)
#: a Dense module's activations, by the last part of their torch names
DENSE_ACTIVATIONS = ("identity", "tanh", "relu", "gelu", "sigmoid", "silu")


_DENSE_FUNCTIONS: dict[str, Any] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
}


@dataclass(frozen=True, slots=True)
class DenseLayer:
    """One sentence-transformers ``Dense`` module: ``activation(x @ weight.T + bias)``."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]
    activation: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.float(), self.weight, self.bias)
        act = _DENSE_FUNCTIONS.get(self.activation)
        return y if act is None else act(y)


def _modules(path: Path) -> list[dict[str, Any]] | None:
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(
            f"llm backend: cannot read {modules_file}: {exc}", Status.INVALID_ARG
        ) from None
    if not isinstance(modules, list):
        raise KilnError(f"llm backend: {modules_file} is not a JSON list", Status.INVALID_ARG)
    return [m for m in modules if isinstance(m, dict)]


def _module_folder(path: Path, module: dict[str, Any], kind: str) -> Path:
    """A module's folder, which must be inside the checkpoint and hold a config.json."""
    folder = (path / str(module.get("path", ""))).resolve()
    if not folder.is_relative_to(path.resolve()) or not (folder / "config.json").is_file():
        raise KilnError(
            f"llm backend: {path / 'modules.json'}'s {kind} module names no config.json inside "
            f"{path}: {module.get('path')!r}",
            Status.INVALID_ARG,
        )
    return folder


def task_instructions(path: Path) -> dict[str, str]:
    """An embedding model's prefixes by task (vLLM reads them for Cohere's ``input_type``):
    ``config.json``'s ``task_instructions``, else ``config_sentence_transformers.json``'s
    ``prompts`` (``{"query": "query: ", ...}``); empty for a file or a folder without
    them."""
    if not path.is_dir():
        return {}
    for name, key in (("config.json", "task_instructions"),
                      ("config_sentence_transformers.json", "prompts")):  # fmt: skip
        file = path / name
        if not file.is_file():
            continue
        found = _json(file).get(key)
        if isinstance(found, dict) and found:
            return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def sentence_transformers_dense(path: Path, width: int) -> list[DenseLayer]:
    """A sentence-transformers checkpoint's ``Dense`` modules, in order (vLLM's projector:
    applied to the pooled vectors before they are normalized); ``width``: the model's
    hidden size, which the first must take. Each folder's ``config.json`` gives
    ``in_features``, ``out_features``, ``bias`` and ``activation_function``; its
    ``model.safetensors`` the weights (``linear.weight``, or ``weight``)."""
    from safetensors.torch import load_file

    modules = _modules(path) or []
    out: list[DenseLayer] = []
    for module in modules:
        if module.get("type") not in _DENSE_TYPES:
            continue
        folder = _module_folder(path, module, "Dense")
        config = _json(folder / "config.json")
        act = str(config.get("activation_function") or "identity").rsplit(".", 1)[-1].lower()
        if act not in DENSE_ACTIVATIONS:
            raise KilnError(
                f"llm backend: {folder}'s activation {config.get('activation_function')!r} "
                f"is not one kiln has ({', '.join(DENSE_ACTIVATIONS)})",
                Status.INVALID_ARG,
            )
        weights_file = folder / "model.safetensors"
        if not weights_file.is_file():
            raise KilnError(
                f"llm backend: {folder} holds no model.safetensors (kiln reads no pickles)",
                Status.INVALID_ARG,
            )
        tensors = load_file(str(weights_file))
        key = next((k for k in ("linear.weight", "weight", "dense.weight") if k in tensors), None)
        if key is None:
            raise KilnError(
                f"llm backend: {weights_file} holds no linear.weight", Status.INVALID_ARG
            )
        weight = tensors[key].float()
        bias = tensors.get(key.replace("weight", "bias"))
        shape = (int(config.get("out_features", -1)), int(config.get("in_features", -1)))
        expected_in = out[-1].weight.shape[0] if out else width
        if tuple(weight.shape) != shape or shape[1] != expected_in:
            raise KilnError(
                f"llm backend: {folder}'s weight is {list(weight.shape)}, its config says "
                f"{list(shape)} and its input is {expected_in} wide",
                Status.INVALID_ARG,
            )
        if bias is not None and config.get("bias", True) is False:
            bias = None
        out.append(DenseLayer(weight, None if bias is None else bias.float(), act))
    return out


def sentence_transformers_pooling(path: Path) -> tuple[str | None, bool | None]:
    """How a sentence-transformers checkpoint pools, as vLLM reads it: ``modules.json``'s
    ``Pooling`` module names a folder whose ``config.json`` switches one mode on, and a
    ``Normalize`` module means L2-normalized vectors. (None, None): not such a checkpoint,
    or a mode kiln does not have (max, weighted mean), which is logged."""
    modules = _modules(path)
    if modules is None:
        return None, None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None, None
    folder = _module_folder(path, pooling, "Pooling")
    modes = [k for k, on in _json(folder / "config.json").items() if on is True]
    kind = next((_ST_POOLING[m] for m in modes if m in _ST_POOLING), None)
    if kind is None:
        log.warning(
            "llm: %s pools by %s, which kiln does not have; pooling by the model's default",
            path,
            ", ".join(modes) or "no mode",
        )
        return None, None
    return kind, "Normalize" in kinds
