"""How config tensors bind to a PyTorch model's arguments and results (no torch import).

Triton's PyTorch backend rules, applied to inputs and outputs separately:

- **by name** (inputs only): every config input is named like an argument of ``forward``;
  the tensors are passed in ``forward``'s argument order.
- **``<name>__<index>``**: every config tensor ends in ``__`` and a number (``INPUT__0``,
  ``OUTPUT__1``); the number is the argument's / the result's position.
- **config order**: otherwise the tensors bind in the order the config lists them.

A model that returns a ``dict`` of tensors has its outputs picked by key instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.core.errors import KilnError, Status

_INDEXED = re.compile(r"^(.+)__(\d+)$")


@dataclass(frozen=True, slots=True)
class Binding:
    """Config tensor names in positional order, and the rule that put them there."""

    names: tuple[str, ...]
    convention: str  # "forward argument" | "<name>__<index>" | "config order"


def bind_inputs(model: str, config_names: list[str], arg_names: list[str] | None) -> Binding:
    """Order config inputs as the model's positional arguments.

    ``arg_names`` are ``forward``'s parameters without ``self`` (None: unknown).
    """
    if arg_names is not None and config_names and set(config_names) <= set(arg_names):
        missing = [a for a in arg_names if a not in config_names]
        if missing:
            raise KilnError(
                f"model '{model}': forward() takes {', '.join(arg_names)}, but the config "
                f"declares no input for {', '.join(repr(a) for a in missing)}",
                Status.INVALID_ARG,
            )
        return Binding(tuple(arg_names), "forward argument")
    binding = _by_index(model, "input", config_names)
    if arg_names is not None and len(binding.names) != len(arg_names):
        raise KilnError(
            f"model '{model}': forward() takes {len(arg_names)} argument(s) "
            f"({', '.join(arg_names)}), but the config declares {len(binding.names)} input(s) "
            f"bound by {binding.convention} ({', '.join(binding.names)})",
            Status.INVALID_ARG,
        )
    return binding


def bind_outputs(model: str, config_names: list[str]) -> Binding:
    """Order config outputs as the positions of the model's result tuple."""
    return _by_index(model, "output", config_names)


def _by_index(model: str, kind: str, names: list[str]) -> Binding:
    matches = [_INDEXED.match(n) for n in names]
    if not names or not all(matches):
        return Binding(tuple(names), "config order")
    slots: dict[int, str] = {}
    for name, match in zip(names, matches, strict=True):
        assert match is not None  # all() above
        index = int(match.group(2))
        if index in slots:
            raise KilnError(
                f"model '{model}': {kind}s '{slots[index]}' and '{name}' both claim position "
                f"{index} (the <name>__<index> naming convention)",
                Status.INVALID_ARG,
            )
        slots[index] = name
    if sorted(slots) != list(range(len(names))):
        raise KilnError(
            f"model '{model}': {kind} names {', '.join(names)} follow the <name>__<index> "
            f"convention but their indices are not 0..{len(names) - 1}",
            Status.INVALID_ARG,
        )
    return Binding(tuple(slots[i] for i in range(len(names))), "<name>__<index>")
