"""The collector in long-running processes: freezing start-up's heap, recording pauses."""

from __future__ import annotations

import gc

from pagedserve.gc_tuning import YOUNG_THRESHOLD, GCPauses, freeze_heap


def test_freeze_heap_exempts_what_exists_and_collects_what_comes_after():
    class Node:
        pass

    before = Node()
    thresholds = gc.get_threshold()
    gc.collect()
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *thresholds[1:])
        assert not any(o is before for o in gc.get_objects())  # frozen: never walked
        after = Node()
        assert any(o is after for o in gc.get_objects())
        a, b = Node(), Node()  # a cycle made after the freeze is still collected
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_pauses_count_each_generation_and_bound_a_window():
    pauses = GCPauses().install()
    try:
        first = pauses.snapshot(reset_max=True)
        gc.collect(0)
        gc.collect()
        second = pauses.snapshot(reset_max=True)
        assert second["count"][0] == first["count"][0] + 1
        assert second["count"][2] == first["count"][2] + 1
        assert second["seconds"][2] > first["seconds"][2]
        assert second["cpu_seconds"][2] >= first["cpu_seconds"][2]
        assert second["max_s"][2] > 0.0
        assert second["tracked"] > 0
        third = pauses.snapshot()
        assert third["max_s"] == [0.0, 0.0, 0.0]  # the window after `second` had none
    finally:
        pauses.remove()
    count = pauses.count[2]
    gc.collect()
    assert pauses.count[2] == count  # removed: no longer called
