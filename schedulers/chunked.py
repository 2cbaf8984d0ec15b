"""Chunked prefill, vLLM V1 style: one token budget per step, spent on running
requests first (decodes and unfinished prefills, in admission order), then on new requests;
a prompt longer than what is left of the budget is split across steps."""

from mypy_extensions import mypyc_attr

from varlen.scheduler_api import SchedulerPolicy


@mypyc_attr(allow_interpreted_subclasses=True)
class ChunkedPolicy(SchedulerPolicy):
    chunked_prefill = True
    repeats_decode_batches = True
