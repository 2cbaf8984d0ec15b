"""Turns the step's logits [M, vocab] into one token per row, honouring each request's SamplingParams."""

from __future__ import annotations

from typing import Sequence

import torch

from varlen.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self.default = torch.Generator().manual_seed(seed)
        # Per seeded request, kept across preemptions: a recomputed request draws the same tokens.
        self.generators: dict[str, torch.Generator] = {}

    def release(self, req: Request) -> None:
        if req.is_finished:
            self.generators.pop(req.req_id, None)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        tokens = self._choose(logits, reqs)
        for i, r in enumerate(reqs):
            if r.sampling.logprobs is not None:
                r.output_logprobs.append(token_logprobs(logits[i], tokens[i], r.sampling.logprobs))
        return tokens

    def _choose(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
        if len(greedy) == len(reqs):  # all greedy: no copy of the rows
            return argmax_rows(logits)
        tokens: list[int] = [0] * len(reqs)
        if greedy:
            for i, t in zip(greedy, argmax_rows(logits[greedy])):
                tokens[i] = t
        for i, r in enumerate(reqs):
            if not r.sampling.greedy:
                tokens[i] = self._sample_one(logits[i], r)
        return tokens

    def _sample_one(self, row: torch.Tensor, r: Request) -> int:
        sp = r.sampling
        row = row.float() / sp.temperature
        if sp.top_k and sp.top_k < row.shape[-1]:
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if sp.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the token that crosses it included).
            drop = sorted_p.cumsum(-1) - sorted_p >= sp.top_p
            probs = probs.scatter(0, order[drop], 0.0)
        gen = self.default
        if sp.seed is not None:
            gen = self.generators.get(r.req_id)
            if gen is None:
                gen = self.generators[r.req_id] = torch.Generator().manual_seed(sp.seed)
        return int(torch.multinomial(probs, 1, generator=gen).item())


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its first highest logit (NaN highest, as torch.argmax); numpy's argmax
    on CPU float32, several times faster than torch's with one thread."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return (logits.detach() if logits.requires_grad else logits).numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def token_logprobs(row: torch.Tensor, token: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """`token`'s logprob and rank (1 = the most likely) and the top-k (ids, logprobs), from the row of
    logits the token was chosen from, in fp32: the model's distribution, before temperature or cuts."""
    lp = row.detach().float().log_softmax(-1)
    chosen = lp[token]
    rank = int((lp > chosen).sum()) + 1
    if k == 0:
        return float(chosen), rank, [], []
    top = torch.topk(lp, min(k, lp.shape[-1]))
    return float(chosen), rank, top.indices.tolist(), top.values.tolist()
