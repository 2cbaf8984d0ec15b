"""vLLM V0's default scheduler (vLLM 0.x before chunked prefill, the PagedAttention paper's
system): whole prompts, and a step is either prefills (when waiting requests fit) or decodes of
every running request, never both: the stall Sarathi-Serve's chunked prefill removes."""

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator
from varlen.scheduler_api import SchedulerOutput, SchedulerPolicy


@mypyc_attr(allow_interpreted_subclasses=True)
class VllmV0Policy(SchedulerPolicy):
    chunked_prefill = False
    # With no admission possible, the step is a decode of every running request, in `running` order.
    repeats_decode_batches = True

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        out = SchedulerOutput()
        if self._may_admit():
            # The budget counts prefill tokens only: a prefill step runs no decodes.
            self._admit_waiting(kv, out, self.max_num_batched_tokens)
            if out.scheduled:
                return out
        self._schedule_running(kv, out, self.max_num_batched_tokens)
        return out
