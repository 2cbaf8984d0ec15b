"""Iteration-level (continuous) batching: every step, running requests continue and whole prompts
are admitted beside them while seats, the token budget and KV memory allow."""

from schedulers.base import SchedulerPolicy


class ContinuousPolicy(SchedulerPolicy):
    chunked_prefill = False
    repeats_decode_batches = True
