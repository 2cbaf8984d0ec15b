"""One engine loop shared by every caller of an LLM: requests submitted from any thread are batched
together, and each caller waits on, or streams, its own. Only the loop's thread touches the engine;
it ends when nothing is left to serve, so an idle LLM holds no thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from typing import Callable, Generic, Iterator, Sequence, TypeVar

from varlen.engine import Engine, _error_message
from varlen.request import FinishReason, Request
from varlen.steplog import StepLog

#: Arrival offsets past this are refused: a typo like 1e9 would keep the loop asleep for decades.
MAX_ARRIVAL_S = 24 * 3600.0

Out = TypeVar("Out")


def arrival_problem(arrival: float) -> str:
    """Why an arrival offset (seconds after its submission) is refused; "" if it is fine."""
    if not math.isfinite(arrival) or arrival < 0:
        return f"arrival={arrival}: must be a finite time >= 0 (seconds after submission, 0 = at once)"
    if arrival > MAX_ARRIVAL_S:
        return (f"arrival={arrival}: more than {MAX_ARRIVAL_S:.0f} s (one day) after submission; "
                f"give seconds, not a timestamp")
    return ""


class RequestStream(Generic[Out]):
    """A submitted request: wait for its result, stream its outputs, or abort it (`error`: a failed step's)."""

    def __init__(self, loop: EngineLoop, request: Request, to_output: Callable[[Request, int, bool], Out]):
        self.request = request
        self.error: BaseException | None = None
        self._loop, self._to_output = loop, to_output
        self._tokens = 0  # output tokens published by the loop (the request's list may be ahead)
        self._done = False
        self._call: object = self  # requests submitted together end together when a step fails

    @property
    def request_id(self) -> str:
        return self.request.req_id

    def done(self) -> bool:
        return self._done

    def abort(self, message: str = "aborted by the caller") -> None:
        self._loop.abort(self.request_id, message)

    def result(self, timeout: float | None = None) -> Out:
        """The final output; raises TimeoutError if the request has not ended within `timeout` s."""
        if not self._loop.wait([self], timeout=timeout):
            raise TimeoutError(f"request {self.request_id!r} has not ended within {timeout} s")
        return self._to_output(self.request, len(self.request.output_token_ids), True)

    def __iter__(self) -> Iterator[Out]:
        """An output each time the request has new tokens (all of them so far); the last one is final."""
        seen = 0
        cond = self._loop.cond
        while True:
            with cond:
                while self._tokens == seen and not self._done:
                    cond.wait()
                seen, done = self._tokens, self._done
            yield self._to_output(self.request, seen, done)
            if done:
                return


class EngineLoop:
    """Serves the requests submitted by any thread on one engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cond = threading.Condition()
        self._inbox: list[RequestStream] = []
        self._aborts: list[tuple[str, str]] = []
        self._live: dict[str, RequestStream] = {}  # submitted, not ended
        self._pending: list[tuple[float, int, RequestStream]] = []  # not yet arrived (heap); loop thread only
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def submit(self, reqs: Sequence[Request], to_output: Callable[[Request, int, bool], Out]) -> list[RequestStream[Out]]:
        """Queue `reqs` (`arrival`: seconds from now); a bad arrival ends `rejected` here."""
        now = self.engine.clock.now()
        streams = [RequestStream(self, r, to_output) for r in reqs]
        call = object()
        for s in streams:
            s._call = call
        with self.cond:
            ids = [r.req_id for r in reqs]
            dup = next((i for i in ids if i in self._live), None) or \
                next((i for i in ids if ids.count(i) > 1), None)
            if dup is not None:
                raise ValueError(f"duplicate request id {dup!r} (an unfinished request has it)")
            for s in streams:
                r = s.request
                problem = arrival_problem(r.arrival)
                if problem:
                    r.finish(FinishReason.REJECTED, now, f"request {r.req_id!r}: {problem}")
                    s._done = True
                    continue
                r.arrival = now + r.arrival
                self._live[r.req_id] = s
                self._inbox.append(s)
            if self._thread is None and self._inbox:
                self._thread = threading.Thread(target=self._serve, name="varlen-engine-loop", daemon=True)
                self._thread.start()
            self.cond.notify_all()
        return streams

    def abort(self, req_id: str, message: str = "aborted by the caller") -> None:
        """End request `req_id` `aborted` (its KV freed) after the current step; a no-op if it has ended."""
        with self.cond:
            if req_id in self._live:
                self._aborts.append((req_id, message))
                self.cond.notify_all()

    def wait(self, streams: Sequence[RequestStream], timeout: float | None = None,
             on_done: Callable[[int], None] | None = None) -> bool:
        """Until every stream has ended (True) or `timeout` s pass (False); `on_done(n)` as n more end."""
        counted = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                done = sum(s._done for s in streams)
                if on_done is not None and done > counted:
                    on_done(done - counted)
                counted = done
                if done == len(streams):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)

    def _serve(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # a bug outside a step: no caller may wait forever
            with self.cond:
                self._thread = None
                for s in [*self._live.values(), *(p[2] for p in self._pending)]:
                    if not s.request.is_finished:
                        s.request.finish(FinishReason.ABORTED, self.engine.clock.now(),
                                         _error_message("the engine loop failed", err))
                    s.error, s._done = err, True
                self._live.clear()
                self._pending.clear()
                self.cond.notify_all()
            raise

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self.cond:
                if not self._inbox and not self._aborts and not self._pending and not eng.has_unfinished():
                    self._thread = None
                    return
                if not eng.has_unfinished() and not eng.requests and not self._pending:
                    eng.steps = StepLog()  # `engine.steps`: the steps since the loop was last idle
                for s in self._inbox:
                    heapq.heappush(self._pending, (s.request.arrival, next(self._order), s))
                self._inbox.clear()
                aborts, self._aborts = self._aborts, []
            for req_id, message in aborts:
                self._abort(req_id, message)
            now = eng.clock.now()
            while self._pending and self._pending[0][0] <= now:
                self._add(heapq.heappop(self._pending)[2], now)
            error = None
            if eng.has_unfinished():
                try:
                    eng.step(now)
                except BaseException as err:  # the step's requests ended aborted with it; the loop goes on
                    error = err
                    self._stop_calls_of_failed(err)
            self._publish(error)
            if not eng.has_unfinished() and self._pending:
                with self.cond:
                    if not self._inbox and not self._aborts:
                        self.cond.wait(max(0.0, self._pending[0][0] - eng.clock.now()))

    def _add(self, s: RequestStream, now: float) -> None:
        try:
            self.engine.add_request(s.request, now)
        except BaseException as err:  # a policy's add() raising: this request alone ends
            if not s.request.is_finished:
                self.engine.abort(s.request.req_id, _error_message("could not be queued", err))
            if not s.request.is_finished:
                s.request.finish(FinishReason.ABORTED, now, _error_message("could not be queued", err))
            s.error = err

    def _abort(self, req_id: str, message: str) -> None:
        for i, (_, _, s) in enumerate(self._pending):
            if s.request_id == req_id:  # not arrived yet: it never reached the engine
                self._pending.pop(i)
                heapq.heapify(self._pending)
                s.request.finish(FinishReason.ABORTED, max(self.engine.clock.now(), s.request.arrival), message)
                return
        try:
            self.engine.abort(req_id, message)
        except BaseException as err:  # a policy's remove() raising: the request still ends
            s = self._live.get(req_id)
            if s is not None and not s.request.is_finished:
                s.request.finish(FinishReason.ABORTED, self.engine.clock.now(), f"{message} ({_error_message('abort', err)})")

    def _stop_calls_of_failed(self, err: BaseException) -> None:
        """A step failed: the requests submitted with its requests end `aborted` too; others go on."""
        with self.cond:
            live = list(self._live.values())
        failed = {id(s._call) for s in live if s.request.is_finished and s.request.finish_reason is FinishReason.ABORTED}
        for s in live:
            if id(s._call) in failed and not s.request.is_finished:
                self._abort(s.request_id, _error_message("the run stopped", err))

    def _publish(self, error: BaseException | None) -> None:
        """Tell the callers what the step produced; `error`: the step raised it."""
        with self.cond:
            for req_id, s in list(self._live.items()):
                r = s.request
                s._tokens = len(r.output_token_ids)
                if r.is_finished:
                    if error is not None and r.finish_reason is FinishReason.ABORTED and s.error is None:
                        s.error = error
                    s._done = True
                    del self._live[req_id]
            self.cond.notify_all()
