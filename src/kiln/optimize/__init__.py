"""``kiln optimize``: from a trained model to the fastest deployment within an accuracy budget.

Candidates (FP32 graph levels, INT8 dynamic, INT8 static QDQ) are built, checked against the FP32
reference on validation data, profiled, and the best one is written as a model repository entry
with a report. See docs/optimize.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.optimize.types import Objective, OptimizeError, OptimizeOptions

if TYPE_CHECKING:
    from kiln.optimize.pipeline import Outcome

__all__ = ["Objective", "OptimizeError", "OptimizeOptions", "Outcome", "optimize"]


def optimize(
    model: str | Path,
    calibration_data: str | Path,
    validation_data: str | Path,
    output_repository: str | Path,
    **options: Any,
) -> Outcome:
    """Python entry point of ``kiln optimize``; keyword options as in :class:`OptimizeOptions`.

    ``from kiln.optimize import optimize``: a function of the package (not the package made
    callable), so ``kiln.optimize.*`` stays an ordinary package."""
    from kiln.optimize.pipeline import optimize as run

    return run(
        OptimizeOptions(
            model=str(model),
            calibration_data=str(calibration_data),
            validation_data=str(validation_data),
            output_repository=Path(output_repository),
            **options,
        )
    )
