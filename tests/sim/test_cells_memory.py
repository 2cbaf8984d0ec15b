"""The cells' merge in bounded memory (sim/cells.py, issue 26): each cell's output is placed into the
fleet's columns as the cell ends and dropped, so a fleet split into cells peaks near the same fleet
run whole. Counted, not timed: how many cell outputs are alive when the next one is merged, and
that a merged replica's steps are its columns (no object per step)."""

from __future__ import annotations

import gc
import importlib.machinery
import pickle
import sys
import weakref

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sim.cells as cells
from sim.run import CONF, _simulate_paused
from varlen.metrics import request_table

SMALL = ["workload=synthetic", "workload.limit=120", "workload.rate=30", "engine.num_blocks=400",
         "cluster.router=round_robin", "cluster.replicas=2", "cluster.cells=3"]
TOKEN_MODES = pytest.mark.parametrize("tokens", [[], ["output.token_times=true"]], ids=["columns", "token_times"])


def config(*overrides: str):
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose("sim", overrides=list(overrides))


@pytest.fixture
def merged_outputs(monkeypatch):
    """Every CellOutput the merge is given (weakly), and at each add how many earlier ones are still alive."""
    added: list[weakref.ref] = []
    alive_at_add: list[int] = []
    add = cells.Merge.add

    def counting_add(self, out):
        gc.collect()
        alive_at_add.append(sum(r() is not None for r in added))
        added.append(weakref.ref(out))
        return add(self, out)

    monkeypatch.setattr(cells.Merge, "add", counting_add)
    return added, alive_at_add


class Ref:  # an ObjectRef: hashable by identity
    def __init__(self, fn, args):
        self.fn, self.args = fn, args


class FakeRay:
    """Ray's calls that sim.cells makes, in this process: a task runs when its result is read, its result
    crosses by pickle (as Ray's store would carry it), and the tasks end in reverse order."""

    def __init__(self):
        self.read: list[int] = []
        self.__spec__ = importlib.machinery.ModuleSpec("ray", None)  # found as installed (check_cells asks)

    def is_initialized(self):
        return True

    def remote(self, **_options):
        def wrap(fn):
            class Task:
                @staticmethod
                def remote(*args):
                    return Ref(fn, args)
            return Task
        return wrap

    def put(self, value):
        return value

    def wait(self, pending, num_returns, timeout):
        return [pending[-1]], pending[:-1]  # the last cell first: merged out of order

    def get(self, ref):
        self.read.append(ref.args[1])
        return pickle.loads(pickle.dumps(ref.fn(*ref.args)))

    def kill(self, _actor):
        pass


@TOKEN_MODES
def test_local_cells_are_merged_one_at_a_time_and_not_kept(tokens, merged_outputs):
    added, alive_at_add = merged_outputs
    res, row, _ = _simulate_paused(config(*SMALL, *tokens), None, False)
    gc.collect()
    assert len(added) == 3 and row["requests"] == 120
    assert alive_at_add == [0, 0, 0]  # the cell before was dropped once merged
    assert all(r() is None for r in added)  # the fleet's result holds no cell output
    for rep in res.replicas:  # steps kept as the summary reads them: columns, no record per step
        log = rep.engine.steps
        assert not log.keep and not log.entries and len(log) == len(log.columns(tokens=False)["start"]) > 0


@TOKEN_MODES
def test_cells_merged_as_ray_returns_them_equal_the_cells_merged_in_order(tokens, merged_outputs, monkeypatch):
    """_run_ray merges each cell as Ray hands it back, in whatever order, and holds none of them: the
    result is the in-order merge's, request for request and figure for figure."""
    added, alive_at_add = merged_outputs
    local, row_local, lat_local = _simulate_paused(config(*SMALL, *tokens), None, False)
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    ray, row_ray, lat_ray = _simulate_paused(config(*SMALL, *tokens, "cluster.cells_on=ray"), None, False)
    gc.collect()
    assert fake.read == [2, 1, 0]
    assert alive_at_add == [0] * 6 and all(r() is None for r in added)
    pd.testing.assert_frame_equal(request_table(ray.requests, lat_ray), request_table(local.requests, lat_local),
                                  check_exact=True)
    assert ray.routed == local.routed
    timed = {"sim_wall_s", "sim_requests_per_wall_s"}
    assert {k: v for k, v in row_ray.items() if k not in timed} == {k: v for k, v in row_local.items() if k not in timed}
    assert [r.index for r in ray.replicas] == [r.index for r in local.replicas] == list(range(6))
    for a, b in zip(ray.replicas, local.replicas):
        ca, cb = a.engine.steps.columns(tokens=False), b.engine.steps.columns(tokens=False)
        assert all(np.array_equal(ca[k], cb[k]) for k in cb)


def test_a_share_covered_twice_or_not_at_all_is_an_error():
    """The merge checks the cells' shares cover the trace exactly once, cell by cell."""
    cfg = OmegaConf.to_container(config(*SMALL), resolve=True)
    out = cells.run_cell(cfg, 0, None, _simulate_paused)
    m = cells.Merge()
    m.add(out)
    with pytest.raises(RuntimeError, match="do not cover it exactly once"):
        m.add(out)  # the same share again
    with pytest.raises(RuntimeError, match="do not cover it exactly once"):
        m.result(1.0)  # cells 1 and 2 missing
