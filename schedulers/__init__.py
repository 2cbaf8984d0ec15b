"""Scheduler policies, by name (the same names as `conf/scheduler/*.yaml`)."""

from schedulers.base import SchedulerOutput, SchedulerPolicy
from schedulers.chunked import ChunkedPolicy
from schedulers.continuous import ContinuousPolicy
from schedulers.priority import PriorityPolicy
from schedulers.static import StaticPolicy

POLICIES: dict[str, type[SchedulerPolicy]] = {
    "static": StaticPolicy, "continuous": ContinuousPolicy, "chunked": ChunkedPolicy, "priority": PriorityPolicy,
}

__all__ = ["SchedulerOutput", "SchedulerPolicy", "POLICIES", *(c.__name__ for c in POLICIES.values())]
