"""Triton's rate limiter (``--rate-limit=execution_count``): instances of every model take
turns on shared resources.

An instance group may say what one execution of its instances needs
(``rate_limiter { resources [ { name: "R1" count: 2 } ] priority: 1 }``). With the rate
limiter on, a batch starts only once those copies are free, holds them while it runs and
gives them back when it ends. Copies are per device (each GPU, and the CPU) unless the
resource is ``global: true``; how many a device has is the largest count any loaded
instance asks for (so each can run alone), unless ``--rate-limit-resource
NAME:COUNT[:DEVICE]`` says. Waiting batches are served by priority: an instance of
priority 2 gets half the turns of one of priority 1 (stride scheduling: each turn adds
the priority to the instance's pass, and the lowest pass goes next), oldest first among
equals. A batch that does not fit waits, and so do the ones behind it that need any of the
same resources, so a large one is never starved by small ones; instances that list no
resources are not held up. Without the rate limiter (the default, ``off``) none of this
runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from kiln.backends.base import InstanceSpec
from kiln.config.model_config_pb2 import ModelConfig, ModelInstanceGroup
from kiln.core.errors import KilnError, Status

CPU_DEVICE = -1  # the key of the CPU's copies

# (resource, device or None for a global one)
PoolKey = tuple[str, int | None]


@dataclass(frozen=True, slots=True)
class ResourceOverride:
    """One ``--rate-limit-resource``: ``device`` None applies to every device."""

    name: str
    count: int
    device: int | None = None

    @classmethod
    def parse(cls, text: str) -> ResourceOverride:
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3) or not parts[0]:
                raise ValueError
            count = int(parts[1])
            device = int(parts[2]) if len(parts) == 3 else None
            if count < 0 or (device is not None and device < 0):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"--rate-limit-resource '{text}': expected NAME:COUNT or NAME:COUNT:DEVICE "
                "(COUNT and DEVICE non-negative integers)"
            ) from None
        return cls(parts[0], count, device)


@dataclass(eq=False, slots=True)
class Holder:
    """One instance's place at the rate limiter: what an execution needs, and its turn."""

    label: str  # "model 'm' instance m_0 #1", for messages
    needs: dict[PoolKey, int]
    priority: int
    pass_: float = 0.0


@dataclass(eq=False, slots=True)
class _Waiter:
    holder: Holder
    go: Callable[[], None]
    order: int
    granted: bool = False
    withdrawn: bool = False


@dataclass(slots=True)
class RateLimiter:
    overrides: list[ResourceOverride] = field(default_factory=list)
    _holders: list[Holder] = field(default_factory=list)
    _free: dict[PoolKey, int] = field(default_factory=dict)
    _size: dict[PoolKey, int] = field(default_factory=dict)
    _waiting: list[_Waiter] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    # ---- instances come and go -----------------------------------------------------------
    def register(self, config: ModelConfig, spec: InstanceSpec) -> Holder:
        """The instance's holder; ``KilnError`` when ``--rate-limit-resource`` gives fewer
        copies than one execution needs."""
        group = _group_of(config, spec)
        device = spec.device_id if spec.kind == "gpu" else CPU_DEVICE
        needs: dict[PoolKey, int] = {}
        priority = 1
        if group is not None and group.HasField("rate_limiter"):
            limiter = group.rate_limiter
            priority = max(limiter.priority, 1)
            for resource in limiter.resources:
                shared = getattr(resource, "global")  # a Python keyword as a field name
                key: PoolKey = (resource.name, None if shared else device)
                needs[key] = needs.get(key, 0) + resource.count
        label = f"model '{config.name}' instance {spec.name} #{spec.index}"
        holder = Holder(label, needs, priority, self._lowest_pass())
        for key, count in needs.items():
            given = self._override(key)
            if given is not None and count > given:
                where = "global" if key[1] is None else _device_name(key[1])
                raise KilnError(
                    f"{label} needs {count} of rate limiter resource '{key[0]}' ({where}), but "
                    f"--rate-limit-resource gives {given}",
                    Status.INVALID_ARG,
                )
        self._holders.append(holder)
        self._resize()
        return holder

    def unregister(self, holder: Holder) -> None:
        if holder in self._holders:
            self._holders.remove(holder)
            self._resize()

    def capacity(self, key: PoolKey) -> int:
        """How many copies of a resource a device (or the system) has now."""
        given = self._override(key)
        if given is not None:
            return given
        return max((h.needs.get(key, 0) for h in self._holders), default=0)

    # ---- executions ------------------------------------------------------------------------
    def request(self, holder: Holder, go: Callable[[], None]) -> Callable[[], None]:
        """Call ``go`` (on the loop) once ``holder``'s resources are free, now if they are;
        returns a function that withdraws the request if ``go`` has not run yet."""
        waiter = _Waiter(holder, go, next(self._order))
        self._waiting.append(waiter)
        self._grant()

        def withdraw() -> None:
            if not waiter.granted and not waiter.withdrawn:
                waiter.withdrawn = True
                self._waiting.remove(waiter)
                self._grant()  # it may have held up the ones behind it

        return withdraw

    def release(self, holder: Holder) -> None:
        """An execution of ``holder``'s ended: its copies are free again."""
        for key, count in holder.needs.items():
            self._free[key] = self._free.get(key, 0) + count
        self._grant()

    def _grant(self) -> None:
        """Start every waiting execution that may, in turn. One that does not fit keeps
        the resources it waits for from those behind it (so it is not starved); those
        needing other resources go ahead."""
        blocked: set[PoolKey] = set()
        for waiter in sorted(self._waiting, key=lambda w: (w.holder.pass_, w.order)):
            needs = waiter.holder.needs
            if blocked.intersection(needs) or any(
                self._free.get(key, 0) < count for key, count in needs.items()
            ):
                blocked.update(needs)
                continue
            for key, count in needs.items():
                self._free[key] -= count
            self._waiting.remove(waiter)
            waiter.granted = True
            waiter.holder.pass_ += waiter.holder.priority
            waiter.go()

    # ---- bookkeeping -----------------------------------------------------------------------
    def _resize(self) -> None:
        """Every pool's size follows the loaded instances (and the overrides); copies in
        use by running executions stay in use."""
        for key in {key for h in self._holders for key in h.needs} | set(self._size):
            size = self.capacity(key)
            self._free[key] = self._free.get(key, 0) + size - self._size.get(key, 0)
            self._size[key] = size
        self._grant()

    def _override(self, key: PoolKey) -> int | None:
        name, device = key
        match = [o for o in self.overrides if o.name == name]
        exact = [o for o in match if o.device is not None and o.device == device]
        if exact:
            return exact[-1].count
        general = [o for o in match if o.device is None]
        return general[-1].count if general else None

    def _lowest_pass(self) -> float:
        return min((h.pass_ for h in self._holders), default=0.0)


def _group_of(config: ModelConfig, spec: InstanceSpec) -> ModelInstanceGroup | None:
    for index, group in enumerate(config.instance_group):
        if (group.name or f"{config.name}_{index}") == spec.name:
            return cast("ModelInstanceGroup", group)
    return None


def _device_name(device: int) -> str:
    return "the CPU" if device == CPU_DEVICE else f"GPU {device}"
