"""vLLM's development / RL control of an engine (``VLLM_SERVER_DEV_MODE``): pause and
resume, sleep and wake, prefix-cache reset, abort. The state machine of vLLM's
``EngineCore.pause_scheduler`` / ``sleep`` / ``wake_up``, run on the thread that steps the
engine (the server's engine thread, or the engine process's loop), between two steps.

- **Pause** ``abort``: every request in the engine ends now, finish reason ``abort``;
  ``wait``: the requests in the engine run to their end and the pause completes then;
  ``keep``: the requests stay where they are (their KV cache too) and go on at the resume.
  While paused, new requests are held, in order, and join the engine at the resume.
- **Sleep** level 0 pauses; levels 1 and 2 pause, then release the KV cache (and level 2
  the weights: ``runner_sleep``). Requests that arrive meanwhile are held, as vLLM's are,
  and run once the engine is fully awake. A request kept through a sleep (``mode=keep``)
  is recomputed after the wake (its KV cache went with the sleep).
- **Wake** ``tags``: ``weights``, ``kv_cache`` (one at a time, as vLLM's), ``scheduling``
  (level 0); none: everything. Scheduling resumes once nothing is asleep.

Operations come one at a time (the frontend serializes them); ``PENDING`` answers an
operation that completes later (a ``wait`` pause), reported by ``poll``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.llm import runner_sleep
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.model_runner import ModelRunner
from kiln.llm.profiler import ENGINE_CALLS
from kiln.llm.sequence import Sequence

log = logging.getLogger(__name__)

#: vLLM's ``PauseMode``
PAUSE_MODES = ("abort", "wait", "keep")
#: what ``wake_up`` may name: vLLM's sleep tags, and ``scheduling`` (a level-0 sleep)
WAKE_TAGS = (*runner_sleep.SLEEP_TAGS, "scheduling")
SLEEP_LEVELS = (0, 1, 2)
#: the operations the frontend may send (``state`` only reads)
OPERATIONS = ("pause", "resume", "sleep", "wake_up", "release_kv_cache_memory",
              "reset_prefix_cache", "abort", "state", "set_weight_version",
              *ENGINE_CALLS)  # fmt: skip


class PauseState(enum.IntEnum):
    UNPAUSED = 0
    PAUSED_NEW = 1  # nothing new joins; what is in the engine runs (``wait``)
    PAUSED_ALL = 2  # nothing runs (``keep``, a sleep)


class _Pending(enum.Enum):
    PENDING = "pending"


PENDING = _Pending.PENDING


@dataclass(slots=True)
class Held:
    """A request that arrived while paused: ``item`` is the host's own add command."""

    request_id: str
    n: int
    prompt_len: int
    item: object


def refused(message: str) -> KilnError:
    return KilnError(message, Status.INVALID_ARG)


