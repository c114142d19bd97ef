"""The startup heap out of the garbage collector's reach.

A server process holds a few hundred thousand long-lived objects once its models are
loaded (modules, configs, a model's Python objects). Python's full collections walk all of
them: on the event loop's thread such a pass stopped every stream for about 200 ms. After
startup kiln collects once and moves what is alive to the permanent generation
(``gc.freeze``), as vLLM does in its engine: later passes walk only the objects made since
(docs/design/gc-freeze.md)."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect the garbage startup left, then freeze every object alive now; the number of
    objects frozen. Refcounting still frees a frozen object that is dropped later; only a
    frozen reference cycle would stay (there are none left by then: the collection just
    ran)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
