"""Run a Python module with every Python thread's name copied to its OS thread name.

Python 3.11 leaves every thread's ``/proc/<pid>/task/<tid>/comm`` as ``python``, so the
per-thread CPU split of ``batching.py`` could not tell kiln's event loop from its instance
threads. This launcher sets the native name (``prctl(PR_SET_NAME)``, 15 bytes) when each
thread starts, then runs the module as ``python -m`` would. Threads created by C++ code
(onnxruntime's pool) inherit the name of the thread that created them; the launcher renames
the main thread ``main`` so they stay distinguishable. Usage::

    python benchmarks/named_threads.py kiln serve --model-repository ...
"""

from __future__ import annotations

import ctypes
import runpy
import sys
import threading
from typing import Any

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def _set_native_name(name: str) -> None:
    _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_original_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _bootstrap_inner(self: threading.Thread, *args: Any) -> None:
    _set_native_name(self.name)
    _original_bootstrap(self, *args)


def main() -> None:
    module, sys.argv = sys.argv[1], sys.argv[1:]
    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
    _set_native_name("main")
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
