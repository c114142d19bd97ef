"""The step graph of an ensemble, read from its config alone (no composing model needed).

Structural mistakes (a tensor nobody produces, a tensor produced twice, a cycle, an ensemble
output no step writes) are found here, so ``validate_config`` refuses them before the
server loads any composing model. What needs the composing models (their tensor names,
datatypes and shapes) is checked at load time in :mod:`kiln.scheduling.ensemble`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import invalid_arg

ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    model_name: str
    model_version: str  # "" = the latest ready version (``model_version: -1`` or unset)
    inputs: dict[str, str]  # composing model input -> ensemble tensor
    outputs: dict[str, str]  # composing model output -> ensemble tensor

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"


@dataclass(frozen=True, slots=True)
class EnsembleGraph:
    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def is_ensemble(config: ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM


def steps_of(config: ModelConfig) -> tuple[Step, ...]:
    # An omitted model_version reads as 0 (proto3): taken as "latest" like -1, since an
    # ensemble written without it means the serving version, not a folder named 0.
    return tuple(
        Step(
            index=i,
            model_name=s.model_name,
            model_version="" if s.model_version <= 0 else str(s.model_version),
            inputs=dict(s.input_map),
            outputs=dict(s.output_map),
        )
        for i, s in enumerate(config.ensemble_scheduling.step)
    )


def graph_problems(config: ModelConfig) -> list[str]:
    """Every structural problem of an ensemble config, each naming the tensor or steps."""
    name = config.name
    where = f"in ensemble '{name}', "
    steps = steps_of(config)
    inputs = [i.name for i in config.input]
    problems: list[str] = []
    # An ensemble has no model file to auto-complete from: its signature is what it declares.
    if not inputs:
        problems.append(where + "no input is declared (ensemble inputs are never auto-completed)")
    if not config.output:
        problems.append(where + "no output is declared (ensemble outputs are never auto-completed)")

    writers: dict[str, str] = {t: f"ensemble input '{t}'" for t in inputs}
    for step in steps:
        for model_output, tensor in step.outputs.items():
            writer = f"{step.label} output '{model_output}'"
            if tensor in writers:
                problems.append(
                    where + f"tensor '{tensor}' is produced more than once: "
                    f"by {writers[tensor]} and by {writer}"
                )
            else:
                writers[tensor] = writer
    for step in steps:
        for model_input, tensor in step.inputs.items():
            if tensor not in writers:
                problems.append(
                    where + f"{step.label} input '{model_input}' reads tensor '{tensor}', "
                    "which is neither an ensemble input nor an output of any step"
                )
    for out in config.output:
        if out.name and out.name not in writers:
            problems.append(where + f"ensemble output '{out.name}' is not produced by any step")
        elif out.name in inputs:
            problems.append(where + f"ensemble output '{out.name}' is also an ensemble input")
    cycle = find_cycle(steps)
    if cycle:
        problems.append(where + f"steps form a cycle: {cycle}")
    return problems


def find_cycle(steps: tuple[Step, ...]) -> str:
    """``step 0 (model 'a') -> 'X' -> step 1 (model 'b') -> 'Y' -> step 0 ...`` or ""."""
    producer = {t: s for s in steps for t in s.outputs.values()}
    # edges[i] = (tensor, step) pairs: step i reads `tensor`, written by `step`
    edges = {s.index: [(t, producer[t]) for t in s.inputs.values() if t in producer] for s in steps}
    state: dict[int, int] = {}  # 1 = on the current path, 2 = finished
    path: list[tuple[Step, str]] = []  # (step, tensor it reads from the next entry)

    def visit(step: Step) -> str:
        state[step.index] = 1
        for tensor, upstream in edges[step.index]:
            path.append((step, tensor))
            if state.get(upstream.index) == 1:
                start = next(i for i, (s, _) in enumerate(path) if s.index == upstream.index)
                loop = path[start:]
                # Written in data-flow order: producer first, then who reads its tensor.
                parts = [upstream.label]
                for s, t in reversed(loop):
                    parts += [f"'{t}'", s.label]
                return " -> ".join(parts)
            if upstream.index not in state:
                found = visit(upstream)
                if found:
                    return found
            path.pop()
        state[step.index] = 2
        return ""

    for step in steps:
        if step.index not in state:
            found = visit(step)
            if found:
                return found
    return ""


def build_graph(config: ModelConfig) -> EnsembleGraph:
    """The graph of a valid ensemble config; the first structural problem otherwise."""
    problems = graph_problems(config)
    if problems:
        raise invalid_arg(problems[0])
    return EnsembleGraph(
        name=config.name,
        steps=steps_of(config),
        inputs=tuple(i.name for i in config.input),
        outputs=tuple(o.name for o in config.output),
    )
