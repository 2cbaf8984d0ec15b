"""Scheduler policies. They are named only by `conf/scheduler/<name>.yaml` (varlen/registry.py):
`registry.build("scheduler", "chunked", max_num_seqs=8)`, `registry.names("scheduler")`. The
interface is `varlen.scheduler_api`."""

from typing import Any

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built

from schedulers.chunked import ChunkedPolicy  # noqa: E402
from schedulers.continuous import ContinuousPolicy  # noqa: E402
from schedulers.priority import PriorityPolicy  # noqa: E402
from schedulers.sarathi import SarathiPolicy  # noqa: E402
from schedulers.static import StaticPolicy  # noqa: E402
from schedulers.vllm_v0 import VllmV0Policy  # noqa: E402

__all__ = ["ChunkedPolicy", "ContinuousPolicy", "PriorityPolicy", "SarathiPolicy", "StaticPolicy", "VllmV0Policy"]


def __getattr__(name: str) -> Any:
    """The names this package re-exported before (`from schedulers import SchedulerPolicy`): deprecated."""
    if name in ("SchedulerOutput", "SchedulerPolicy"):
        from schedulers.base import moved

        return moved(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
