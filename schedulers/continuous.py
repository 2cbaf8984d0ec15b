"""Iteration-level (continuous) batching: every step, running requests continue and whole prompts
are admitted beside them while seats, the token budget and KV memory allow."""

from mypy_extensions import mypyc_attr

from varlen.scheduler_api import SchedulerPolicy


@mypyc_attr(allow_interpreted_subclasses=True)
class ContinuousPolicy(SchedulerPolicy):
    chunked_prefill = False
    repeats_decode_batches = True
