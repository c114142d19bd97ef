"""Check a whole model repository and report every problem, not only the first."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.config.loader import (
    DEFAULT_CONFIG_NAME,
    ConfigError,
    find_line,
    parse_config_text,
    validate_config,
)
from kiln.config.model_config_pb2 import ModelConfig

__all__ = ["check_repository", "default_model_filename", "version_folders"]

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_FILENAME = "model.onnx"

# Where Triton looks for the model when default_model_filename is not set.
# None: the model needs no file (ensemble). Unknown platforms and custom backends are not checked.
_PLATFORM_FILES: dict[str, str | None] = {
    ONNX_PLATFORM: ONNX_FILENAME,
    "pytorch_libtorch": "model.pt",
    "tensorrt_plan": "model.plan",
    "tensorflow_graphdef": "model.graphdef",
    "tensorflow_savedmodel": "model.savedmodel",
    "ensemble": None,
}
_BACKEND_FILES: dict[str, str | None] = {
    "onnxruntime": ONNX_FILENAME,
    "pytorch": "model.pt",
    "tensorrt": "model.plan",
    "python": "model.py",
    "openvino": "model.xml",
    "torch_aoti": "model.pt2",
    "vllm": "model.json",
}


def check_repository(repo: Path) -> list[ConfigError]:
    repo = Path(repo)
    if not repo.is_dir():
        return [ConfigError("model repository is not a folder", str(repo))]
    problems: list[ConfigError] = []
    for model_dir in sorted(repo.iterdir()):
        if _skipped(model_dir.name) or not model_dir.is_dir():
            continue
        problems.extend(_check_model(model_dir))
    return sorted(problems, key=ConfigError.sort_key)


def version_folders(model_dir: Path) -> list[Path]:
    """Version folders Triton would serve: numeric names, no leading zero (except "0")."""
    found = []
    for entry in model_dir.iterdir():
        name = entry.name
        if entry.is_dir() and name.isdigit() and name.isascii() and (name == "0" or name[0] != "0"):
            found.append(entry)
    return sorted(found, key=lambda p: int(p.name))


def default_model_filename(cfg: ModelConfig) -> str | None:
    """The model file a version folder must hold; None when nothing is required or known."""
    if cfg.default_model_filename:
        return cfg.default_model_filename
    if cfg.platform in _PLATFORM_FILES:
        return _PLATFORM_FILES[cfg.platform]
    return _BACKEND_FILES.get(cfg.backend)


def _skipped(name: str) -> bool:
    return name.startswith(".") or os.sep in name or bool(os.altsep and os.altsep in name)


def _check_model(model_dir: Path) -> list[ConfigError]:
    versions = version_folders(model_dir)
    config_path = model_dir / DEFAULT_CONFIG_NAME
    has_onnx = any((v / ONNX_FILENAME).exists() for v in versions)

    if not config_path.is_file():
        # kiln writes the config itself for ONNX models (auto-complete); nothing else is guessable.
        if has_onnx:
            return []
        message = f"no {DEFAULT_CONFIG_NAME}, and no version folder holds {ONNX_FILENAME}"
        return [ConfigError(message, str(model_dir))]

    try:
        text = config_path.read_text(encoding="utf-8")
        cfg = parse_config_text(text, str(config_path))
    except ConfigError as exc:
        return [exc]
    except (OSError, UnicodeDecodeError) as exc:
        return [ConfigError(f"cannot read model configuration: {exc}", str(config_path))]

    problems = validate_config(cfg, model_dir.name, str(config_path), text)
    if not versions:
        problems.append(ConfigError("no numeric version folder (e.g. 1/)", str(model_dir)))
    problems.extend(_check_versions(cfg, model_dir, versions, str(config_path), text, has_onnx))
    return problems


def _check_versions(
    cfg: ModelConfig,
    model_dir: Path,
    versions: list[Path],
    config_path: str,
    text: str,
    has_onnx: bool,
) -> list[ConfigError]:
    problems: list[ConfigError] = []
    present = {int(v.name) for v in versions}
    if cfg.version_policy.HasField("specific"):
        for wanted in cfg.version_policy.specific.versions:
            if wanted not in present:
                message = (
                    f"version_policy lists version {wanted}, but {model_dir}/{wanted} is missing"
                )
                line = find_line(text, "versions")
                problems.append(ConfigError(message, config_path, line, field="version_policy"))

    filename = default_model_filename(cfg)
    if filename is None and not cfg.platform and not cfg.backend:
        # Auto-complete can only infer an ONNX model from its file.
        if not has_onnx:
            message = (
                f"neither platform nor backend is set, and no version folder holds {ONNX_FILENAME}"
            )
            problems.append(ConfigError(message, config_path, field="platform"))
            return problems
        filename = ONNX_FILENAME
    if filename is None:
        return problems
    for version in versions:
        # A model "file" may be a folder (TensorFlow SavedModel, ONNX with external data).
        if not (version / filename).exists():
            expected = version / filename
            problems.append(ConfigError(f"missing model file {filename}", str(expected)))
    return problems
