"""Small real classifiers trained at test time on scikit-learn's bundled digits data set.

The MLP takes ``INPUT [N, 64]``; the CNN takes ``IMAGE [N, 1, 8, 8]``. Training is a few hundred
full-batch Adam steps (a few seconds on CPU). The module is importable by path so ``kiln
optimize tests.digits:trained_mlp`` works as a ``module:factory`` reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


@dataclass(slots=True)
class Digits:
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def load_digits() -> Digits:
    from sklearn.datasets import load_digits as sk_load

    x, y = sk_load(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    split = int(0.75 * len(x))
    return Digits(x[:split], y[:split], x[split:], y[split:])


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 10))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsWideMLP(nn.Module):
    """64-1024-1024-10: a GEMV chain at batch 1 whose 4.3 MB of FP32 weights, not per-op
    overhead, bound its latency, so INT8 weights (4x fewer bytes) pay at batch 1 as well as 32
    (benchmarks/optimize_digits.py). Measured with raw ONNX Runtime, 1 thread, FP32 against
    U8S8 INT8: width 512 gained about 1.1x at batch 1, 768 about 1.5-1.9x, 1024 about 2-2.5x.
    Trains to about 98 % in 40 steps (a few CPU seconds)."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 10))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class DigitsWideCNN(nn.Module):
    """The CNN at 4x the channels (32, 64): still trains in seconds, and its convolutions, not
    per-op overhead, dominate at batch 32 (benchmarks/optimize_digits.py's third model)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, steps: int = 100) -> nn.Module:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the test machine's cores are shared: threads only contend
    for p in model.parameters():  # deterministic init independent of the global RNG
        if p.dim() > 1:
            nn.init.kaiming_uniform_(p, a=5**0.5)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xs), ys)
        loss.backward()
        opt.step()
    return model.eval()


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def images(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, 1, 8, 8)


def trained_mlp() -> nn.Module:
    """``module:factory`` entry: the MLP, from the weights the fixture saved (or trained now)."""
    saved = os.environ.get("KILN_DIGITS_MLP_WEIGHTS")
    model = DigitsMLP()
    if saved and Path(saved).exists():
        model.load_state_dict(torch.load(saved))
        return model.eval()
    data = load_digits()
    return train(model, data.train_x, data.train_y)
