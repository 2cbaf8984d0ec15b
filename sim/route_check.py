"""The check on a router's answer (sim/routers.py), where it enters the simulator: colocated
(sim/simulator.py) and disaggregated (sim/disagg.py) paths call `check_route` on every return."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def router_name(router: Any) -> str:
    """`module.Name` of a router function, or of a router object's class."""
    f = router if hasattr(router, "__qualname__") else type(router)
    return f"{getattr(f, '__module__', '?')}.{f.__qualname__}"


def check_route(router: Any, value: Any, n: int) -> int:
    """`value`, which `router` returned, as a replica index in [0, n); else a one-line ValueError
    naming the router and the value (an index such as -1 or True would pick a replica silently)."""
    if type(value) is int and 0 <= value < n:  # the usual answer, checked at once
        return value
    index: int | None = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            index = operator.index(value)  # numpy integers too (np.argmin's answer)
        except TypeError:
            pass
    if index is None or not 0 <= index < n:
        raise ValueError(f"router {router_name(router)} returned {value!r} ({type(value).__name__}); a router "
                         f"returns the index of one of the {n} replicas it is given, an int in [0, {n - 1}]")
    return index
