"""SchedulerOutput carries a shipped policy's leading decodes in bulk; every reader of `scheduled` (an
engine, a user's policy editing it after super().schedule(), a list read before the decodes were
granted) still sees exactly the whole batch, in order."""

from __future__ import annotations

import pytest

from schedulers import ChunkedPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from varlen.clock import SimClock
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.scheduler_api import SchedulerOutput


def decoding(policy_cls=ChunkedPolicy):
    """A fused sim engine whose three requests have finished their prompts (next step: three decodes)
    and a fourth just arrived (its prompt chunk follows the decodes)."""
    clock = SimClock()
    ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
    pol = policy_cls(max_num_seqs=8, max_num_batched_tokens=64)
    eng = FastForwardEngine(pol, PagedAllocator(64, 16, 256), ex, clock=clock, max_model_len=256)
    reqs = [Request(f"r{i}", list(range(1, 9 + i)), SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # the three prompts in one step; each sampled its first token
    assert all(r.num_pending == 1 for r in reqs)
    late = Request("late", list(range(1, 12)), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.add_request(late)
    return eng, reqs, late


def test_the_batch_reads_as_the_list_of_request_and_tokens():
    eng, reqs, late = decoding()
    pol = eng.policy
    out = pol.schedule(eng.kv)
    assert out.decodes is not None  # the shipped policy handed its decodes over in bulk
    assert bool(out) and out.num_tokens == 3 + 11
    batch = out.scheduled
    assert [(r.req_id, n) for r, n in batch] == [("r0", 1), ("r1", 1), ("r2", 1), ("late", 11)]
    assert out.scheduled is batch and out.decodes is None  # read once, the same list from then on
    assert out == SchedulerOutput(list(batch), [])


def test_a_list_read_before_the_decodes_were_granted_is_the_batch():
    class EarlyReader(ChunkedPolicy):
        def schedule(self, kv):
            out = SchedulerOutput()
            self.seen = out.scheduled  # read before _schedule_running fills it
            budget = self._schedule_running(kv, out, self.max_num_batched_tokens)
            self._admit_waiting(kv, out, budget)
            return out

    eng, reqs, late = decoding(EarlyReader)
    eng.step()
    assert [(r.req_id, n) for r, n in eng.policy.seen] == [("r0", 1), ("r1", 1), ("r2", 1), ("late", 11)]


def test_a_policy_editing_the_batch_after_super_runs_exactly_its_edit():
    """A user's policy reads and edits out.scheduled in place after the shipped schedule(): the engine
    runs the edited batch (r1 dropped, late's chunk cut to 4 tokens), nothing of the bulk decodes."""

    class Editing(ChunkedPolicy):
        def schedule(self, kv):
            out = super().schedule(kv)
            batch = out.scheduled
            if batch[-1][0].req_id == "late":  # the step after the prompts
                del batch[1]
                batch[-1] = (batch[-1][0], 4)
            return out

    eng, (r0, r1, r2), late = decoding(Editing)
    before = [r.num_computed_tokens for r in (r0, r1, r2)]
    eng.step()
    assert [r.num_computed_tokens - b for r, b in zip((r0, r1, r2), before)] == [1, 0, 1]
    assert late.num_computed_tokens == 4
    assert [len(r.output_token_ids) for r in (r0, r1, r2)] == [2, 1, 2]
    rec = eng.steps[-1]
    assert rec.req_ids == ["r0", "r2", "late"] and rec.new_tokens == [1, 1, 4] and rec.num_sampled == 2


def test_a_step_that_fails_aborts_the_bulk_decodes_too():
    """The batch a failed step ends `aborted` includes the decodes handed over in bulk."""

    class FailingOnce(ChunkedPolicy):
        failed = False

        def remove(self, req):
            if not self.failed:
                self.failed = True
                raise RuntimeError("boom")
            super().remove(req)

    eng, (r0, r1, r2), late = decoding(FailingOnce)
    r0.sampling = SamplingParams(max_tokens=2, ignore_eos=True)  # ends in this step: remove() raises
    with pytest.raises(RuntimeError, match="boom"):
        eng.step()
    assert all(r.is_finished and "boom" in r.finish_message for r in (r1, r2, late))
