"""A router's answer, checked where it enters the simulator (colocated and disaggregated alike)."""

from __future__ import annotations

from typing import Any


def check_route(router: Any, value: object, n: int) -> int:
    """`value`, a router's pick among `n` replicas, as the int index it must be; else one line naming
    the router and the value (a bool, float, None or out-of-range index would pick silently or fail later)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
        return int(value)
    name = getattr(router, "__qualname__", None) or type(router).__name__
    raise ValueError(f"router {name} returned {value!r}; a router returns a replica index in [0, {n})")
