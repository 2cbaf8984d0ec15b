"""vLLM V0's default scheduler (vLLM 0.x before chunked prefill, the PagedAttention paper's
system): whole prompts, and a step is either prefills (when waiting requests fit) or decodes of
every running request, never both: the stall Sarathi-Serve's chunked prefill removes.

Admission keeps a watermark of free blocks (vLLM V0's block manager, default 1% of the pool): a
prompt is admitted only when the pool keeps that many blocks free after it, so a request just
preempted for memory is not re-admitted into the room its eviction made and preempted again."""

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator
from varlen.scheduler_api import SchedulerOutput, SchedulerPolicy


@mypyc_attr(allow_interpreted_subclasses=True)
class VllmV0Policy(SchedulerPolicy):
    chunked_prefill = False
    # With no admission possible, the step is a decode of every running request, in `running` order.
    repeats_decode_batches = True

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, watermark: float = 0.01):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark is a fraction of the KV pool's blocks in [0, 1), got {watermark}")
        self.watermark = float(watermark)

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        out = SchedulerOutput()
        if self._may_admit():
            # The budget counts prefill tokens only: a prefill step runs no decodes.
            self._admit_waiting(kv, out, self.max_num_batched_tokens, limit=self._above_watermark(kv))
            if out.scheduled:
                return out
        self._schedule_running(kv, out, self.max_num_batched_tokens)
        return out

    def _above_watermark(self, kv: KVAllocator) -> int:
        """How many waiting requests, in order, fit while `watermark` of the pool's blocks stays free."""
        bs = kv.block_size
        room = kv.usage().free_slots // bs - int(self.watermark * kv.num_blocks)
        fit, seats = 0, self.max_num_seqs - len(self.running)
        for req in self.waiting:
            room -= -(-(req.num_prompt_tokens + len(req.output_token_ids)) // bs)
            if room < 0 or fit >= seats:
                break
            fit += 1
        return fit
