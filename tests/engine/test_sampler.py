"""The sampler: greedy rows take the first highest logit, whether every row is greedy (one
argmax over the whole step) or only some are; a seeded row draws the same token either way."""

import torch

from varlen.request import Request
from varlen.sampler import Sampler
from varlen.sampling_params import SamplingParams


def _req(i: int, sp: SamplingParams) -> Request:
    return Request(f"r{i}", [1, 2, 3], sampling=sp)


def test_all_greedy_and_mixed_steps_pick_the_same_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, [7, 30]] = 100.0  # a tie: the first index wins, as argmax of that row alone
    want = [int(row.argmax()) for row in logits]
    assert want[2] == 7
    greedy = [_req(i, SamplingParams(temperature=0)) for i in range(6)]
    assert Sampler().sample(logits, greedy) == want
    seeded = SamplingParams(temperature=0.8, seed=3)
    mixed = [*greedy[:3], _req(3, seeded), *greedy[4:]]
    got = Sampler().sample(logits, mixed)
    assert got[:3] == want[:3] and got[4:] == want[4:]
    alone = Sampler().sample(logits[3:4], [_req(3, seeded)])
    assert got[3] == alone[0]


def test_argmax_rows_is_torch_argmax_ties_nan_and_dtypes_included():
    from varlen.sampler import argmax_rows

    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=g)
    x[0, [4, 200]] = float("nan")  # the first NaN, as torch.argmax answers
    x[1, [10, 20]] = float("inf")
    x[2, :] = -float("inf")
    x[3, [3, 7]] = 50.0
    x[4, :] = 0.0
    for t in (x, x.double(), x.bfloat16(), x[:, ::2], x.t().contiguous().t(), x.requires_grad_(True)):
        assert argmax_rows(t) == t.detach().argmax(-1).tolist()
    assert argmax_rows(x)[:5] == [4, 10, 0, 3, 0]