class EngineControl:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pause_state = PauseState.UNPAUSED
        #: what a sleep released and no wake brought back yet
        self.sleeping_tags: set[str] = set()
        self.level = 0  # the last sleep's level (vLLM's ``engine_sleep_state`` gauge)
        self.held: list[Held] = []
        #: (token, what completes it) for a ``wait`` pause or sleep not drained yet
        self.pending: list[tuple[object, Callable[[], dict[str, Any]]]] = []
        #: the ends of the requests an abort or an abort pause stopped, to send
        self.finished: list[RequestOutput] = []
        #: held requests a resume releases, for the host to add to the engine
        self.released: list[object] = []

    # ---- what the host's loop asks -------------------------------------------------------
    @property
    def holds_requests(self) -> bool:
        return self.pause_state is not PauseState.UNPAUSED

    def may_step(self) -> bool:
        return self.pause_state is not PauseState.PAUSED_ALL and not self.sleeping_tags

    def hold(self, request_id: str, n: int, prompt_len: int, item: object) -> None:
        self.held.append(Held(request_id, n, prompt_len, item))

    def drop_held(self, request_id: str) -> bool:
        """Forget a held request (its client left): True when it was held."""
        kept = [h for h in self.held if h.request_id != request_id]
        found = len(kept) != len(self.held)
        self.held = kept
        return found

    def state(self) -> dict[str, Any]:
        return {
            "paused": self.pause_state is not PauseState.UNPAUSED,
            # vLLM's is_sleeping: paused at any level, or memory released
            "sleeping": self.pause_state is not PauseState.UNPAUSED or bool(self.sleeping_tags),
            "level": self.level if self.sleeping_tags or self.holds_requests else 0,
            "tags": sorted(self.sleeping_tags),
            "weight_version": self.engine.weight_version,
        }

    def poll(self) -> list[tuple[object, dict[str, Any]]]:
        """The pending operations that completed: a ``wait`` pause once the engine drained."""
        if not self.pending or self.engine.has_work():
            return []
        done, self.pending = self.pending, []
        return [(token, complete()) for token, complete in done]

    # ---- operations ------------------------------------------------------------------------
    def run(self, token: object, op: str, args: dict[str, Any]) -> dict[str, Any] | _Pending:
        """One operation; its answer, or ``PENDING`` (``poll`` reports it under ``token``).
        A refused operation raises ``KilnError`` and changes nothing."""
        if op == "state":
            return self.state()
        if op == "abort":  # also while a wait pause drains: it may be what ends the wait
            ids = args.get("request_ids")
            return {"aborted": self.abort(None if ids is None else [str(i) for i in ids])}
        if op in ENGINE_CALLS:  # the profiler's: never behind a pause
            return {"result": self.engine.call(op, args.get("args", ()))}
        if op == "set_weight_version":  # vLLM's utility call: never behind a pause either
            self.engine.set_weight_version(str(args["version"]))
            return {}
        if self.pending:
            raise refused(f"{op}: a pause is still waiting for the requests in flight to end")
        if op == "pause":
            mode, clear = _mode(args.get("mode", "abort")), bool(args.get("clear_cache", True))
            return self._pause(token, mode, lambda: self._finish_pause(mode, clear))
        if op == "resume":
            return self._resume()
        if op == "sleep":
            level, mode = _level(args.get("level", 1)), _mode(args.get("mode", "abort"))
            if level >= 1:
                self._check_runner(f"sleep level {level}")
            return self._pause(token, mode, lambda: self._finish_sleep(level, mode))
        if op == "wake_up":
            return self._wake_up(_tags(args.get("tags")))
        if op == "release_kv_cache_memory":
            return self._release_kv_cache_memory()
        if op == "reset_prefix_cache":
            return {"success": self.reset_prefix_cache(bool(args.get("reset_running_requests")))}
        raise refused(f"unknown engine operation {op!r}")

    def _pause(
        self, token: object, mode: str, complete: Callable[[], dict[str, Any]]
    ) -> dict[str, Any] | _Pending:
        if mode == "wait" and self.sleeping_tags and self.engine.has_work():
            raise refused(
                "a wait pause cannot drain while the engine is asleep (its kept requests "
                "cannot run): wake it first (POST /wake_up), or pause with mode abort"
            )
        if mode == "abort":
            self.abort(None)
        # vLLM: the last pause's mode decides (a wait after a keep lets the kept run out)
        self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        if mode == "wait" and self.engine.has_work():
            self.pending.append((token, complete))
            return PENDING
        return complete()

    def _finish_pause(self, mode: str, clear_cache: bool) -> dict[str, Any]:
        # vLLM: clear_cache is ignored by a keep pause (its requests keep their blocks)
        if clear_cache and mode != "keep":
            self.reset_prefix_cache(False)
        return {}

    def _finish_sleep(self, level: int, mode: str) -> dict[str, Any]:
        if level == 0:
            self.level = 0
            return {}
        if self.sleeping_tags:
            log.warning("llm: the engine is already asleep (%s)", sorted(self.sleeping_tags))
            return {}
        # kept requests lose their KV cache with the sleep: they are recomputed on waking
        self.reset_prefix_cache(True)
        runner = self._runner()
        runner_sleep.release_kv_cache(runner)
        runner_sleep.release_weights(runner, level)
        self.sleeping_tags = set(runner_sleep.SLEEP_TAGS)
        self.level = level
        log.info("llm: asleep at level %d (mode %s)", level, mode)
        return {}

    def _resume(self) -> dict[str, Any]:
        if self.sleeping_tags:
            raise refused(
                f"the engine is asleep ({', '.join(sorted(self.sleeping_tags))} released): "
                "wake it with POST /wake_up"
            )
        self.pause_state = PauseState.UNPAUSED
        self.level = 0
        self.released = [h.item for h in self.held]
        self.held = []
        return {}

    def _wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        wanted = set(runner_sleep.SLEEP_TAGS) if tags is None else set(tags) - {"scheduling"}
        if self.sleeping_tags and not wanted <= self.sleeping_tags:
            # vLLM's executor: a tag that is not asleep wakes nothing
            log.warning("llm: wake_up tags %s are not all asleep (%s)", sorted(wanted),
                        sorted(self.sleeping_tags))  # fmt: skip
            return {"fully_awake": False}
        runner = self._runner() if wanted & self.sleeping_tags else None
        if runner is not None and "weights" in wanted and "weights" in self.sleeping_tags:
            runner_sleep.restore_weights(runner)
            self.sleeping_tags.discard("weights")
        if runner is not None and "kv_cache" in wanted and "kv_cache" in self.sleeping_tags:
            runner_sleep.restore_kv_cache(runner)
            self.sleeping_tags.discard("kv_cache")
        fully_awake = not self.sleeping_tags
        if fully_awake:
            self._resume()
        return {"fully_awake": fully_awake}

    def _release_kv_cache_memory(self) -> dict[str, Any]:
        if not self.holds_requests or self.engine.has_work():
            raise refused("release_kv_cache_memory needs a completed pause first (POST /pause)")
        if self.sleeping_tags:
            raise refused("release_kv_cache_memory needs the engine's memory resident (awake)")
        self._check_runner("release_kv_cache_memory")
        self.reset_prefix_cache(True)
        runner_sleep.release_kv_cache(self._runner())
        self.sleeping_tags.add("kv_cache")
        return {}

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """Forget every cached block; False (nothing done) while a sequence holds blocks,
        unless ``reset_running_requests`` sends those back to the queue first (they are
        recomputed when they run again), as vLLM's scheduler does."""
        if reset_running_requests:
            self.engine.scheduler.preempt_running()
        return self.engine.block_manager.reset_prefix_cache()

    def abort(self, request_ids: list[str] | None) -> int:
        """End the requests (None: every one, held ones too) with finish reason ``abort``;
        their ends go to their clients (``finished``)."""
        sched = self.engine.scheduler
        if request_ids is None:
            live = {s.request_id: None for q in (sched.running, sched.waiting) for s in q}
            request_ids = [*live, *(h.request_id for h in self.held)]
        now = time.monotonic()
        for rid in request_ids:
            for held in [h for h in self.held if h.request_id == rid]:
                self.finished += held_ends(held.request_id, held.n, held.prompt_len)
            self.drop_held(rid)
            for seq in sched.abort(rid):
                self.engine._retire(seq, now, "abort")
                self.finished.append(_end(seq))
        return len(request_ids)

    # ---- the runner ----------------------------------------------------------------------
    def _runner(self) -> ModelRunner:
        runner = self.engine.runner
        assert isinstance(runner, ModelRunner)
        return runner

    def _check_runner(self, what: str) -> None:
        if type(self.engine.runner) is not ModelRunner:
            raise KilnError(
                f"{what} is not supported for this model (tensor parallel or encoder runner); "
                "level 0 (a pause) is",
                Status.UNSUPPORTED,
            )


def _end(seq: Sequence) -> RequestOutput:
    return RequestOutput(
        seq.request_id, [], True, "abort", seq.num_prompt_tokens, seq.num_output_tokens,
        index=seq.index, first_scheduled_time=seq.request.first_scheduled_time,
        num_cached_tokens=seq.request.num_cached_tokens,
    )  # fmt: skip


def held_ends(request_id: str, n: int, prompt_len: int) -> list[RequestOutput]:
    """The ends of a request that never joined the engine (held, or compiling its grammar)."""
    return [RequestOutput(request_id, [], True, "abort", prompt_len, 0, index=i) for i in range(n)]


# ---- the operations' arguments (the frontend checks them first, with HTTP's words) ----------
def _mode(mode: object) -> str:
    if mode not in PAUSE_MODES:
        raise refused(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return str(mode)


def _level(level: object) -> int:
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise refused(f"level must be 0, 1 or 2, got {level!r}")
    return level


def _tags(tags: object) -> list[str] | None:
    if tags is None:
        return None
    if not isinstance(tags, list) or any(t not in WAKE_TAGS for t in tags):
        raise refused(f"tags must be among {', '.join(WAKE_TAGS)}, got {tags!r}")
    return [str(t) for t in tags]
