"""_lazy_loop's heap of (time, replica) entries (sim/simulator.py): heapq's steps, compiled comparisons."""

import heapq
import random

from sim.simulator import _head, _heappop, _heappush


def test_same_heap_as_heapq_step_for_step():
    rng = random.Random(7)
    ours: list = []
    ref: list[tuple[float, int]] = []
    for _ in range(3000):
        if ref and rng.random() < 0.45:
            assert _heappop(ours) == heapq.heappop(ref)
        else:
            # Few distinct times and replicas: ties on the time, and whole duplicates, are common.
            item = (float(rng.randrange(20)) / 4, rng.randrange(6))
            _heappush(ours, item)
            heapq.heappush(ref, item)
        assert ours == ref
        if ref:
            assert _head(ours) == ref[0][0]
    while ref:
        assert _heappop(ours) == heapq.heappop(ref)
    assert ours == []


def test_ties_on_time_pop_the_lower_replica_first():
    heap: list = []
    for item in [(1.0, 3), (1.0, 1), (0.5, 9), (1.0, 2), (float("inf"), 0)]:
        _heappush(heap, item)
    assert [_heappop(heap) for _ in range(5)] == [(0.5, 9), (1.0, 1), (1.0, 2), (1.0, 3), (float("inf"), 0)]
