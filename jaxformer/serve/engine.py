"""The serving engine: continuous batching over slots and a paged KV cache.

    engine = Engine(model, params, tokenizer, slots=8, max_len=512)
    engine.start()                                  # the step thread
    handle = engine.submit(Request(prompt_ids, SamplingParams(max_tokens=64)))
    for event in handle: ...                        # or `async for`, or handle.result()
    engine.stop()

A fixed number of slots share one compiled decode step (`paged.paged_forward`
with one token per slot: no recompile as requests come and go; one program per
view length bucket). Each engine step (JetStream's prefill / insert /
generate, SGLang's chunked prefill beside the decodes):

  1. cancelled requests leave (their pages are returned at once);
  2. queued requests join free slots, if the pool can hold their prompt plus
     `max_tokens` (pages already promised to running requests are counted);
     with the prefix cache, a prompt's leading full pages already in the pool
     are shared instead of computed;
  3. one prefill call: the next chunk (at most `prefill_chunk` tokens, padded
     to one of a few compiled sizes) of the oldest requests still reading their
     prompts, in the compiled shape that wastes the least (`batching.prefill_batch`):
     a long prompt never stalls the running requests for its whole prefill;
  4. one decode step: every decoding slot feeds its last token and picks the
     next with its own settings (`select.pick`), in as few rows as a compiled
     row count allows (`batching.decode_sizes`); finished requests leave.

Everything JAX runs on the step thread; `submit`, `cancel` and `metrics` are
thread-safe. Greedy tokens equal `decode.generate` of the prompt alone.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxformer.backends import host_memory
from jaxformer.decode.inputs import decodable
from jaxformer.nn import paged_kv, stacking
from jaxformer.nn.attention import kv_length_axis
from jaxformer.nn.model import DecoderOnlyLM
from jaxformer.serve import batching, paged, programs, spec_step
from jaxformer.serve.batching import bucket, page_rows, slot_params, want_top
from jaxformer.serve.checks import (check_engine_args, check_pool_fits, check_request,
                                    scan_refusal)
from jaxformer.serve.handle import Handle
from jaxformer.serve.pages import PagePool, PageTable
from jaxformer.serve.request import FinishReason, QueueFull, Request, TokenEvent
from jaxformer.serve.slots import Slot, token_event
from jaxformer.serve.speculative import NGRAM

log = logging.getLogger(__name__)
RATE_WINDOW_S = 10.0  # tokens_per_s is measured over this many recent seconds


class Engine:
    """Slots over a paged KV cache with continuous batching (module docstring).

    Args:
      model: a `DecoderOnlyLM` (quantized weights, `load(..., quantize="int8")`,
        and an int8 KV cache, `config.kv_cache_quant`, work as they are).
      params: its parameters.
      tokenizer: has `decode(ids) -> str`; needed for stop strings and `TokenEvent.text`
        (None: ids only).
      slots: requests decoded together.
      max_len: the context: prompt plus new tokens (default the model's).
      page_size: tokens per page.
      num_pages: pages in the pool (default: enough for every slot's whole context).
      prefill_chunk: most prompt tokens fed per engine step.
      prefix_cache: share the full pages of common prompt prefixes.
      max_queue: waiting requests beyond which `submit` raises `QueueFull`.
      adapters: {name: parameters} of the same model (e.g. LoRA adapters merged into
        the base, `nn.lora.merge_lora`), chosen by `Request.adapter`.
      speculative: k > 0 drafts up to k tokens per slot and step by prompt lookup and
        verifies them in the step's one pass (`spec_step`); 0 = off. Greedy tokens are
        the same; `metrics()["acceptance_rate"]` reports accepted / drafted.
      ngram: (n_min, n_max), the n-gram sizes prompt lookup tries (longest first;
        default `speculative.NGRAM`, 2..5).
      scan_layers: run the decoder layers as one `lax.scan` over stacked parameters and
        one stacked KV pool (`paged.scanned_forward`): each compiled program holds one
        layer's kernels, so it compiles faster and holds a fraction of the memory of
        the unrolled program, for a slower step (XLA:CPU copies each layer's weights
        out of the stack per step; figures in docs/serving.md). Same tokens either way.
    """

    def __init__(self, model, params, tokenizer=None, *, slots: int = 8,
                 max_len: Optional[int] = None, page_size: int = 16,
                 num_pages: Optional[int] = None, prefill_chunk: int = 128,
                 prefix_cache: bool = True, max_queue: int = 64,
                 adapters: Optional[dict[str, Any]] = None, speculative: int = 0,
                 ngram: tuple[int, int] = NGRAM, scan_layers: bool = False):
        if not isinstance(model, DecoderOnlyLM):
            raise TypeError(f"model must be a jaxformer DecoderOnlyLM, got {type(model).__name__}")
        config = model.config
        max_len = config.decoder_len if max_len is None else max_len
        check_engine_args(config, slots=slots, max_len=max_len, page_size=page_size,
                          num_pages=num_pages, prefill_chunk=prefill_chunk, max_queue=max_queue)
        if isinstance(speculative, bool) or not isinstance(speculative, int) or speculative < 0:
            raise ValueError(f"speculative must be an int >= 0 (drafts per step), got "
                             f"{speculative!r}")
        if (not isinstance(ngram, tuple) or len(ngram) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in ngram)
                or not 1 <= ngram[0] <= ngram[1]):
            raise ValueError(f"ngram must be (n_min, n_max) with 1 <= n_min <= n_max, "
                             f"got {ngram!r}")
        self.max_pages = -(-max_len // page_size)
        num_pages = slots * self.max_pages if num_pages is None else num_pages
        check_pool_fits(config, num_pages, page_size)
        if not isinstance(scan_layers, bool):
            raise TypeError(f"scan_layers must be a bool, got {scan_layers!r}")
        if scan_layers and (refusal := scan_refusal(config)) is not None:
            raise ValueError(refusal)
        self.scan_layers = scan_layers

        def layout(tree):  # per-layer, or stacked for `paged.scanned_forward`
            return stacking.stack_layers(tree) if scan_layers else tree

        model, base = stacking.for_decoding(*decodable(model, params))
        self.params = {None: layout(base)}
        for name, tree in (adapters or {}).items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
            self.params[name] = layout(
                stacking.for_decoding(*decodable(type(model)(config), tree))[1])
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        self.chunk_sizes, self.row_sizes = batching.prefill_sizes(slots, prefill_chunk)
        self.decode_rows = batching.decode_sizes(slots)
        self.view_sizes = tuple(sorted({v for v in (128, 256, 512, 1024, 2048) if v < max_len}
                                       | {max_len}))
        self.pool = PagePool(num_pages, page_size, prefix_cache=prefix_cache)
        self.pools = paged.init_pools(config, num_pages, page_size, stacked=scan_layers)
        axis = kv_length_axis(config)
        self.kernel_decode = (  # see `decode_view`
            not any(map(config.layer_is_local, range(config.num_decoder_layers)))
            and all(paged_kv.kernel_attends(kv, axis, config) for kv in self.pools))
        self.running: list[Optional[Slot]] = [None] * slots
        self.queue: collections.deque[Handle] = collections.deque()
        self.cancelled: set[str] = set()
        self.lock = threading.Condition()
        self.thread: Optional[threading.Thread] = None
        self.accepting, self.stopping = True, False
        self.ids = itertools.count()
        self.generated_tokens, self.recent = 0, collections.deque()
        self.decode_fn, self.prefill_fn = programs.compiled()
        self.speculative, self.ngram = speculative, ngram
        self.drafted, self.accepted_drafts = 0, 0
        self.shapes, self.compiled_new = set(), False  # `compiling`

    # -- the client's side (thread-safe) ------------------------------------

    def submit(self, request: Request) -> Handle:
        """Queue a request; returns its `Handle`. Raises ValueError on a bad request
        (before any work), QueueFull beyond `max_queue`, RuntimeError once stopping."""
        check_request(request, vocab_size=self.config.tgt_vocab_size, max_len=self.max_len,
                      page_size=self.page_size, num_pages=self.pool.num_pages,
                      tokenizer=self.tokenizer, adapters=self.params)
        with self.lock:
            if not self.accepting:
                raise RuntimeError("the engine is stopping: no new requests")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are queued already "
                                f"(max_queue={self.max_queue})")
            live = {h.request_id for h in self.queue} | {
                s.handle.request_id for s in self.running if s is not None}
            request_id = request.request_id or f"req-{next(self.ids)}"
            if request_id in live:
                raise ValueError(f"request_id {request_id!r} is already running")
            handle = Handle(request, request_id, self.cancel)
            self.queue.append(handle)
            self.lock.notify_all()
        return handle

    def cancel(self, request_id: str) -> None:
        """End a queued or running request at the next step (its pages are freed)."""
        with self.lock:
            self.cancelled.add(request_id)
            self.lock.notify_all()

    def metrics(self) -> dict:
        with self.lock:
            running = sum(s is not None for s in self.running)
            now = time.monotonic()
            recent = [n for t, n in self.recent if t >= now - RATE_WINDOW_S]
            span = min(RATE_WINDOW_S, now - self.recent[0][0]) if self.recent else 0.0
            return {"queued": len(self.queue), "running": running,
                    "free_pages": self.pool.available, "total_pages": self.pool.num_pages,
                    "tokens_per_s": sum(recent) / span if span > 0 else 0.0,
                    "prefix_hit_rate": self.pool.hit_rate,
                    "acceptance_rate": (self.accepted_drafts / self.drafted
                                        if self.drafted else 0.0),
                    "generated_tokens": self.generated_tokens}

    def start(self) -> "Engine":
        """Run `step` on a background thread until `stop`."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.serve_forever, name="jaxformer-engine",
                                           daemon=True)
            self.thread.start()
        return self

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, let running and queued ones finish for at most
        `drain_timeout` seconds, cancel the rest, end the step thread."""
        with self.lock:
            self.accepting = False
        deadline = time.monotonic() + drain_timeout
        while self.thread is not None and not self.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            self.cancelled.update(h.request_id for h in self.queue)
            self.cancelled.update(s.handle.request_id for s in self.running if s is not None)
            self.stopping = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        else:
            self.step()

    def idle(self) -> bool:
        with self.lock:
            return not self.queue and all(s is None for s in self.running)

    # -- the step thread ------------------------------------------------------

    def serve_forever(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.stopping or self.queue or self.cancelled
                                   or any(s is not None for s in self.running))
                if self.stopping and not self.cancelled:
                    return
            self.step()
            if self.compiled_new and self.idle():
                self.compiled_new = False
                host_memory.release_freed()  # the compiler's freed host memory, tens of MB

    def compiling(self, *key):
        """The context of a compiled call with static shape and flags `key`: a new one
        compiles its program, under `programs.COMPILE_LOCK` (one engine compile at a time
        in the process); a known one just runs."""
        new = key not in self.shapes
        self.shapes.add(key)
        self.compiled_new |= new
        return programs.COMPILE_LOCK if new else contextlib.nullcontext()

    def run_until_idle(self) -> None:
        """Step on the calling thread until nothing is queued or running (no `start`)."""
        while not self.idle():
            self.step()

    def step(self) -> None:
        """One engine step (module docstring)."""
        with self.lock:
            cancelled, self.cancelled = self.cancelled, set()
            for handle in [h for h in self.queue if h.request_id in cancelled]:
                self.queue.remove(handle)
                handle.push(TokenEvent(token=None, finish_reason=FinishReason.CANCELLED))
        for slot in self.running:
            if slot is not None and slot.handle.request_id in cancelled:
                self.finish(slot, FinishReason.CANCELLED)
        self.admit()
        prefilling = [s for s in self.running if s is not None and s.prefilling]
        if prefilling:
            batch, counts = batching.prefill_batch(prefilling, self.prefill_chunk,
                                                   self.chunk_sizes, self.row_sizes)
            self.guarded(batch, lambda: self.prefill_rows(batch, counts))
        decoding = [s for s in self.running if s is not None and s.pending is not None]
        if decoding:
            self.guarded(decoding, lambda: self.decode_step(decoding))

    def guarded(self, slots: list[Slot], work: Callable[[], None]) -> None:
        """Run `work`; if it raises, end `slots` with ERROR (and, if the pool was lost
        with the failed call, every running request) and go on."""
        try:
            work()
        except Exception as e:  # noqa: BLE001 - one request's failure never stops the engine
            log.exception("engine step failed")
            if any(x.is_deleted() for kv in self.pools for x in kv):
                self.pools = paged.init_pools(self.config, self.pool.num_pages, self.page_size,
                                              stacked=self.scan_layers)
                slots = [s for s in self.running if s is not None]
            for slot in slots:
                if self.running[self.running.index(slot)] is slot:
                    slot.handle.error = f"{type(e).__name__}: {e}"
                    self.finish(slot, FinishReason.ERROR)

    def admit(self) -> None:
        while None in self.running:
            with self.lock:
                if not self.queue:
                    return
                handle = self.queue[0]
            request = handle.request
            prompt = [int(t) for t in request.prompt_ids]
            table = PageTable(self.pool, self.max_pages, request.adapter)
            cached = 0 if request.params.echo else table.reuse_prefix(prompt, len(prompt) - 1)
            context = min(len(prompt) + request.params.max_tokens - 1, self.max_len)
            need = -(-context // self.page_size) - len(table.pages)
            promised = sum(s.reserve for s in self.running if s is not None)
            if self.pool.available - promised < need:
                table.free()
                return  # it waits for pages (the request at the head keeps its turn)
            self.pool.count_lookup(len(prompt), cached)
            with self.lock:
                self.queue.popleft()
            self.running[self.running.index(None)] = Slot(
                handle=handle, table=table, tokens=prompt, prompt_len=len(prompt),
                reserve=need, cached=cached)

    def take_pages(self, slot: Slot, length: int) -> None:
        before = len(slot.table.pages)
        slot.table.ensure(length)
        slot.reserve -= len(slot.table.pages) - before

    def prefill_rows(self, slots: list[Slot], counts: list[int]) -> None:
        """The next `counts` prompt tokens of each of `slots` in one call (rows padded
        to a bucket)."""
        width = bucket(max(counts), self.chunk_sizes)
        rows = bucket(len(slots), self.row_sizes)
        tokens = np.zeros((rows, width), np.int32)
        targets = np.zeros((rows, width), np.int32)
        starts = np.zeros((rows,), np.int32)
        lasts = np.zeros((rows,), np.int32)
        valid = np.zeros((rows, width), bool)
        table = np.zeros((rows, self.max_pages), np.int32)
        for i, (slot, count) in enumerate(zip(slots, counts)):
            start = starts[i] = slot.cached
            self.take_pages(slot, start + count)
            tokens[i, :count] = slot.tokens[start:start + count]
            following = slot.tokens[start + 1:min(start + count + 1, slot.prompt_len)]
            targets[i, :len(following)] = following
            lasts[i], valid[i, :count], table[i] = count - 1, True, slot.table.row()
        padded = slots + [None] * (rows - len(slots))
        echo = any(s.request.params.echo for s in slots)
        allowed = batching.allowed(padded, self.config.tgt_vocab_size)
        view_len = self.view_length(max(int(starts.max()) + width, batching.PREFILL_VIEW))
        picks, extra = self.run_prefill(self.params[slots[0].request.adapter], table, starts,
                                        tokens, valid, slot_params(padded), want_top(slots),
                                        lasts, targets, allowed, view_len, echo)
        picks = jax.device_get(picks)
        extra = None if extra is None else jax.device_get(extra)
        for i, (slot, count) in enumerate(zip(slots, counts)):
            slot.cached += count
            slot.table.register_full(slot.tokens[:slot.cached])
            if slot.request.params.echo:
                logprobs, top_ids, top_lps = (x[i] for x in extra)
                for j in range(min(count, slot.prompt_len - slot.cached + count - 1)):
                    slot.prompt_logprobs.append(
                        (float(logprobs[j]), self.top(slot, top_ids[j], top_lps[j])))
            if not slot.prefilling:
                if slot.request.params.echo:
                    self.echo_prompt(slot)
                self.accept(slot, picks.token[i], picks.logprob[i], picks.top_ids[i],
                            picks.top_logprobs[i])

    def decode_step(self, decoding: list[Slot]) -> None:
        """One token for each of `decoding`: a call per adapter, over its decoding
        slots only, padded to the next of `decode_rows` (idle slots cost nothing); with
        `speculative`, the verify step instead where some slot has drafts."""
        if self.speculative and spec_step.speculative_step(self, decoding):
            return
        for slot in decoding:
            self.take_pages(slot, slot.cached + 1)
        groups = {}
        for slot in decoding:
            groups.setdefault(slot.request.adapter, []).append(slot)
        results = []
        for adapter, members in groups.items():
            rows = members + [None] * (bucket(len(members), self.decode_rows) - len(members))
            lengths = np.asarray([0 if s is None else s.cached for s in rows], np.int32)
            tokens = np.asarray([0 if s is None else s.pending for s in rows], np.int32)
            picks = self.run_decode(
                self.params[adapter], page_rows(rows, self.max_pages), lengths, tokens,
                np.asarray([s is not None for s in rows]), slot_params(rows),
                want_top(members), batching.allowed(rows, self.config.tgt_vocab_size),
                self.decode_view(int(lengths.max()) + 1))
            results.append((members, jax.device_get(picks)))
        for members, picks in results:
            for i, slot in enumerate(members):
                slot.cached += 1
                slot.table.register_full(slot.tokens[:slot.cached])
                self.accept(slot, picks.token[i], picks.logprob[i], picks.top_ids[i],
                            picks.top_logprobs[i])

    def run_decode(self, params, table, lengths, tokens, valid, slot_params_S, want_top_,
                   allowed, view_len: int):
        """The compiled decode step (`programs.decode_program`); the pools updated."""
        with self.compiling("decode", len(tokens), view_len, allowed is None):
            picks, self.pools = self.decode_fn(
                self.model, self.page_size, params, self.pools, table, lengths, tokens, valid,
                slot_params_S, want_top_, np.zeros((1, 1), bool) if allowed is None else allowed,
                view_len=view_len, masked=allowed is not None)
        return picks

    def run_prefill(self, params, table, starts, tokens, valid, slot_params_R, want_top_,
                    lasts, targets, allowed, view_len: int, echo: bool):
        """The compiled prefill chunk (`programs.prefill_program`); the pools updated."""
        rows, width = tokens.shape
        with self.compiling("prefill", rows, width, view_len, echo, allowed is None):
            picks, extra, self.pools = self.prefill_fn(
                self.model, self.page_size, params, self.pools, table, starts, tokens, valid,
                slot_params_R, want_top_, lasts, targets,
                np.zeros((1, 1), bool) if allowed is None else allowed,
                view_len=view_len, echo=echo, masked=allowed is not None)
        return picks, extra

    def warm_up(self) -> "Engine":
        """Compile (and run once, on no request: every write goes to the null page) each
        program the steady state calls: the decode step for every view length, a prefill
        chunk for every (rows, width) and view length, the speculative step if on; then no
        request waits for a compile. Echo and structured-output requests use their own
        programs, compiled at their first use. Call it before `start`."""
        programs.warm_up(self)
        return self

    def decode_view(self, needed: int) -> int:
        """The view length of a decode (or speculative) step for rows of up to `needed`
        positions: `view_length`'s bucket, or the whole table where the C++ kernel
        attends (it reads each row's own positions whatever the view, so one compiled
        step serves every length)."""
        return self.view_sizes[-1] if self.kernel_decode else self.view_length(needed)

    def view_length(self, needed: int) -> int:
        """The compiled view length bucket for rows of up to `needed` positions (at most
        `max_len`: a table holds no more pages, so a longer view reads the same)."""
        return min(bucket(needed, self.view_sizes), self.view_sizes[-1])

    def count_drafts(self, drafted: int, accepted: int) -> None:
        with self.lock:
            self.drafted += drafted
            self.accepted_drafts += accepted

    @staticmethod
    def top(slot: Slot, ids, logprobs) -> tuple:
        n = slot.request.params.logprobs or 0
        return tuple((int(i), float(lp)) for i, lp in zip(ids[:n], logprobs[:n]))

    def echo_prompt(self, slot: Slot) -> None:
        first = slot.tokens[0]
        slot.handle.push(token_event(slot, first, prompt=True, text=self.text([first])))
        for token, (logprob, top) in zip(slot.tokens[1:slot.prompt_len], slot.prompt_logprobs):
            slot.handle.push(token_event(slot, token, logprob, top, prompt=True,
                                         text=self.text([token])))

    def text(self, ids) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def accept(self, slot: Slot, token, logprob, top_ids, top_logprobs) -> None:
        """Record a pick: stream it, or end the request (EOS, stop id or string,
        max_tokens, a full context, a finished constraint)."""
        token, params = int(token), slot.request.params
        decode = None if self.tokenizer is None else self.tokenizer.decode
        slot.generated += 1
        with self.lock:
            self.generated_tokens += 1
            self.recent.append((time.monotonic(), 1))
            while self.recent and self.recent[0][0] < time.monotonic() - RATE_WINDOW_S:
                self.recent.popleft()
        if token == self.config.eos_id or token in params.stop_ids:
            stopped_by = (token, float(logprob), self.top(slot, top_ids, top_logprobs))
            self.finish(slot, FinishReason.STOP, text=slot.new_text(decode, final=True),
                        stopped_by=stopped_by)
            return
        slot.tokens.append(token)
        constraint = slot.request.constraint
        if constraint is not None:
            constraint.advance(token)
        text = slot.new_text(decode, final=False)  # finds stop strings
        finish = None
        if slot.stopped_at is not None:
            finish = FinishReason.STOP
        elif slot.generated >= params.max_tokens or len(slot.tokens) > self.max_len:
            finish = FinishReason.LENGTH   # (a full context: no slot to feed the token)
        elif constraint is not None and constraint.done():
            finish = FinishReason.STOP
        if finish is not None and slot.stopped_at is None:
            text += slot.new_text(decode, final=True)
        slot.handle.push(token_event(slot, token, logprob, self.top(slot, top_ids, top_logprobs),
                                     finish=finish, text=text))
        if finish is not None:
            self.release(slot)
        else:
            slot.pending = token

    def finish(self, slot: Slot, reason: FinishReason, text: str = "",
               stopped_by: Optional[tuple] = None) -> None:
        slot.handle.push(token_event(slot, None, finish=reason, text=text, stopped_by=stopped_by))
        self.release(slot)

    def release(self, slot: Slot) -> None:
        slot.table.free()
        self.running[self.running.index(slot)] = None

