"""Request-level (static) batching: a batch is formed only when the previous one has fully
finished; until then only its members run. The baseline continuous batching was invented to beat."""

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator
from varlen.scheduler_api import SchedulerOutput, SchedulerPolicy


@mypyc_attr(allow_interpreted_subclasses=True)
class StaticPolicy(SchedulerPolicy):
    chunked_prefill = False
    repeats_decode_batches = True  # with waiting empty, the batch's members are all that run

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        self.members: set[str] = set()  # the current batch; a member preempted for memory stays one

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.members:
            self._admit_waiting(kv, out, self.max_num_batched_tokens)
            self.members = {r.req_id for r, _ in out.scheduled}
            return out
        budget = self._schedule_running(kv, out, self.max_num_batched_tokens)
        if self._may_admit():
            # A member re-enters with the whole budget: the decodes running beside it do not share it.
            self._admit_waiting(kv, out, self.max_num_batched_tokens,
                                limit=sum(r.req_id in self.members for r in self.waiting))
        return out

    def _may_admit(self) -> bool:
        # Newcomers wait for the whole batch to finish; only a preempted member re-enters early.
        if not self.members:
            return bool(self.waiting)
        return bool(self.waiting) and self.waiting[0].req_id in self.members

    def waiting_order(self):
        if self.members:
            return [r for r in self.waiting if r.req_id in self.members]
        return list(self.waiting)

    def remove(self, req) -> None:
        super().remove(req)
        self.members.discard(req.req_id)
