"""A generation ends on ANY of the model's end-of-sequence ids (Llama 3 has two), from its config
and its generation config; stopping on the first id alone let requests run past their end."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from schedulers import ChunkedPolicy
from varlen import SamplingParams
from varlen.clock import SimClock
from varlen.engine import Engine, Executor
from varlen.kv import PagedAllocator
from varlen.llm import eos_token_ids
from varlen.request import Request


class Says(Executor):
    """A stand-in model that samples `token` every time."""

    def __init__(self, token: int) -> None:
        self.token = token

    def execute(self, scheduled, kv):
        return [self.token if r.num_computed_tokens + n == r.num_tokens else None for r, n in scheduled]


def run_one(eos, token: int, ignore_eos: bool = False) -> Request:
    eng = Engine(ChunkedPolicy(max_num_seqs=4, max_num_batched_tokens=16), PagedAllocator(16, 4, 64),
                 Says(token), clock=SimClock(), max_model_len=64, eos_token_id=eos, vocab_size=32)
    r = Request("r", [3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=ignore_eos))
    eng.run([r])
    return r


@pytest.mark.parametrize("eos", [[1, 7], (7, 1), 7])
def test_any_eos_id_stops_the_request(eos):
    r = run_one(eos, token=7)
    assert r.finish_reason.value == "stop" and r.output_token_ids == [7]


@pytest.mark.parametrize("eos", [[1, 2], 1, None, []])
def test_other_tokens_run_to_the_length_limit(eos):
    r = run_one(eos, token=7)
    assert r.finish_reason.value == "length" and r.output_token_ids == [7] * 6


def test_ignore_eos_ignores_every_eos_id():
    r = run_one([1, 7], token=7, ignore_eos=True)
    assert r.finish_reason.value == "length" and len(r.output_token_ids) == 6


def test_eos_ids_come_from_the_config_and_the_generation_config():
    hf = SimpleNamespace(config=SimpleNamespace(eos_token_id=[128001, 128009]),
                         generation_config=SimpleNamespace(eos_token_id=[128001, 128008, 128009]))
    assert eos_token_ids(hf) == [128001, 128009, 128008]
    hf = SimpleNamespace(config=SimpleNamespace(eos_token_id=2), generation_config=None)
    assert eos_token_ids(hf) == [2]
    hf = SimpleNamespace(config=SimpleNamespace(), generation_config=SimpleNamespace(eos_token_id=None))
    assert eos_token_ids(hf) == []
