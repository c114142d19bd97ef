"""Queue policy of the dynamic batcher: priority levels, timeouts, queue sizes.

Built once at load time from ``dynamic_batching``; turns a request's ``priority`` and
``timeout`` parameters into the level it queues on and the deadline it carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.config.model_config_pb2 import ModelDynamicBatching, ModelQueuePolicy
from kiln.core.errors import invalid_arg


@dataclass(frozen=True, slots=True)
class LevelPolicy:
    """``ModelQueuePolicy`` of one priority level."""

    delay_on_timeout: bool = False  # timeout_action DELAY (else REJECT)
    default_timeout_ns: int = 0  # 0 = no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0 = unbounded

    @classmethod
    def from_config(cls, policy: ModelQueuePolicy) -> LevelPolicy:
        return cls(
            delay_on_timeout=policy.timeout_action == ModelQueuePolicy.DELAY,
            default_timeout_ns=policy.default_timeout_microseconds * 1000,
            allow_timeout_override=policy.allow_timeout_override,
            max_queue_size=policy.max_queue_size,
        )


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Every level's policy; level numbers are Triton's (1 = highest priority)."""

    model: str
    levels: tuple[LevelPolicy, ...]  # index 0 is level 1
    default_level: int
    priority_levels: int  # as configured; 0 = priorities not enabled

    @classmethod
    def from_config(cls, model: str, db: ModelDynamicBatching) -> QueuePolicy:
        default = LevelPolicy.from_config(db.default_queue_policy)
        count = max(db.priority_levels, 1)
        levels = tuple(
            LevelPolicy.from_config(db.priority_queue_policy[level])
            if level in db.priority_queue_policy
            else default
            for level in range(1, count + 1)
        )
        default_level = db.default_priority_level if db.priority_levels else 1
        return cls(model, levels, default_level, db.priority_levels)

    def level_of(self, parameters: dict[str, Any]) -> int:
        """The request's queue level: ``priority`` 0 (or absent) means the default level."""
        value = parameters.get("priority", 0)
        priority = _uint("priority", value, self.model)
        if priority == 0:
            return self.default_level
        if priority > self.priority_levels:
            allowed = (
                f"1..{self.priority_levels} (or 0 for the default level {self.default_level})"
                if self.priority_levels
                else "0: the model sets no dynamic_batching.priority_levels"
            )
            raise invalid_arg(
                f"priority {priority} is out of range for model '{self.model}'; allowed: {allowed}"
            )
        return priority

    def timeout_ns(self, level: int, parameters: dict[str, Any]) -> int:
        """How long the request may wait in the queue (and, where REJECT, run); 0 = forever.

        As in Triton, a request's own ``timeout`` (microseconds) counts only where the
        level's policy sets ``allow_timeout_override``, and then may only shorten the
        level's default: one client cannot loosen the operator's bound. Unlike Triton, it
        also applies when the default is 0 (none); Triton then ignores it.
        """
        policy = self.levels[level - 1]
        if policy.allow_timeout_override and "timeout" in parameters:
            requested = _uint("timeout", parameters["timeout"], self.model) * 1000
            if requested and (
                not policy.default_timeout_ns or requested < policy.default_timeout_ns
            ):
                return requested
        return policy.default_timeout_ns


def _uint(name: str, value: Any, model: str) -> int:
    # bool is an int in Python, but `true` is no priority a client meant to send.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid_arg(
            f"request parameter '{name}' for model '{model}' must be an unsigned integer, "
            f"got {value!r}"
        )
    return value
