"""``freeze_startup_heap``: startup's objects leave the collector's passes, its garbage
does not (it is collected first), and objects made later are still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kiln.core.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_startup_objects_are_frozen_and_its_garbage_is_not() -> None:
    kept = [_Node() for _ in range(100)]
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage  # a cycle nobody holds: startup's garbage
    frozen = freeze_startup_heap()
    assert gone() is None  # collected before the freeze, not kept forever
    # frozen objects leave the permanent generation only when freed, which another
    # thread of the test process may do meanwhile: the count can only have fallen
    assert len(kept) <= gc.get_freeze_count() <= frozen
    tracked = {id(o) for o in gc.get_objects()}  # the collector's generations only
    assert not any(id(n) in tracked for n in kept)
    # a cycle made after the freeze is still the collector's
    later = _Node()
    dropped = weakref.ref(later)
    del later
    gc.collect()
    assert dropped() is None
    assert all(n.me is n for n in kept)
