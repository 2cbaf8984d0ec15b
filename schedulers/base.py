"""Deprecated import path: the scheduling interface lives in `varlen.scheduler_api`. An old name
still resolves here, with a DeprecationWarning naming its home."""

from __future__ import annotations

import warnings
from typing import Any

NAMES = ("DECODE_PROMISE_BEHAVIOUR", "SchedulerOutput", "SchedulerPolicy", "WaitingQueue")


def moved(old: str, name: str) -> Any:
    """`name` from varlen.scheduler_api, with a warning that `old` no longer holds it."""
    if name not in NAMES:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    warnings.warn(f"import {name} from varlen.scheduler_api: {old}.{name} is deprecated", DeprecationWarning,
                  stacklevel=3)
    from varlen import scheduler_api

    return getattr(scheduler_api, name)


def __getattr__(name: str) -> Any:
    return moved(__name__, name)
