"""Example model repository: small ONNX models built locally, for demos and tests.

``kiln repo example DIR`` calls :func:`build_example_repository`;
:func:`reference_outputs` gives NumPy-only expected answers for checking a server.
"""

from kiln.examples.reference import reference_outputs, reference_responses, reference_sequence
from kiln.examples.repository import (
    DIGIT_LABELS,
    EXAMPLE_MODELS,
    build_example_repository,
    example_config,
)

__all__ = [
    "DIGIT_LABELS",
    "EXAMPLE_MODELS",
    "build_example_repository",
    "example_config",
    "reference_outputs",
    "reference_responses",
    "reference_sequence",
]
