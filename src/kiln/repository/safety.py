"""Path safety of loads: model names, model folders and config fields stay in the repository.

A load request can name a model and override its config; neither may make kiln read a file
outside the model repository (path traversal, absolute paths, symlinks pointing out).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import invalid_arg

# A positive allowlist: anything else (separators, NUL, unicode look-alikes, spaces) is
# refused before the name touches the file system.
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}")


def check_model_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise invalid_arg(
            f"invalid model name '{name}': a model name is one folder of the repository: "
            "1-255 characters from [A-Za-z0-9_.-], not starting with '.'"
        )


def check_tree_inside(folder: Path, root: Path, model: str) -> None:
    """Every symlink under ``folder`` (the folder itself included) resolves inside ``root``.

    Walks without following links, so a link to a huge or looping tree costs one check.
    """
    root = root.resolve()

    def refuse(path: Path) -> None:
        rel = path.relative_to(folder.parent) if path.is_relative_to(folder.parent) else path
        raise invalid_arg(
            f"model '{model}': '{rel}' is a symlink that resolves outside the model repository"
        )

    if not folder.resolve().is_relative_to(root):
        refuse(folder)
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        base = Path(dirpath)
        for entry in (*dirnames, *filenames):
            path = base / entry
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                refuse(path)


def _relative_file_ok(value: str) -> bool:
    if not value:
        return True
    for flavour in (PurePosixPath(value), PureWindowsPath(value)):
        if flavour.is_absolute() or flavour.drive or ".." in flavour.parts:
            return False
    return "\x00" not in value


def check_config_paths(config: ModelConfig, model: str) -> None:
    """Config fields naming files must name files inside the model folder."""
    fields: list[tuple[str, str]] = [("default_model_filename", config.default_model_filename)]
    fields += [(f"cc_model_filenames['{k}']", v) for k, v in config.cc_model_filenames.items()]
    fields += [(f"output '{o.name}' label_filename", o.label_filename) for o in config.output]
    for w in config.model_warmup:
        for name, inp in w.inputs.items():
            fields.append(
                (f"model_warmup '{w.name}' input '{name}' input_data_file", inp.input_data_file)
            )
    if config.HasField("sequence_batching"):
        for state in config.sequence_batching.state:
            for init in state.initial_state:
                if init.WhichOneof("state_data") == "data_file":
                    fields.append(
                        (f"state '{state.input_name}' initial_state data_file", init.data_file)
                    )
    for field_name, value in fields:
        if not _relative_file_ok(value):
            raise invalid_arg(
                f"model '{model}': config field {field_name} '{value}' must be a relative path "
                "inside the model folder (no '..', no absolute path)"
            )
