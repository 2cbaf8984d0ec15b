"""A router's answer is checked where it enters the simulator (sim/route_check.py): a replica
index in [0, n), else one line naming the router and the value."""

from __future__ import annotations

import numpy as np
import pytest

from sim.route_check import check_route
from sim.routers import RoundRobinRouter


def pick_last(replicas, req):
    return len(replicas) - 1


@pytest.mark.parametrize("value, want", [(0, 0), (2, 2), (np.int64(1), 1), (np.intp(2), 2)])
def test_an_index_in_range_is_taken_as_an_int(value, want):
    got = check_route(pick_last, value, 3)
    assert got == want and type(got) is int


@pytest.mark.parametrize("value", [-1, 3, 99, True, False, np.bool_(True), None, 1.0, np.float64(1.0), "1", [0]])
def test_anything_else_is_one_line_naming_the_router_and_the_value(value):
    with pytest.raises(ValueError) as e:
        check_route(RoundRobinRouter(), value, 3)
    msg = str(e.value)
    assert "\n" not in msg and "sim.routers.RoundRobinRouter" in msg and f"returned {value!r}" in msg
    assert "[0, 2]" in msg


def test_a_router_function_is_named_by_its_module_and_name():
    with pytest.raises(ValueError, match=r"router test_route_check\.pick_last returned -1 \(int\)"):
        check_route(pick_last, -1, 2)
