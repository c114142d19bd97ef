"""Rollouts between the versions of one model: weighted split, shadow copies, a guarded canary.

A request that names no version is routed here (``Server._runtime``): the model's policy
picks one of its loaded versions by weight, or by a stable hash of a sticky key (a request
parameter) so one user stays on one variant. A shadow version gets a copy of a sampled
fraction of requests on a bounded queue; its answer is compared with the caller's and then
dropped. A canary policy steps the canary's weight up on a schedule while its error rate and
p99 stay within bounds of the primary's, and sets it to 0 at once when they do not.

The policy comes from ``config.pbtxt`` ``parameters`` (``rollout_*`` keys) and is replaced at
run time by ``POST /v2/repository/models/{m}/rollout``; a reload of the model takes its
config's policy again. Names: docs/rollouts.md.

Here: the policies at work (:class:`Rollouts`, :class:`ModelRollout`). The policy's fields
are read in ``rollout_policy``; the shadow's agreement is counted in ``rollout_shadow``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.core.types import InferenceRequest, InferenceResponse, InferInput
from kiln.server.rollout_policy import GUARD_TICK_S, RolloutPolicy, config_fields, parse_policy
from kiln.server.rollout_shadow import LLMShadowJob, ShadowStats, compare_outputs, compare_tokens

log = logging.getLogger(__name__)

# Statuses that are the caller's fault: they say nothing about a version's health.
CLIENT_STATUSES = (Status.INVALID_ARG, Status.NOT_FOUND, Status.ALREADY_EXISTS)


def _draw(point: float, table: list[tuple[int, float]], total: float) -> int | None:
    """The version at ``point`` (in [0, 1)) of the weights' cumulative range."""
    target = point * total
    for v, w in table:
        target -= w
        if target < 0:
            return v
    return table[-1][0] if table else None


def sticky_point(key: str) -> float:
    """A stable point in [0, 1) for ``key``: the same on every process and run (Python's
    ``hash`` is salted per process)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(slots=True)
class _Window:
    """The guard's recent outcomes of one version: (monotonic time, seconds, ok)."""

    samples: deque[tuple[float, float, bool]] = field(default_factory=deque)

    def add(self, t: float, secs: float, ok: bool) -> None:
        self.samples.append((t, secs, ok))

    def since(self, start: float) -> tuple[int, float, float]:
        """(requests, error rate, p99 seconds) of the samples after ``start``."""
        while self.samples and self.samples[0][0] < start:
            self.samples.popleft()
        n = len(self.samples)
        if not n:
            return 0, 0.0, 0.0
        errors = sum(1 for _, _, ok in self.samples if not ok)
        p99 = float(np.percentile([s for _, s, _ in self.samples], 99))
        return n, errors / n, p99


Infer = Callable[[InferenceRequest], Awaitable[InferenceResponse]]
#: an LLM model version's generation for a shadow copy: (model, version, prompt token ids,
#: sampling params) -> each sample's output token ids; injected by the server
LLMGenerate = Callable[[str, int, list[int], Any], Awaitable[dict[int, list[int]]]]


# (model, version) -> the name of an alert rule firing for it, or None: kiln's alert
# evaluator, injected by ``kiln serve`` (the metrics layer sits above the server)
AlertCheck = Callable[[str, int], "str | None"]


