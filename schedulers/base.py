"""The scheduling plug point's interface, as `schedulers.base` has always offered it.

`SchedulerPolicy` and `SchedulerOutput` live in `varlen/scheduler_api.py`, below both the engine
and the policies (README: layers); a policy may import them from either place.
"""

from varlen.scheduler_api import DECODE_PROMISE_BEHAVIOUR, SchedulerOutput, SchedulerPolicy, WaitingQueue

__all__ = ["DECODE_PROMISE_BEHAVIOUR", "SchedulerOutput", "SchedulerPolicy", "WaitingQueue"]
