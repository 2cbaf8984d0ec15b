"""Sarathi-Serve's stall-free batching: a fixed token budget per step, spent first on every
running decode, then on the unfinished prefills (in admission order), then on new prompts, which
are split into chunks to fill what is left. A long prompt never delays a running generation by
more than one budget-sized step (vLLM V1 differs in order only: running requests, decodes and
partial prefills alike, in admission order; see chunked.py)."""

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
    # With only decodes running, the stable sort leaves `running` as it is: every running request
    # for one token, in `running` order.
    repeats_decode_batches = True

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        # Decodes first, partial prefills after them (stable: each group keeps admission order).
        # A partial prefill is a recent admission, so `running`'s tail stays the newest work and
        # the LIFO victim order still preempts it before a decode.
        self.running.sort(key=_prefilling)
        return super().schedule(kv)
