"""A rollout's policy: the ``rollout_*`` fields of ``config.pbtxt`` ``parameters`` or of
``POST /v2/repository/models/{m}/rollout``, read and checked against the loaded versions
(``rollout.py`` runs it). Names: docs/rollouts.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, invalid_arg

PREFIX = "rollout_"
FIELDS = (
    "traffic_split",  # "1:90,2:10": version:weight, over the versions a request may get
    "sticky_key",  # "parameter:user_id": hash this request parameter instead of drawing
    "shadow",  # "3" or "3:0.5": version [: fraction of requests copied to it]
    "shadow_queue_size",  # copies waiting at most; more are dropped and counted
    "canary",  # "2": the version the steps move traffic to
    "primary",  # "1": the version the canary takes traffic from (default: newest other)
    "steps",  # "1,10,50,100": the canary's weight in percent, one step per interval
    "interval_secs",  # time between steps, and the guard's window
    "max_error_rate_delta",  # canary error rate - primary error rate above this: rollback
    "max_p99_ratio",  # canary p99 / primary p99 above this: rollback
    "min_requests",  # canary requests a window needs before a step or a verdict
)
GUARD_TICK_S = 0.25  # how often the guard looks (a rollback is "at once" within this)
#: bounds on what a policy may ask for: each queued shadow copy holds the request's inputs,
#: and a shorter interval than the guard's tick would only wake the event loop for nothing
MAX_SHADOW_QUEUE = 4096
MAX_STEPS = 100


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    split: tuple[tuple[int, float], ...] = ()
    sticky_parameter: str = ""
    shadow: int | None = None
    shadow_fraction: float = 1.0
    shadow_queue_size: int = 64
    canary: int | None = None
    primary: int | None = None
    steps: tuple[float, ...] = ()
    interval_secs: float = 60.0
    max_error_rate_delta: float | None = None
    max_p99_ratio: float | None = None
    min_requests: int = 20

    def to_json(self) -> dict[str, Any]:
        return {
            "traffic_split": ",".join(f"{v}:{_num(w)}" for v, w in self.split),
            "sticky_key": f"parameter:{self.sticky_parameter}" if self.sticky_parameter else "",
            "shadow": f"{self.shadow}:{_num(self.shadow_fraction)}" if self.shadow else "",
            "shadow_queue_size": self.shadow_queue_size,
            "canary": self.canary,
            "primary": self.primary,
            "steps": ",".join(_num(s) for s in self.steps),
            "interval_secs": self.interval_secs,
            "max_error_rate_delta": self.max_error_rate_delta,
            "max_p99_ratio": self.max_p99_ratio,
            "min_requests": self.min_requests,
        }


def _num(x: float) -> str:
    return f"{x:g}"


def config_fields(config: ModelConfig) -> dict[str, str]:
    """The ``rollout_*`` parameters of a config, without the prefix."""
    return {
        k[len(PREFIX) :]: p.string_value
        for k, p in config.parameters.items()
        if k.startswith(PREFIX)
    }


def parse_policy(model: str, fields: Mapping[str, Any], loaded: set[int]) -> RolloutPolicy | None:
    """The policy ``fields`` describe (None: no rollout), checked against the versions
    ``loaded``; a bad field raises INVALID_ARG naming the model and the field."""

    def bad(name: str, why: str) -> KilnError:
        return invalid_arg(f"model '{model}': rollout field '{name}' {why}")

    for k in fields:
        if k not in FIELDS:
            raise bad(k, f"is unknown (known: {', '.join(FIELDS)})")
    f = {k: str(v).strip() for k, v in fields.items() if v is not None and str(v).strip()}
    if not f:
        return None

    def version(name: str, text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise bad(name, f"names version '{text}', not an integer") from None
        if v not in loaded:
            raise bad(name, f"names version {v}, which is not loaded (loaded: {sorted(loaded)})")
        return v

    def number(name: str, default: float, low: float = 0.0) -> float:
        if name not in f:
            return default
        try:
            x = float(f[name])
        except ValueError:
            raise bad(name, f"must be a number, got '{f[name]}'") from None
        if not np.isfinite(x) or x < low:
            raise bad(name, f"must be a finite number >= {_num(low)}, got '{f[name]}'")
        return x

    split: list[tuple[int, float]] = []
    for part in filter(None, (p.strip() for p in f.get("traffic_split", "").split(","))):
        v, sep, w = part.partition(":")
        if not sep:
            raise bad("traffic_split", f"entry '{part}' is not version:weight")
        weight = number_of("traffic_split", w, bad)
        if weight < 0:
            raise bad("traffic_split", f"gives version {v.strip()} a negative weight {w}")
        split.append((version("traffic_split", v.strip()), weight))
    if len({v for v, _ in split}) != len(split):
        raise bad("traffic_split", "names a version twice")
    if split and sum(w for _, w in split) <= 0:
        raise bad("traffic_split", "weights must sum to a positive value")

    sticky = f.get("sticky_key", "")
    if sticky:
        kind, sep, key = sticky.partition(":")
        if kind != "parameter" or not sep or not key:
            raise bad("sticky_key", f"must be 'parameter:NAME', got '{sticky}'")
        sticky = key

    shadow: int | None = None
    fraction = 1.0
    if "shadow" in f:
        v, sep, frac = f["shadow"].partition(":")
        shadow = version("shadow", v.strip())
        if sep:
            fraction = number_of("shadow", frac, bad)
            if not 0 < fraction <= 1:
                raise bad("shadow", f"fraction must be in (0, 1], got '{frac}'")
    queue = int(number("shadow_queue_size", 64, 1))
    if queue > MAX_SHADOW_QUEUE:
        raise bad("shadow_queue_size", f"must be at most {MAX_SHADOW_QUEUE}, got {queue}")

    canary = version("canary", f["canary"]) if "canary" in f else None
    primary = version("primary", f["primary"]) if "primary" in f else None
    if primary is not None and (canary is None or primary == canary):
        raise bad("primary", "needs a 'canary' version other than itself")
    steps = tuple(
        number_of("steps", s, bad)
        for s in filter(None, map(str.strip, f.get("steps", "").split(",")))
    )
    if len(steps) > MAX_STEPS:
        raise bad("steps", f"holds {len(steps)} steps, at most {MAX_STEPS}")
    if any(not 0 <= s <= 100 for s in steps) or list(steps) != sorted(steps):
        raise bad("steps", f"must be rising percentages in [0, 100], got '{f.get('steps')}'")
    if steps and canary is None:
        raise bad("steps", "need a 'canary' version to move traffic to")
    if canary is not None and not steps:
        raise bad("canary", "needs 'steps'")
    if canary is not None and len(loaded) < 2:
        raise bad("canary", "needs another loaded version to be the primary")
    interval = number("interval_secs", 60.0)
    if interval <= 0:
        raise bad("interval_secs", "must be > 0")
    if interval < GUARD_TICK_S:
        raise bad("interval_secs", f"must be at least {GUARD_TICK_S} s (the guard's tick)")
    delta = number("max_error_rate_delta", 0.0) if "max_error_rate_delta" in f else None
    if delta is not None and delta > 1:
        raise bad("max_error_rate_delta", f"is a rate difference in [0, 1], got {delta:g}")
    ratio = number("max_p99_ratio", 0.0, low=0.0) if "max_p99_ratio" in f else None
    if ratio is not None and ratio <= 0:
        raise bad("max_p99_ratio", "must be > 0")
    if (delta is not None or ratio is not None) and canary is None:
        raise bad(
            "max_error_rate_delta" if delta is not None else "max_p99_ratio",
            "is a bound on a canary: set 'canary' and 'steps'",
        )
    if canary is not None and split:
        raise bad("traffic_split", "and 'canary' both set the weights: give one of them")
    return RolloutPolicy(
        split=tuple(split),
        sticky_parameter=sticky,
        shadow=shadow,
        shadow_fraction=fraction,
        shadow_queue_size=queue,
        canary=canary,
        primary=primary,
        steps=steps,
        interval_secs=interval,
        max_error_rate_delta=delta,
        max_p99_ratio=ratio,
        min_requests=int(number("min_requests", 20)),
    )


def number_of(name: str, text: str, bad: Callable[[str, str], KilnError]) -> float:
    try:
        x = float(text)
    except ValueError:
        raise bad(name, f"has '{text}', not a number") from None
    if not np.isfinite(x):
        raise bad(name, f"has '{text}', not a finite number")
    return x


def check_config(config: ModelConfig, versions: list[int]) -> None:
    """Load-time check of a config's rollout (the repository calls it before a load)."""
    parse_policy(config.name, config_fields(config), set(versions))


__all__ = [
    "FIELDS",
    "RolloutPolicy",
    "check_config",
    "parse_policy",
]
