"""What `Engine.submit` returns: a request's stream of `TokenEvent`s, for threads and asyncio.

The engine's step thread `push`es events; a client iterates them, blocking
(`for event in handle`) or awaiting (`async for event in handle`), or reads
them all at once (`handle.result()`). The stream ends after the event whose
`finish_reason` is set. `cancel()` asks the engine to end the request at its
next step (its pages are freed then; the last event says CANCELLED).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Callable, Optional

from jaxformer.serve.request import FinishReason, Request, TokenEvent


class Handle:
    """One submitted request's events (thread-safe)."""

    def __init__(self, request: Request, request_id: str, on_cancel: Callable[[str], None]):
        self.request, self.request_id = request, request_id
        self.finish_reason: Optional[FinishReason] = None
        self.error: Optional[str] = None           # what went wrong, with FinishReason.ERROR
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._cond = threading.Condition()
        self._waker: Optional[Callable[[], None]] = None
        self._on_cancel = on_cancel

    # -- the engine's side --------------------------------------------------

    def push(self, event: TokenEvent) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return  # already ended: nothing after the last event
            self._events.append(event)
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
            self._cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    # -- the client's side --------------------------------------------------

    def cancel(self) -> None:
        """End the request at the engine's next step (no effect once it ended)."""
        if not self.done:
            self._on_cancel(self.request_id)

    def get(self, timeout: Optional[float] = None) -> Optional[TokenEvent]:
        """The next event, waiting up to `timeout` seconds (None: forever); None when
        the stream has ended and is read, or on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events or self._drained(), timeout):
                return None
            return self._events.popleft() if self._events else None

    def _drained(self) -> bool:
        return self.finish_reason is not None and not self._events

    def __iter__(self):
        while True:
            event = self.get()
            if event is None:
                return
            yield event
            if event.finish_reason is not None:
                return

    async def _aiter(self):
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        with self._cond:
            self._waker = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            while True:
                ready.clear()
                with self._cond:
                    event = self._events.popleft() if self._events else None
                    ended = self._drained()
                if event is not None:
                    yield event
                    if event.finish_reason is not None:
                        return
                elif ended:
                    return
                else:
                    await ready.wait()
        finally:
            with self._cond:
                self._waker = None

    def __aiter__(self):
        return self._aiter()

    def result(self, timeout: Optional[float] = None) -> list[TokenEvent]:
        """Every event, once the request has ended (TimeoutError after `timeout` s)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.request_id} still running after {timeout} s")
            events = list(self._events)
            self._events.clear()
        return events
