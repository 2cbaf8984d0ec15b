"""A simulation's requests released as they end (simulate(keep_requests=False)): each ended
request's figures go into a RequestResults row and its slot in the arrival list is given a shared
placeholder (a TraceRequests, varlen/workload.py, drops it), so memory holds the requests in flight,
not every request of the run."""

from __future__ import annotations

from itertools import compress
from operator import attrgetter
from typing import Callable, MutableSequence, Sequence

import numpy as np

from varlen.metrics import RequestResults
from varlen.request import FinishReason, Request

#: Put where an ended request was: finished, so whatever walks the list later skips it.
RELEASED = Request("<released>", [])
RELEASED.finish(FinishReason.ABORTED, 0.0, "released: its figures are in the run's RequestResults")


class Release:
    """Folds ended requests of `pending` (arrival order) into `results`, row = the request's index in
    `requests` (the caller's order), and releases them from both."""

    def __init__(self, requests: Sequence[Request], pending: Sequence[Request], order: np.ndarray | None) -> None:
        # The caller's sequence is released too where it can be: a list, or a TraceRequests.
        self.requests = requests if isinstance(requests, list) or hasattr(requests, "release") else pending
        self.pending, self.order = pending, order
        self.results = RequestResults(len(pending))
        self.held: list[int] = []  # positions that had arrived and not ended at the last fold
        self.seen = 0  # positions below this have arrived

    def fold(self, arrived: int, force: bool = False) -> None:
        """Look at the `arrived` first positions; amortised: only once the new arrivals are as many as the
        requests held at the last fold (each fold reads those again), so a request is read about twice."""
        if not force and arrived - self.seen < max(len(self.held), 256):
            return
        positions = self.held + list(range(self.seen, arrived))
        reqs = _read(self.pending, positions)
        keep: list[int] = []
        ended, ended_reqs = positions, reqs
        if not force:
            finished = list(map(_FINISHED, reqs))
            if not all(finished):
                ended, ended_reqs = list(compress(positions, finished)), list(compress(reqs, finished))
                keep = [p for p, f in zip(positions, finished) if not f]
        rows = ended if self.order is None else self.order[ended].tolist()
        _release(self.pending, ended)
        if self.requests is not self.pending:
            _release(self.requests, rows)
        self.results.add(rows, ended_reqs)
        self.held, self.seen = keep, arrived

    def ticker(self, progress: Callable[[float, int, list], None] | None) -> Callable[[float, int, list], None]:
        """The event loop's progress callback (every 1,024 events), folding first."""
        def tick(t: float, i: int, replicas: list) -> None:
            self.fold(i)
            if progress is not None:
                progress(t, i, replicas)
        return tick

    def close(self) -> RequestResults:
        """Every request folded: the run is over."""
        self.fold(len(self.pending), force=True)
        return self.results


_FINISHED = attrgetter("is_finished")


def _read(requests: Sequence[Request], positions: list[int]) -> list[Request]:
    read = getattr(requests, "read", None)  # a TraceRequests: its requests in flight at once
    return read(positions) if read is not None else [requests[p] for p in positions]


def _release(requests: Sequence[Request], positions: list[int]) -> None:
    release_all = getattr(requests, "release_all", None)
    release = getattr(requests, "release", None)
    if release_all is not None:
        release_all(positions, RELEASED)
    elif release is not None:
        for p in positions:
            release(p, RELEASED)
    else:
        assert isinstance(requests, MutableSequence)
        for p in positions:
            requests[p] = RELEASED


def arrival_order(requests: Sequence[Request]) -> tuple[Sequence[Request], np.ndarray | None]:
    """(the requests in arrival order, each one's index in `requests` or None where that is the order).
    A list or a TraceRequests already in order is returned as it is (a TraceRequests unbuilt)."""
    arrivals = getattr(requests, "arrivals", None)
    if arrivals is None:
        arrivals = np.fromiter((r.arrival for r in requests), np.float64, len(requests))
    if (isinstance(requests, list) or hasattr(requests, "release")) and not (arrivals[1:] < arrivals[:-1]).any():
        return requests, None
    order = np.argsort(arrivals, kind="stable")
    return [requests[j] for j in order.tolist()], order