class ModelRollout:
    """One model's policy and its live state (weights, guard, shadow queue)."""

    def __init__(
        self,
        model: str,
        policy: RolloutPolicy,
        source: str,
        rng: random.Random,
        alert_firing: AlertCheck | None = None,
    ) -> None:
        self.model = model
        self.alert_firing = alert_firing
        self.policy = policy
        self.source = source  # "config" or "api"
        self.rng = rng
        self.step_index = 0
        self.state = "stepping" if policy.canary is not None else "static"
        self.steps_total: dict[str, int] = {"promoted": 0, "step": 0, "rollback": 0}
        self.events: deque[dict[str, Any]] = deque(maxlen=20)
        self.windows: dict[int, _Window] = {}
        self.shadow_stats = ShadowStats()
        self._queue: (
            asyncio.Queue[tuple[InferenceRequest, InferenceResponse, float] | LLMShadowJob] | None
        ) = None
        #: runs an LLM shadow copy (``Rollouts.llm_generate``)
        self.llm_generate: LLMGenerate | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._weights: dict[int, float] = {}
        self._table: list[tuple[int, float]] = []
        self._total = 0.0
        self._primary: int | None = None
        self._canary_weight = policy.steps[0] if policy.steps else 0.0

    # ---- weights ---------------------------------------------------------------------
    def set_versions(self, versions: list[int]) -> None:
        """The loaded versions (a canary's primary is the newest other one)."""
        p = self.policy
        if p.split:
            self.weights = {v: w for v, w in p.split}
        elif p.canary is not None:
            others = [v for v in versions if v != p.canary]
            self._primary = p.primary if p.primary is not None else max(others, default=None)
            self._set_canary(self._canary_weight)
        else:
            self.weights = {}

    def _set_canary(self, percent: float) -> None:
        self._canary_weight = percent
        assert self.policy.canary is not None
        weights = {self.policy.canary: percent}
        if self._primary is not None:
            weights[self._primary] = 100.0 - percent
        self.weights = weights  # one assignment: the draw's table follows

    def pick(self, parameters: Mapping[str, Any], ready: Callable[[int], bool]) -> int | None:
        """The version for a request that names none (None: no split, latest as before)."""
        sticky = self.policy.sticky_parameter
        key = parameters.get(sticky) if sticky else None
        point = sticky_point(str(key)) if key is not None else self.rng.random()
        chosen = _draw(point, self._table, self._total)
        if chosen is None or ready(chosen):
            return chosen
        # a version not ready (loading, unloading): the same point over the ready ones
        live = [(v, w) for v, w in self._table if ready(v)]
        return _draw(point, live, sum(w for _, w in live))

    @property
    def weights(self) -> dict[int, float]:
        return self._weights

    @weights.setter
    def weights(self, weights: dict[int, float]) -> None:
        # the draw's table, built once per change rather than per request
        self._weights = weights
        self._table = [(v, w) for v, w in weights.items() if w > 0]
        self._total = sum(w for _, w in self._table)

    # ---- guard -----------------------------------------------------------------------
    @property
    def guarded(self) -> bool:
        return self.state == "stepping"

    def record(self, version: int, secs: float, ok: bool) -> None:
        self.windows.setdefault(version, _Window()).add(time.monotonic(), secs, ok)

    def evaluate(self, now: float, last_step: float) -> str:
        """One look of the guard: "rollback", "step", "promoted" or "" (wait)."""
        p = self.policy
        assert p.canary is not None
        start = now - p.interval_secs
        n_c, err_c, p99_c = self.windows.setdefault(p.canary, _Window()).since(start)
        n_p, err_p, p99_p = (
            self.windows.setdefault(self._primary, _Window()).since(start)
            if self._primary is not None
            else (0, 0.0, 0.0)
        )
        alert = self.alert_firing(self.model, p.canary) if self.alert_firing else None
        if alert is not None:
            return self._rollback(f"alert '{alert}' is firing for version {p.canary}")
        if n_c >= p.min_requests:
            if p.max_error_rate_delta is not None and err_c - err_p > p.max_error_rate_delta:
                return self._rollback(
                    f"canary error rate {err_c:.3f} exceeds the primary's {err_p:.3f} by "
                    f"more than {p.max_error_rate_delta:g}"
                )
            if (
                p.max_p99_ratio is not None
                and n_p
                and p99_p > 0
                and p99_c / p99_p > p.max_p99_ratio
            ):
                return self._rollback(
                    f"canary p99 {p99_c * 1e3:.1f} ms is over {p.max_p99_ratio:g}x the "
                    f"primary's {p99_p * 1e3:.1f} ms"
                )
        if now - last_step < p.interval_secs or n_c < p.min_requests:
            return ""
        self.step_index += 1
        if self.step_index >= len(p.steps) or p.steps[self.step_index] >= 100:
            self.state = "promoted"
            self._set_canary(100.0)
            return self._event("promoted", f"canary {p.canary} takes all traffic")
        self._set_canary(p.steps[self.step_index])
        return self._event("step", f"canary {p.canary} weight {p.steps[self.step_index]:g}%")

    def _rollback(self, why: str) -> str:
        self.state = "rolled_back"
        self._set_canary(0.0)
        log.warning("rollout of model '%s' rolled back: %s", self.model, why)
        return self._event("rollback", why)

    def _event(self, result: str, message: str) -> str:
        self.steps_total[result] += 1
        self.events.append({"ts": time.time(), "result": result, "message": message})
        log.info("rollout of model '%s': %s: %s", self.model, result, message)
        return result

    async def _guard(self) -> None:
        last_step = time.monotonic()
        while self.guarded:
            await asyncio.sleep(min(GUARD_TICK_S, self.policy.interval_secs))
            now = time.monotonic()
            if self.evaluate(now, last_step) == "step":
                last_step = now

    # ---- shadow ----------------------------------------------------------------------
    def offer_shadow(
        self, request: InferenceRequest, served: int, response: InferenceResponse, secs: float
    ) -> None:
        """Queue a copy of ``request`` for the shadow version (never waits; full: dropped)."""
        p = self.policy
        if p.shadow is None or served == p.shadow or self._queue is None:
            return
        if p.shadow_fraction < 1 and self.rng.random() >= p.shadow_fraction:
            return
        if "sequence_id" in request.parameters:
            return  # a stateful sequence's state lives in the primary's instance
        if self._queue.full():
            self.shadow_stats.dropped += 1
            return
        # The inputs may be views of the caller's buffers (shared memory): copied now.
        copy = replace(
            request,
            model_version=str(p.shadow),
            inputs=[
                InferInput(i.name, i.datatype, i.shape, np.array(i.data, copy=True), i.parameters)
                for i in request.inputs
            ],
        )
        # the outputs as computed: the server replaces the list later (classification)
        self._queue.put_nowait((copy, replace(response, outputs=list(response.outputs)), secs))

    def offer_llm_shadow(
        self,
        served: int,
        prompt: list[int],
        params: Any,
        tokens: dict[int, list[int]],
        secs: float,
    ) -> None:
        """Queue a generation of version ``served`` (finished, ``tokens`` its samples'
        outputs) to be repeated on the shadow version; never waits, full: dropped."""
        p = self.policy
        if p.shadow is None or served == p.shadow or self._queue is None:
            return
        if p.shadow_fraction < 1 and self.rng.random() >= p.shadow_fraction:
            return
        if self._queue.full():
            self.shadow_stats.dropped += 1
            return
        self._queue.put_nowait(LLMShadowJob(prompt, params, tokens, secs))

    async def _llm_shadow(self, job: LLMShadowJob) -> None:
        stats = self.shadow_stats
        stats.sent += 1
        t0 = time.perf_counter()
        try:
            if self.llm_generate is None or self.policy.shadow is None:
                raise RuntimeError("no LLM generation for shadow copies")
            theirs = await self.llm_generate(self.model, self.policy.shadow, job.prompt, job.params)
        except Exception as exc:  # the shadow's failure is counted, never raised
            stats.errors += 1
            log.debug("LLM shadow of model '%s' failed: %s", self.model, exc)
            return
        stats.compared += 1
        stats.latency_delta_sum += time.perf_counter() - t0 - job.secs
        compare_tokens(job.tokens, theirs, stats)

    async def _shadow_worker(self, infer: Infer) -> None:
        assert self._queue is not None
        stats = self.shadow_stats
        while True:
            item = await self._queue.get()
            if isinstance(item, LLMShadowJob):
                await self._llm_shadow(item)
                continue
            request, primary, primary_secs = item
            stats.sent += 1
            t0 = time.perf_counter()
            try:
                answer = await infer(request)
            except Exception as exc:  # the shadow's failure is counted, never raised
                stats.errors += 1
                log.debug("shadow of model '%s' failed: %s", self.model, exc)
                continue
            secs = time.perf_counter() - t0
            stats.compared += 1
            stats.latency_delta_sum += secs - primary_secs
            compare_outputs(primary, answer, stats)

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, infer: Infer) -> None:
        if self.policy.shadow is not None:
            self._queue = asyncio.Queue(self.policy.shadow_queue_size)
            for _ in range(1):  # one copy at a time: a shadow never takes more than one slot
                self._tasks.append(asyncio.ensure_future(self._shadow_worker(infer)))
        if self.guarded:
            self._tasks.append(asyncio.ensure_future(self._guard()))

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._queue = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "state": self.state,
            "policy": self.policy.to_json(),
            "weights": {str(v): w for v, w in sorted(self.weights.items())},
            "steps_total": dict(self.steps_total),
            "events": list(self.events),
            "shadow": self.shadow_stats.to_json() if self.policy.shadow is not None else None,
            "shadow_queue": self._queue.qsize() if self._queue is not None else 0,
        }


