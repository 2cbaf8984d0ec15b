"""Priority scheduling: continuous batching where waiting requests are admitted by (priority,
arrival) and, when memory runs out, the least important running request is preempted first
(lower `priority` value = more important; ties broken by later arrival)."""

from schedulers.base import SchedulerOutput, SchedulerPolicy
from varlen.kv.base import KVAllocator


class PriorityPolicy(SchedulerPolicy):
    repeats_decode_batches = True  # the running order is a stable sort on fixed keys

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, chunked_prefill: bool = True):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        self.chunked_prefill = chunked_prefill

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        self.running.sort(key=lambda r: (r.priority, r.arrival))
        return super().schedule(kv)

    def next_decode_batch(self):
        self.running.sort(key=lambda r: (r.priority, r.arrival))  # what schedule() would do first
        return super().next_decode_batch()

    def waiting_order(self):
        return sorted(self.waiting, key=lambda r: (r.priority, r.arrival))

    def victim_order(self):
        return sorted(self.running, key=lambda r: (r.priority, r.arrival), reverse=True)
