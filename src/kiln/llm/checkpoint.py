"""Where a checkpoint's pieces are: ``config.json``, the weight files, the generation
defaults. A checkpoint is a Hugging Face folder or one ``.gguf`` file (``gguf_file.py``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
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


def sentence_transformers_pooling(path: Path) -> tuple[str | None, bool | None]:
    """How a sentence-transformers checkpoint pools, as vLLM reads it: ``modules.json``'s
    ``Pooling`` module names a folder whose ``config.json`` switches one mode on, and a
    ``Normalize`` module means L2-normalized vectors. (None, None): not such a checkpoint,
    or a mode kiln does not have (max, weighted mean), which is logged."""
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.is_file():
        return None, None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(
            f"llm backend: cannot read {modules_file}: {exc}", Status.INVALID_ARG
        ) from None
    if not isinstance(modules, list):
        raise KilnError(f"llm backend: {modules_file} is not a JSON list", Status.INVALID_ARG)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None, None
    folder = (path / str(pooling.get("path", ""))).resolve()
    if not folder.is_relative_to(path.resolve()) or not (folder / "config.json").is_file():
        raise KilnError(
            f"llm backend: {modules_file}'s Pooling module names no config.json inside "
            f"{path}: {pooling.get('path')!r}",
            Status.INVALID_ARG,
        )
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