class Rollouts:
    """Every model's rollout; the server asks it which version a request gets."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        self.models: dict[str, ModelRollout] = {}
        self.alert_firing: AlertCheck | None = None
        #: repeats an LLM generation on a shadow version (the server's)
        self.llm_generate: LLMGenerate | None = None
        # the config each model's policy was read from: a reload brings its own policy
        self._configs: dict[str, ModelConfig] = {}

    def sync(
        self, model: str, config: ModelConfig | None, versions: Mapping[int, Any], infer: Infer
    ) -> ModelRollout | None:
        """The model's rollout as of its current config (read again after a reload)."""
        if config is None:
            return self.models.get(model)
        if self._configs.get(model) is config:
            return self.models.get(model)
        self._configs[model] = config
        try:
            policy = parse_policy(model, config_fields(config), set(versions))
        except KilnError as exc:  # checked at load: only a race with a version change
            log.error("%s", exc)
            policy = None
        return self._install(model, policy, "config", list(versions), infer)

    def set_policy(
        self, model: str, fields: Mapping[str, Any], versions: list[int], infer: Infer
    ) -> ModelRollout | None:
        """Replace the policy from the repository API; a bad one raises and changes nothing."""
        policy = parse_policy(model, fields, set(versions))
        return self._install(model, policy, "api", versions, infer)

    def _install(
        self,
        model: str,
        policy: RolloutPolicy | None,
        source: str,
        versions: list[int],
        infer: Infer,
    ) -> ModelRollout | None:
        old = self.models.pop(model, None)
        if old is not None:
            old.stop()
        if policy is None:
            return None
        # through _alert: a checker installed later (kiln serve starts monitoring after
        # the server) still reaches the rollouts made before it
        rollout = ModelRollout(model, policy, source, self.rng, self._alert)
        rollout.set_versions(versions)
        rollout.llm_generate = self.llm_generate
        rollout.start(infer)
        self.models[model] = rollout
        log.info("rollout of model '%s' (%s): %s", model, source, policy.to_json())
        return rollout

    def _alert(self, model: str, version: int) -> str | None:
        return self.alert_firing(model, version) if self.alert_firing is not None else None

    def drop(self, model: str) -> None:
        self._configs.pop(model, None)
        old = self.models.pop(model, None)
        if old is not None:
            old.stop()

    def stop(self) -> None:
        for model in list(self.models):
            self.drop(model)

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for _, r in sorted(self.models.items())]


__all__ = [
    "CLIENT_STATUSES",
    "ModelRollout",
    "Rollouts",
    "sticky_point",
]
