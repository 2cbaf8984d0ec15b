"""One engine loop shared by every caller of an LLM: requests submitted from any thread are batched
together, and each caller waits on, or streams, its own. Only the loop's thread touches the engine;
it ends when nothing is left to serve, so an idle LLM holds no thread.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
import time
from typing import AsyncGenerator, AsyncIterator, Callable, Generic, Iterator, Sequence, TypeVar

from varlen.engine import Engine, _error_message
from varlen.request import FinishReason, Request
from varlen.steplog import StepLog

#: Arrival offsets past this are refused: a typo like 1e9 would keep the loop asleep for decades.
MAX_ARRIVAL_S = 24 * 3600.0

Out = TypeVar("Out")
ToOutput = Callable[[Request, int, bool], Out]
#: Called on the loop's thread after a step gave the request tokens: a message ends it `stop`.
StopCheck = Callable[[Request], "str | None"]


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

    def __init__(self, loop: EngineLoop, request: Request, to_output: ToOutput[Out],
                 stop_check: StopCheck | None = None):
        self.request = request
        self.error: BaseException | None = None
        self._loop, self._to_output, self._stop_check = loop, to_output, stop_check
        self._tokens = 0  # output tokens published by the loop (the request's list may be ahead)
        self._done = False
        self._call: object = self  # requests submitted together end together when a step fails
        self._listeners: list[Callable[[], None]] = []  # called (loop thread, lock held) on news

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

    def add_listener(self, wake: Callable[[], None]) -> None:
        """Call `wake()` whenever this request has new tokens or ends: on the loop's thread with its
        lock held, so it must only signal (e.g. asyncio's call_soon_threadsafe)."""
        with self._loop.cond:
            self._listeners.append(wake)

    def remove_listener(self, wake: Callable[[], None]) -> None:
        with self._loop.cond:
            if wake in self._listeners:
                self._listeners.remove(wake)

    def state(self) -> tuple[int, bool]:
        """(output tokens published, ended) as the loop last published them."""
        with self._loop.cond:
            return self._tokens, self._done

    async def __aiter__(self) -> AsyncIterator[Out]:
        """As iterating, for an asyncio task: waits without holding a thread."""
        async for _ in wait_async([self]):
            tokens, done = self.state()
            yield self._to_output(self.request, tokens, done)


async def wait_async(streams: Sequence[RequestStream]) -> AsyncGenerator[None, None]:
    """Yields once at once, then each time one of `streams` has news, until all have ended."""
    aloop = asyncio.get_running_loop()
    news = asyncio.Event()

    def wake() -> None:
        try:
            aloop.call_soon_threadsafe(news.set)
        except RuntimeError:  # the event loop has closed: no one is waiting any more
            pass

    for s in streams:
        s.add_listener(wake)
    try:
        seen: list[tuple[int, bool]] = []
        while True:
            news.clear()
            now = [s.state() for s in streams]
            if now != seen:
                seen = now
                yield None
                if all(done for _, done in now):
                    return
                continue
            await news.wait()
    finally:
        for s in streams:
            s.remove_listener(wake)


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

    def submit(self, reqs: Sequence[Request], to_output: ToOutput[Out] | Sequence[ToOutput[Out]],
               stop_checks: Sequence[StopCheck | None] | None = None) -> list[RequestStream[Out]]:
        """Queue `reqs` (`arrival`: seconds from now); a bad arrival ends `rejected` here. `to_output`:
        one for all requests or one each; `stop_checks`: one each (None: no check)."""
        now = self.engine.clock.now()
        outs = list(to_output) if isinstance(to_output, Sequence) else [to_output] * len(reqs)
        checks = list(stop_checks) if stop_checks is not None else [None] * len(reqs)
        if len(outs) != len(reqs) or len(checks) != len(reqs):
            raise ValueError(f"{len(reqs)} requests with {len(outs)} output makers and {len(checks)} stop checks")
        streams = [RequestStream(self, r, o, c) for r, o, c in zip(reqs, outs, checks)]
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
                    for wake in s._listeners:
                        wake()
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
            self._check_stops()
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
            live = self._live.get(req_id)
            if live is not None and not live.request.is_finished:
                live.request.finish(FinishReason.ABORTED, self.engine.clock.now(),
                                    f"{message} ({_error_message('abort', err)})")

    def _stop_calls_of_failed(self, err: BaseException) -> None:
        """A step failed: the requests submitted with its requests end `aborted` too; others go on."""
        with self.cond:
            live = list(self._live.values())
        failed = {id(s._call) for s in live if s.request.is_finished and s.request.finish_reason is FinishReason.ABORTED}
        for s in live:
            if id(s._call) in failed and not s.request.is_finished:
                self._abort(s.request_id, _error_message("the run stopped", err))

    def _check_stops(self) -> None:
        """Stop strings: a request whose new text holds one ends `stop` before the next step (one that
        just ended `length` becomes `stop`), so it never computes a token past it."""
        for s in list(self._live.values()):
            r = s.request
            check = s._stop_check
            if check is None or len(r.output_token_ids) <= s._tokens or \
                    r.finish_reason in (FinishReason.ABORTED, FinishReason.REJECTED):
                continue
            message = check(r)
            if message is None:
                continue
            if not r.is_finished:
                self.engine._finish(r, FinishReason.STOP, message)  # as a stop token would: KV freed now
            else:
                r.finish_reason, r.finish_message = FinishReason.STOP, message

    def _publish(self, error: BaseException | None) -> None:
        """Tell the callers what the step produced; `error`: the step raised it."""
        with self.cond:
            for req_id, s in list(self._live.items()):
                r = s.request
                tokens = len(r.output_token_ids)
                news = tokens != s._tokens or r.is_finished
                s._tokens = tokens
                if r.is_finished:
                    if error is not None and r.finish_reason is FinishReason.ABORTED and s.error is None:
                        s.error = error
                    s._done = True
                    del self._live[req_id]
                if news:
                    for wake in s._listeners:
                        wake()
            self.cond.notify_all()
