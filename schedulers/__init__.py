"""Scheduler policies. They are named only by `conf/scheduler/<name>.yaml` (varlen/registry.py):
`registry.build("scheduler", "chunked", max_num_seqs=8)`, `registry.names("scheduler")`."""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built

from schedulers.base import SchedulerOutput, SchedulerPolicy
from schedulers.chunked import ChunkedPolicy
from schedulers.continuous import ContinuousPolicy
from schedulers.priority import PriorityPolicy
from schedulers.sarathi import SarathiPolicy
from schedulers.static import StaticPolicy
from schedulers.vllm_v0 import VllmV0Policy

__all__ = ["SchedulerOutput", "SchedulerPolicy", "ChunkedPolicy", "ContinuousPolicy", "PriorityPolicy", "SarathiPolicy",
           "StaticPolicy", "VllmV0Policy"]
