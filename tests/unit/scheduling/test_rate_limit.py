"""The rate limiter (kiln/scheduling/rate_limit.py): resource pools per device and global,
their default sizes and overrides, priority turns, waiting without starvation, withdrawal,
and the gate in ``Instance``. Grants are observed as they happen; no duration is asserted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import Backend, InstanceSpec
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError
from kiln.core.stats import ModelStats, RequestTimes
from kiln.scheduling.base import Instance, Job
from kiln.scheduling.direct import DirectScheduler
from kiln.scheduling.rate_limit import CPU_DEVICE, RateLimiter, ResourceOverride


def config(name: str, resources: str, priority: int = 0, kind: str = "KIND_CPU") -> ModelConfig:
    text = f"""
    name: "{name}"
    instance_group [ {{ kind: {kind} count: 1
      rate_limiter {{ resources [ {resources} ] priority: {priority} }} }} ]
    """
    return text_format.Parse(text, ModelConfig())


def spec(name: str, kind: str = "cpu", device: int = 0) -> InstanceSpec:
    return InstanceSpec(f"{name}_0", kind, device, 0, 1)


def test_pools_default_to_the_most_any_instance_needs() -> None:
    limiter = RateLimiter()
    limiter.register(config("a", '{ name: "R1" count: 4 }, { name: "R2" count: 4 }'), spec("a"))
    limiter.register(config("b", '{ name: "R2" count: 5 }, { name: "R3" count: 10 }'), spec("b"))
    sizes = {name: limiter.capacity((name, CPU_DEVICE)) for name in ("R1", "R2", "R3")}
    assert sizes == {"R1": 4, "R2": 5, "R3": 10}


def test_an_execution_waits_for_copies_in_use_and_starts_on_release() -> None:
    limiter = RateLimiter()
    a = limiter.register(config("a", '{ name: "R" count: 1 }'), spec("a"))
    b = limiter.register(config("b", '{ name: "R" count: 1 }'), spec("b"))
    started: list[str] = []
    limiter.request(a, lambda: started.append("a"))
    limiter.request(b, lambda: started.append("b"))
    assert started == ["a"]  # one copy: b waits
    limiter.release(a)
    assert started == ["a", "b"]


def test_priority_two_gets_half_the_turns_of_priority_one() -> None:
    limiter = RateLimiter()
    fast = limiter.register(config("fast", '{ name: "R" count: 1 }', priority=1), spec("fast"))
    slow = limiter.register(config("slow", '{ name: "R" count: 1 }', priority=2), spec("slow"))
    order: list[str] = []
    for _ in range(30):  # both always waiting: every release hands the copy on by turn
        limiter.request(fast, lambda: order.append("fast"))
        limiter.request(slow, lambda: order.append("slow"))
    while len(order) < 30:
        last = order[-1]
        limiter.release(fast if last == "fast" else slow)
    assert order[:30].count("fast") == 20 and order[:30].count("slow") == 10


def test_copies_are_per_device_unless_global() -> None:
    limiter = RateLimiter()
    per_gpu = config("m", '{ name: "R" count: 1 }', kind="KIND_GPU")
    gpu0 = limiter.register(per_gpu, spec("m", "gpu", 0))
    gpu1 = limiter.register(per_gpu, spec("m", "gpu", 1))
    started: list[str] = []
    limiter.request(gpu0, lambda: started.append("gpu0"))
    limiter.request(gpu1, lambda: started.append("gpu1"))
    assert started == ["gpu0", "gpu1"]  # each GPU has its own copy
    shared = config("g", '{ name: "G" count: 1 global: true }', kind="KIND_GPU")
    g0 = limiter.register(shared, spec("g", "gpu", 0))
    g1 = limiter.register(shared, spec("g", "gpu", 1))
    limiter.request(g0, lambda: started.append("g0"))
    limiter.request(g1, lambda: started.append("g1"))
    assert started[2:] == ["g0"]  # one copy in the whole system
    limiter.release(g0)
    assert started[2:] == ["g0", "g1"]


def test_overrides_set_the_copies_and_refuse_an_instance_that_needs_more() -> None:
    limiter = RateLimiter([ResourceOverride.parse("R:3"), ResourceOverride.parse("R:1:1")])
    holders = [
        limiter.register(config(f"m{i}", '{ name: "R" count: 1 }'), spec(f"m{i}")) for i in range(4)
    ]
    started: list[int] = []
    for i, holder in enumerate(holders):
        limiter.request(holder, lambda i=i: started.append(i))
    assert started == [0, 1, 2]  # three copies on the CPU
    assert limiter.capacity(("R", 1)) == 1  # GPU 1's own count
    with pytest.raises(KilnError) as info:
        limiter.register(config("big", '{ name: "R" count: 5 }'), spec("big"))
    assert info.value.message == (
        "model 'big' instance big_0 #0 needs 5 of rate limiter resource 'R' (the CPU), but "
        "--rate-limit-resource gives 3"
    )


def test_a_waiting_large_execution_is_not_starved_and_others_go_ahead() -> None:
    limiter = RateLimiter([ResourceOverride.parse("R:2")])
    small = limiter.register(config("small", '{ name: "R" count: 1 }'), spec("small"))
    big = limiter.register(config("big", '{ name: "R" count: 2 }'), spec("big"))
    other = limiter.register(config("other", '{ name: "S" count: 1 }'), spec("other"))
    started: list[str] = []
    limiter.request(small, lambda: started.append("small"))
    limiter.request(big, lambda: started.append("big"))  # needs both copies: waits
    limiter.request(small, lambda: started.append("small again"))  # behind big, same pool
    limiter.request(other, lambda: started.append("other"))  # another resource: goes
    assert started == ["small", "other"]
    limiter.release(small)
    assert started == ["small", "other", "big"]
    limiter.release(big)
    assert started[-1] == "small again"


def test_a_withdrawn_request_holds_nobody_up() -> None:
    limiter = RateLimiter([ResourceOverride.parse("R:1")])
    a = limiter.register(config("a", '{ name: "R" count: 1 }'), spec("a"))
    b = limiter.register(config("b", '{ name: "R" count: 1 }'), spec("b"))
    started: list[str] = []
    limiter.request(a, lambda: started.append("a"))
    withdraw = limiter.request(b, lambda: started.append("b"))
    withdraw()
    limiter.request(a, lambda: started.append("a again"))
    limiter.release(a)
    assert started == ["a", "a again"]


@pytest.mark.parametrize("text", ["R", "R:x", ":1", "R:1:2:3", "R:-1", "R:1:-2"])
def test_a_malformed_resource_flag_says_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="expected NAME:COUNT or NAME:COUNT:DEVICE"):
        ResourceOverride.parse(text)


class Slow(Backend):
    name: ClassVar[str] = "slow"
    running: ClassVar[list[int]] = []
    most: ClassVar[list[int]] = [0]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        self.running.append(1)
        self.most[0] = max(self.most[0], len(self.running))
        time.sleep(0.05)
        self.running.pop()
        return {}


async def test_instances_sharing_one_copy_never_execute_at_once(tmp_path: Path) -> None:
    limiter = RateLimiter()
    instances = []
    for name in ("a", "b", "c"):
        cfg = config(name, '{ name: "R" count: 1 }')
        backend = Slow(cfg, tmp_path, spec(name))
        instances.append(Instance(backend, name, 0, (limiter, limiter.register(cfg, spec(name)))))
    await asyncio.gather(*(i.call(i.execute, {}, []) for i in instances for _ in range(2)))
    assert Slow.most == [1]
    free = Instance(Slow(config("f", ""), tmp_path, spec("f")), "f", 0,
                    (limiter, limiter.register(config("f", ""), spec("f"))))  # fmt: skip
    assert free.limit is None  # lists no resources: never held up
    for instance in (*instances, free):
        instance.close()
    assert limiter.capacity(("R", CPU_DEVICE)) == 0  # all unregistered


async def test_the_wait_for_resources_is_queue_time(tmp_path: Path) -> None:
    """As in Triton, a request leaves the queue when its instance may run it: the batch
    waiting for the rate limiter is still queued."""
    limiter = RateLimiter()
    cfg = config("m", '{ name: "R" count: 1 }')
    instance = Instance(
        Slow(cfg, tmp_path, spec("m")), "m", 0, (limiter, limiter.register(cfg, spec("m")))
    )
    other = limiter.register(config("o", '{ name: "R" count: 1 }'), spec("o"))
    limiter.request(other, lambda: None)  # another model holds the one copy
    scheduler = DirectScheduler([instance], ModelStats(), "m")
    job = Job({}, [], 1, RequestTimes())
    running = asyncio.ensure_future(scheduler.schedule(job))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not running.done()  # waiting for R
    released_at = time.monotonic_ns()
    limiter.release(other)
    await running
    assert job.times.queue_end >= released_at  # left the queue when R was granted
    assert job.times.input_end >= job.times.queue_end
    await scheduler.close()
