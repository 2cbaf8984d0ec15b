"""Priority scheduling: continuous batching where waiting requests are admitted by (priority,
arrival) and, when memory runs out, the least important running request is preempted first
(lower `priority` value = more important; ties broken by later arrival)."""

from mypy_extensions import mypyc_attr

from schedulers.base import SchedulerOutput, SchedulerPolicy
from varlen.kv.base import KVAllocator
from varlen.request import Request


def _rank(r: Request) -> tuple[int, float]:
    """Most important first: lower priority value, then earlier arrival."""
    return r.priority, r.arrival


@mypyc_attr(allow_interpreted_subclasses=True)
class PriorityPolicy(SchedulerPolicy):
    chunked_prefill = True
    repeats_decode_batches = True  # the running order is a stable sort on fixed keys

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        self.running.sort(key=_rank)
        return super().schedule(kv)

    def next_decode_batch(self):
        self.running.sort(key=_rank)  # what schedule() would do first
        return super().next_decode_batch()

    def waiting_order(self):
        return sorted(self.waiting, key=_rank)

    def victim_order(self):
        return sorted(self.running, key=_rank, reverse=True)
