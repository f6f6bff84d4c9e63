"""The daemon's heap once start-up is done: what start-up built is out of the
collector's sight, and cyclic garbage made later is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from node.heap import YOUNG_THRESHOLD, settle_heap


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


class _Node:
    other: _Node | None = None


@pytest.mark.usefixtures("restored_collector")
def test_start_ups_objects_leave_the_collectors_sight_and_young_ones_wait_longer() -> None:
    threshold = gc.get_threshold()
    built = [[n] for n in range(1000)]  # what start-up keeps until exit
    frozen = gc.get_freeze_count()
    settle_heap()
    assert gc.get_freeze_count() >= frozen + len(built)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *threshold[1:])
    # A full collection no longer walks them.
    assert not any(o is built for o in gc.get_objects(generation=2))


@pytest.mark.usefixtures("restored_collector")
def test_cyclic_garbage_made_after_start_up_is_still_collected() -> None:
    settle_heap()
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
