"""The ``torch_mlp`` example: the ``mlp`` weights as a TorchScript module (needs torch).

Same weights (:func:`kiln.examples.models.mlp_weights`), same layers, so its outputs equal
the ONNX ``mlp``'s up to float32 rounding. Only imported when torch is installed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.examples.models import MLP_HIDDEN, mlp_weights


class DigitMlp(torch.nn.Module):
    """64 -> 256 -> ReLU -> 128 -> ReLU -> 10: returns (logits, probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        weights = mlp_weights()
        layers = len(MLP_HIDDEN) + 1
        # W* are [in, out] (ONNX MatMul layout), so forward multiplies x @ W, not W @ x.
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.from_numpy(weights[f"W{i}"])) for i in range(1, layers + 1)]
        )
        self.biases = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.from_numpy(weights[f"B{i}"])) for i in range(1, layers + 1)]
        )

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = image
        last = len(self.weights) - 1
        for index, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            hidden = hidden @ weight + bias
            if index < last:
                hidden = torch.relu(hidden)
        return hidden, torch.softmax(hidden, dim=-1)


def write_torchscript_mlp(version_dir: Path) -> Path:
    """Trace :class:`DigitMlp` (TorchScript) into ``version_dir/model.pt``."""
    path = version_dir / "model.pt"
    module = torch.jit.trace(DigitMlp().eval(), torch.zeros(2, 64))  # type: ignore[no-untyped-call]
    torch.jit.save(module, str(path))
    return path


def write_exported_mlp(version_dir: Path) -> Path:
    """Export :class:`DigitMlp` with a dynamic batch into ``version_dir/model.pt2``."""
    path = version_dir / "model.pt2"
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(
        DigitMlp().eval(), (torch.zeros(2, 64),), dynamic_shapes={"image": {0: batch}}
    )
    torch.export.save(program, str(path))
    return path
