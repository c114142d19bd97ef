"""``gpu``-marked tests run where an NVIDIA driver is present, or whenever ``-m gpu`` asks.

Without a driver they are skipped with the reason; with ``-m gpu`` they always run, so
on a GPU machine a broken driver or a missing ``nvidia-ml-py`` fails loudly.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _nvidia_driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidia0").exists()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "gpu" in (config.getoption("-m") or "") or _nvidia_driver_present():
        return
    skip = pytest.mark.skip(
        reason="needs an NVIDIA GPU and driver: run `pytest -m gpu` on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
