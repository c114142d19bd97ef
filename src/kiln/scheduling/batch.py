"""Merge queued requests into one batch and split the batch's outputs back, exactly."""

from __future__ import annotations

import numpy as np

from kiln.core.errors import KilnError, Status
from kiln.scheduling.base import Job


def output_names(jobs: list[Job]) -> list[str]:
    """Every output any request of the batch asked for, in first-asked order."""
    return list(dict.fromkeys(name for job in jobs for name in job.output_names))


def merge_inputs(jobs: list[Job]) -> dict[str, np.ndarray]:
    """Concatenate along the batch dimension; the queue only groups equal shapes."""
    if len(jobs) == 1:
        return jobs[0].inputs  # nothing to merge: no copy
    return {
        name: np.concatenate([job.inputs[name] for job in jobs], axis=0) for name in jobs[0].inputs
    }


def split_outputs(
    outputs: dict[str, np.ndarray], jobs: list[Job], model: str
) -> list[dict[str, np.ndarray]]:
    """Each request's rows of each output it asked for (views, not copies)."""
    if len(jobs) == 1:
        return [outputs]
    total = sum(job.batch_size for job in jobs)
    for name in output_names(jobs):
        value = outputs.get(name)
        if value is not None and (value.ndim == 0 or value.shape[0] != total):
            got = "a scalar" if value.ndim == 0 else f"batch dimension {value.shape[0]}"
            raise KilnError(
                f"model '{model}' returned output '{name}' with {got}, but the batch it "
                f"was given holds {total}: cannot split it back into {len(jobs)} responses",
                Status.INTERNAL,
            )
    result: list[dict[str, np.ndarray]] = []
    offset = 0
    for job in jobs:
        end = offset + job.batch_size
        result.append(
            {name: outputs[name][offset:end] for name in job.output_names if name in outputs}
        )
        offset = end
    return result
