"""A scripted stand-in for the serving engine (its submit/cancel/metrics interface), so
the HTTP layer's tests run without a model: each request streams `reply` as byte
tokens (ByteTokenizer ids, each event's text its character) then a final event
with STOP (EOS, as the engine sends it: no token, the EOS pick in `stopped_by`), every
token with logprob -0.5
and, when asked, the top list ((token, -0.5), (token + 1, -1.5), ...). Stop
strings are the real engine's job (tests/serve/test_serve_model.py)."""

from __future__ import annotations

import asyncio
import threading

from jaxformer.serve import FinishReason, TokenEvent
from jaxformer.serve.request import QueueFull
from jaxformer.text import ByteTokenizer

BYTES = ByteTokenizer()
FAIL_TEXT = "please fail"  # a prompt containing it ends with FinishReason.ERROR


class FakeHandle:
    def __init__(self, engine, request):
        self.engine, self.request, self.cancelled = engine, request, False

    def cancel(self):
        if not self.cancelled:
            self.cancelled = True
            self.engine.release(self)

    def events(self):
        p = self.request.params
        n = p.logprobs or 0
        if p.echo:
            for i, token in enumerate(self.request.prompt_ids):
                yield TokenEvent(int(token), None if i == 0 else -1.0,
                                 () if i == 0 or p.logprobs is None else
                                 tuple((int(token) + k, -1.0 - k) for k in range(max(n, 1))),
                                 text=BYTES.decode([token]), prompt=True)
        if FAIL_TEXT in BYTES.decode(self.request.prompt_ids):
            yield TokenEvent(None, finish_reason=FinishReason.ERROR)
            return
        reply = BYTES.encode(self.engine.reply).tolist()
        for i, token in enumerate(reply[:p.max_tokens]):
            reason = FinishReason.LENGTH if i + 1 == p.max_tokens else None
            top = tuple((token + k, -0.5 - k) for k in range(n)) if p.logprobs else ()
            yield TokenEvent(token, -0.5, top, reason, text=BYTES.decode([token]))
            if reason:
                return
        yield TokenEvent(None, finish_reason=FinishReason.STOP,
                         stopped_by=(BYTES.eos_id, -0.5, ((BYTES.eos_id, -0.5),) if n else ()))

    async def __aiter__(self):
        for i, event in enumerate(self.events()):
            if self.cancelled:
                return
            await asyncio.sleep(self.engine.delay if i < self.engine.stall_after else 3600)
            yield event


class FakeEngine:
    def __init__(self, reply="Hello, world! The end.", *, slots=2, max_queue=4, delay=0.0,
                 stall_after=10 ** 9):
        """`stall_after`: events streamed before the engine stalls (a slow step) until
        cancelled."""
        self.reply, self.slots, self.max_queue, self.delay = reply, slots, max_queue, delay
        self.stall_after = stall_after
        self.live: list[FakeHandle] = []
        self.accepting = True
        self.requests = []
        self.lock = threading.Lock()
        self.started = self.stopped = False
        self.generated = 0

    def start(self):
        self.started = True

    def stop(self, drain_timeout):
        self.stopped = True

    def submit(self, request):
        with self.lock:
            if not self.accepting:
                raise RuntimeError("the engine is stopping: no new requests")
            if len(self.live) >= self.slots + self.max_queue:
                raise QueueFull(f"{len(self.live)} requests in flight")
            handle = FakeHandle(self, request)
            self.live.append(handle)
            self.requests.append(request)
            return handle

    def release(self, handle):
        with self.lock:
            if handle in self.live:
                self.live.remove(handle)

    def metrics(self):
        running = min(len(self.live), self.slots)
        return {"queued": len(self.live) - running, "running": running,
                "free_pages": 64 - 4 * running, "total_pages": 64, "tokens_per_s": 12.5,
                "prefix_hit_rate": 0.25, "acceptance_rate": None, "generated_tokens": 7}
