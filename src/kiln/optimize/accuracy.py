"""The accuracy guard: a candidate's outputs against the FP32 reference on the validation data.

What ``--max-accuracy-drop`` bounds depends on what is known:
- labels given: the fall in task accuracy (top-1 against the labels), reference minus candidate;
- a classifier output (``[N, C]``, C > 1) without labels: 1 - top-1 agreement with the reference;
- otherwise: 1 - the cosine similarity of the outputs.
"""

from __future__ import annotations

import numpy as np

from kiln.optimize.types import Accuracy


def classifier_index(outputs: list[np.ndarray]) -> int | None:
    """The first output that looks like class scores: float, ``[N, C]`` with C > 1."""
    for i, out in enumerate(outputs):
        if out.ndim == 2 and out.shape[1] > 1 and np.issubdtype(out.dtype, np.floating):
            return i
    return None


def task_accuracy(outputs: list[np.ndarray], labels: np.ndarray | None) -> float | None:
    index = classifier_index(outputs)
    if labels is None or index is None:
        return None
    return float(np.mean(outputs[index].argmax(axis=1) == labels))


def compare(
    reference: list[np.ndarray], candidate: list[np.ndarray], labels: np.ndarray | None
) -> Accuracy:
    abs_err, rel_err, cosine = 0.0, 0.0, 1.0
    for ref, got in zip(reference, candidate, strict=True):
        r = ref.astype(np.float64).reshape(len(ref), -1)
        g = got.astype(np.float64).reshape(len(got), -1)
        if not np.all(np.isfinite(g)):
            # max() drops NaN silently: record it as an infinite error so the guard rejects it.
            abs_err = rel_err = float("inf")
            continue
        diff = np.abs(r - g)
        abs_err = max(abs_err, float(diff.max(initial=0.0)))
        # Relative to the reference's magnitude over the whole output: element-wise relative
        # error explodes on values near zero, which says nothing about the model's quality.
        scale = float(np.abs(r).max(initial=0.0)) or 1.0
        rel_err = max(rel_err, float(diff.max(initial=0.0)) / scale)
        norms = np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1)
        cos = np.where(norms > 0, (r * g).sum(axis=1) / np.where(norms > 0, norms, 1.0), 1.0)
        cosine = min(cosine, float(cos.mean()) if len(cos) else 1.0)
    index = classifier_index(reference)
    agreement = None
    if index is not None:
        agreement = float(
            np.mean(reference[index].argmax(axis=1) == candidate[index].argmax(axis=1))
        )
    ref_task = task_accuracy(reference, labels)
    task = task_accuracy(candidate, labels)
    if ref_task is not None and task is not None:
        drop, metric = ref_task - task, "task accuracy drop (labels)"
    elif agreement is not None:
        drop, metric = 1.0 - agreement, "1 - top-1 agreement with FP32"
    else:
        drop, metric = 1.0 - cosine, "1 - cosine similarity with FP32"
    return Accuracy(
        max_abs_error=abs_err,
        max_rel_error=rel_err,
        cosine_similarity=cosine,
        top1_agreement=agreement,
        task_accuracy=task,
        drop=drop,
        drop_metric=metric,
    )


def verdict(accuracy: Accuracy, max_drop: float) -> str | None:
    """Why the candidate is rejected, or ``None`` when it is within the budget."""
    if not np.isfinite(accuracy.max_abs_error):
        return "outputs contain NaN or Inf"
    if accuracy.drop > max_drop:
        return (
            f"{accuracy.drop_metric} is {accuracy.drop:.4f}, {accuracy.drop - max_drop:.4f} "
            f"over --max-accuracy-drop {max_drop}"
        )
    return None
