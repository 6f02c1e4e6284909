"""turnout/utils/gc_freeze.py: the frozen start-up heap, and the full collection that still frees a dropped
engine's cycles (an engine's sleep and shutdown rely on it to give their device memory back)."""

import gc
import weakref

from turnout.utils.gc_freeze import collect_all, freeze_startup_heap


class _Node:
    pass


def _cycle(hold: list | None = None):
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    if hold is not None:
        hold.append(a)
    return weakref.ref(a)


def test_collect_all_frees_cycles_that_were_frozen_and_freezes_again():
    hold = []
    alive = _cycle(hold)  # a cycle alive when the heap is frozen: an engine's parts at start-up
    try:
        assert freeze_startup_heap() > 1000
        hold.clear()  # the engine dropped
        gc.collect()
        assert alive() is not None  # now garbage, but frozen: a plain collection does not reach it
        collect_all()
        assert alive() is None
        assert gc.get_freeze_count() > 1000  # the heap frozen again
    finally:
        gc.unfreeze()


def test_collect_all_leaves_an_unfrozen_process_unfrozen():
    assert gc.get_freeze_count() == 0
    gone = _cycle()
    collect_all()
    assert gone() is None and gc.get_freeze_count() == 0
