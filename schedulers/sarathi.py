"""Sarathi-Serve's stall-free batching: a fixed token budget per step, spent first on every
running decode, then on the unfinished prefills (in admission order), then on new prompts, which
are split into chunks to fill what is left (chunked.py differs in order only)."""

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator
from varlen.request import Request
from varlen.scheduler_api import SchedulerOutput, SchedulerPolicy


def _prefilling(r: Request) -> bool:
    """More than one token pending: a prompt (or a recomputation) still being chunked in."""
    return r.num_prompt_tokens + len(r.output_token_ids) - r.num_computed_tokens > 1


@mypyc_attr(allow_interpreted_subclasses=True)
class SarathiPolicy(SchedulerPolicy):
    chunked_prefill = True
    # With only decodes running, the stable sort leaves `running` as it is.
    repeats_decode_batches = True

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        # Decodes first, then partial prefills (stable sort): the tail stays the newest, LIFO victim.
        self.running.sort(key=_prefilling)
        return super().schedule(kv)
