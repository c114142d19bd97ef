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
from kiln.core.errors import KilnError, Status, invalid_arg
from kiln.core.types import InferenceRequest, InferenceResponse, InferInput

log = logging.getLogger(__name__)

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
# Statuses that are the caller's fault: they say nothing about a version's health.
CLIENT_STATUSES = (Status.INVALID_ARG, Status.NOT_FOUND, Status.ALREADY_EXISTS)
_GUARD_TICK_S = 0.25  # how often the guard looks (a rollback is "at once" within this)
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
    if interval < _GUARD_TICK_S:
        raise bad("interval_secs", f"must be at least {_GUARD_TICK_S} s (the guard's tick)")
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


@dataclass(slots=True)
class ShadowStats:
    sent: int = 0
    dropped: int = 0
    errors: int = 0
    compared: int = 0
    exact: int = 0
    top1: int = 0
    top1_compared: int = 0
    max_abs_diff: float = 0.0  # the largest seen
    latency_delta_sum: float = 0.0  # shadow - primary, seconds
    # LLM generations: output positions compared, and those holding the same token
    token_positions: int = 0
    token_agree: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "dropped": self.dropped,
            "errors": self.errors,
            "compared": self.compared,
            "exact_agreement": self.exact / self.compared if self.compared else None,
            "top1_agreement": self.top1 / self.top1_compared if self.top1_compared else None,
            "max_abs_diff": self.max_abs_diff,
            "token_agreement": (
                self.token_agree / self.token_positions if self.token_positions else None
            ),
            "mean_latency_delta_s": (
                self.latency_delta_sum / self.compared if self.compared else None
            ),
        }


Infer = Callable[[InferenceRequest], Awaitable[InferenceResponse]]
#: an LLM model version's generation for a shadow copy: (model, version, prompt token ids,
#: sampling params) -> each sample's output token ids; injected by the server
LLMGenerate = Callable[[str, int, list[int], Any], Awaitable[dict[int, list[int]]]]


@dataclass(frozen=True, slots=True)
class LLMShadowJob:
    """A generation to repeat on the shadow version, and what the primary produced."""

    prompt: list[int]
    params: Any  # kiln.llm.sequence.SamplingParams (the llm layer sits beside this one)
    tokens: dict[int, list[int]]  # each sample's output token ids
    secs: float


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
            await asyncio.sleep(min(_GUARD_TICK_S, self.policy.interval_secs))
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
            _compare(primary, answer, stats)

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


def _compare(primary: InferenceResponse, shadow: InferenceResponse, stats: ShadowStats) -> None:
    """Exact agreement (every output equal), top-1 (argmax of the last axis, numeric
    outputs) and the largest absolute difference."""
    theirs = {o.name: o.data for o in shadow.outputs}
    exact = set(theirs) == {o.name for o in primary.outputs}
    top1: bool | None = None
    for out in primary.outputs:
        other = theirs.get(out.name)
        if other is None or other.shape != out.data.shape:
            exact = False
            continue
        if out.data.dtype.kind in "biuf" and other.dtype.kind in "biuf":
            a, b = out.data.astype(np.float64), other.astype(np.float64)
            diff = float(np.max(np.abs(a - b))) if a.size else 0.0
            stats.max_abs_diff = max(stats.max_abs_diff, diff)
            exact = exact and diff == 0
            if a.ndim and a.shape[-1] > 1:
                same = bool(np.array_equal(a.argmax(axis=-1), b.argmax(axis=-1)))
                top1 = same if top1 is None else top1 and same
        else:
            exact = exact and bool(np.array_equal(out.data, other))
    stats.exact += exact
    if top1 is not None:
        stats.top1_compared += 1
        stats.top1 += top1


def compare_tokens(
    primary: dict[int, list[int]], shadow: dict[int, list[int]], stats: ShadowStats
) -> None:
    """Exact agreement (every sample's tokens equal) and token agreement: positions, up
    to the longer of the two outputs, that hold the same token (meaningful for greedy or
    seeded requests; a sampled request's copy draws its own tokens)."""
    exact = set(primary) == set(shadow)
    for index, ours in primary.items():
        theirs = shadow.get(index, [])
        same = sum(1 for a, b in zip(ours, theirs, strict=False) if a == b)
        stats.token_positions += max(len(ours), len(theirs))
        stats.token_agree += same
        exact = exact and ours == theirs
    stats.exact += exact


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


def check_config(config: ModelConfig, versions: list[int]) -> None:
    """Load-time check of a config's rollout (the repository calls it before a load)."""
    parse_policy(config.name, config_fields(config), set(versions))


__all__ = [
    "FIELDS",
    "LLMShadowJob",
    "ModelRollout",
    "RolloutPolicy",
    "Rollouts",
    "check_config",
    "compare_tokens",
    "parse_policy",
    "sticky_point",
]
