"""Scheduler policies, by name (the same names as `conf/scheduler/*.yaml`)."""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built

from schedulers.base import SchedulerOutput, SchedulerPolicy
from schedulers.chunked import ChunkedPolicy
from schedulers.continuous import ContinuousPolicy
from schedulers.priority import PriorityPolicy
from schedulers.static import StaticPolicy

POLICIES: dict[str, type[SchedulerPolicy]] = {
    "static": StaticPolicy, "continuous": ContinuousPolicy, "chunked": ChunkedPolicy, "priority": PriorityPolicy,
}

__all__ = ["SchedulerOutput", "SchedulerPolicy", "POLICIES", *(c.__name__ for c in POLICIES.values())]
