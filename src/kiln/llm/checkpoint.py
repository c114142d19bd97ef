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
