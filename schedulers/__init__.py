"""Scheduler policies, by name (the same names as `conf/scheduler/*.yaml`)."""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built

from schedulers.base import SchedulerOutput, SchedulerPolicy
from schedulers.chunked import ChunkedPolicy
from schedulers.continuous import ContinuousPolicy
from schedulers.priority import PriorityPolicy
from schedulers.sarathi import SarathiPolicy
from schedulers.static import StaticPolicy
from schedulers.vllm_v0 import VllmV0Policy

# The reference systems' names (conf/scheduler/*.yaml cite the behaviour each reproduces): `orca`
# is `continuous`, `fastertransformer` is `static`, under the names papers compare against.
POLICIES: dict[str, type[SchedulerPolicy]] = {
    "static": StaticPolicy, "continuous": ContinuousPolicy, "chunked": ChunkedPolicy, "priority": PriorityPolicy,
    "vllm_v0": VllmV0Policy, "orca": ContinuousPolicy, "sarathi": SarathiPolicy, "fastertransformer": StaticPolicy,
}

__all__ = ["SchedulerOutput", "SchedulerPolicy", "POLICIES", *dict.fromkeys(c.__name__ for c in POLICIES.values())]
