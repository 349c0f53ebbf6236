"""The OpenAI-compatible HTTP API over a serving engine, as a Starlette ASGI app.

    app = create_app(ServedModel(engine, tokenizer, name="smollm2", max_len=2048,
                                 chat_template=template), api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)      # or jaxformer.serve.server.run

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true`: server-sent events, `data: {...}` ... `data: [DONE]`),
GET /health, GET /metrics (Prometheus text). The engine is started and stopped
with the app (its lifespan). A LoRA adapter is chosen by the request's `model`
field (one of `ServedModel.adapters`); the base model by its own name or none.

Errors are OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400
for a malformed body or a prompt beyond the context (checked before the engine
sees it), 401 without the `--api-key` bearer token (on /v1/ routes), 404 for an
unknown model, 429 with Retry-After when the engine's queue is full, 500 when a
request fails (the server goes on). A client that disconnects, mid-stream, while
waiting for a whole answer or before sending the whole body, has its request
cancelled at once; that is one line in the log and counts in /metrics as a client
disconnect (jaxformer_client_disconnects_total), not as an error. At the drain
timeout of a shutdown (`Api.end_open_requests`) each open stream ends after its
current event with an error event (code "shutting_down") and `data: [DONE]`, and
each whole answer awaited is a 503.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import sys
import traceback
from typing import Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxformer.serve import generation, responses
from jaxformer.serve.metrics import CONTENT_TYPE, prometheus_text
from jaxformer.serve.request import Request, SamplingParams
from jaxformer.serve.schemas import ApiError, parse_chat, parse_completion

log = logging.getLogger("jaxformer.serve")


@dataclasses.dataclass
class ServedModel:
    """What the server serves: an engine (the serving engine, or anything with its
    submit/metrics/start/stop), its tokenizer (encode, encode_prompt, decode, token_text,
    bos/eos/pad ids), names, and how to build a `response_format` constraint."""
    engine: object
    tokenizer: object
    name: str
    max_len: int                                  # the engine's context, prompt + new tokens
    adapters: tuple[str, ...] = ()                # LoRA adapter names the engine knows
    chat_template: Optional[str] = None
    make_constraint: Optional[Callable] = None    # (response_format dict) -> TokenConstraint
    drain_timeout: float = 30.0                   # engine.stop() on shutdown


def _shutting_down() -> ApiError:
    """What a request still open at the drain timeout gets."""
    return ApiError("the server shut down before this answer was finished (its drain "
                    "timeout passed)", None, status=503, type="server_error",
                    code="shutting_down")


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _until_set(chunks, ending: asyncio.Event, last: bytes):
    """The items of the async iterator `chunks` until it ends; if `ending` is set first,
    `last` instead of the next item (whose wait is cancelled), and no more."""
    ended, chunk = asyncio.ensure_future(ending.wait()), None
    try:
        while True:
            chunk = asyncio.ensure_future(anext(chunks, None))
            await asyncio.wait([chunk, ended], return_when=asyncio.FIRST_COMPLETED)
            if not chunk.done():
                yield last
                return
            if chunk.result() is None:
                return
            yield chunk.result()
    finally:  # `chunks` is idle after this (it can be closed)
        ended.cancel()
        if chunk is not None and not chunk.done():
            chunk.cancel()
            await asyncio.gather(chunk, return_exceptions=True)


class EventStream(Response):
    """A server-sent event stream whose generator is closed the moment the client goes
    (a disconnect message, or a failed send), so its `finally` frees the request;
    `on_disconnect` is then called too. Once `ending` is set (a shutdown's drain
    timeout) the stream sends `last_events` after its current event and ends: the
    client never reads half an event."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_close: Callable[[], None], *,  # noqa: D107 - no body, no length
                 ending: asyncio.Event, last_events: bytes):
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]
        self.chunks, self.on_close = chunks, on_close
        self.ending, self.last_events = ending, last_events
        self.on_disconnect: Callable[[], None] = lambda: None

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async with contextlib.aclosing(_until_set(self.chunks, self.ending,
                                                      self.last_events)) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(watch())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.chunks.aclose()
            self.on_close()  # also when the generator never started
        failed = tasks[0].exception() if tasks[0] in done else None
        if tasks[0] not in done or isinstance(failed, OSError):  # OSError: the client went
            self.on_disconnect()
        elif failed:
            raise failed


async def _until_disconnect(http: HttpRequest, work, ending: asyncio.Event):
    """Await `work` (a coroutine), cancelled if the client disconnects first
    (ClientDisconnect) or `ending` is set first (ApiError 503: shutting down)."""
    task = asyncio.ensure_future(work)

    async def watch():
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher, ended = asyncio.ensure_future(watch()), asyncio.ensure_future(ending.wait())
    try:
        done, _ = await asyncio.wait([task, watcher, ended],
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        ended.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # its `finally`s have run
    if watcher in done:
        raise ClientDisconnect()
    raise _shutting_down()


class Api:
    """The routes' state: the served model, the key, counters."""

    def __init__(self, served: ServedModel, api_key: Optional[str]):
        self.served, self.api_key = served, api_key
        self.counts: collections.Counter = collections.Counter()       # (route, status)
        self.disconnects: collections.Counter = collections.Counter()  # route
        self.next_id = 0
        self.ending = asyncio.Event()  # set at a shutdown's drain timeout

    def end_open_requests(self) -> None:
        """End every open request now (on the event loop: `server.run`'s
        `on_drain_timeout`): streams after their current event with an error event and
        [DONE], awaited answers with a 503."""
        self.ending.set()

    def event_stream(self, chunks, on_close: Callable[[], None]) -> EventStream:
        return EventStream(chunks, on_close, ending=self.ending,
                           last_events=responses.sse(_shutting_down().body()) +
                           responses.SSE_DONE)

    # -- helpers --------------------------------------------------------------

    def check_key(self, http: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = http.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()):
            raise ApiError("missing or wrong API key: send the header 'Authorization: Bearer "
                           "KEY' with the server's --api-key", None, status=401,
                           code="invalid_api_key")

    def adapter(self, model: Optional[str]) -> Optional[str]:
        if model is None or model == self.served.name:
            return None
        if model in self.served.adapters:
            return model
        known = ", ".join((self.served.name, *self.served.adapters))
        raise ApiError(f"model {model!r} is not served here (served: {known})"[:400], "model",
                       status=404, code="model_not_found")

    async def body(self, http: HttpRequest):
        try:
            return json.loads(await http.body())
        except (ValueError, UnicodeDecodeError) as error:
            raise ApiError(f"the request body is not valid JSON ({error})") from error
        except RecursionError:  # json.loads gives up near 1000 levels
            raise ApiError("the request body is nested too deeply to read") from None

    def request(self, prompt_ids, sampling, *, param: str, echo: bool = False,
                adapter=None, constraint=None) -> Request:
        """An engine Request, or ApiError(400) for a prompt beyond the context."""
        n, limit = len(prompt_ids), self.served.max_len
        if n == 0:
            raise ApiError("the prompt is empty (no tokens)", param)
        if n > limit:
            raise ApiError(f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {n}", param, code="context_length_exceeded")
        vocab = self.vocab_size()
        if vocab is not None and any(not 0 <= i < vocab for i in prompt_ids):
            raise ApiError(f"prompt token ids must be in [0, {vocab})", param)
        # The engine ends a request whose context fills up with finish_reason "length".
        room = limit - n + 1
        max_tokens = max(1, min(room, sampling.max_tokens or room))
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=sampling.temperature,
                                top_k=sampling.top_k, top_p=sampling.top_p,
                                min_p=sampling.min_p, seed=sampling.seed,
                                stop=sampling.stop, logprobs=sampling.logprobs, echo=echo)
        return Request(prompt_ids=list(prompt_ids), params=params,
                       request_id=f"req-{self.next_id}", adapter=adapter,
                       constraint=constraint)

    def vocab_size(self) -> Optional[int]:
        """The tokenizer's vocabulary (prompt ids' and top_k's bound), None if unknown."""
        return getattr(self.served.tokenizer, "vocab_size", None)

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return [int(i) for i in self.served.tokenizer.encode_prompt(prompt)]
        return list(prompt)

    # -- routes ---------------------------------------------------------------

    async def models(self, http: HttpRequest):
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "jaxformer",
                 **({"parent": self.served.name} if name != self.served.name else {})}
                for name in (self.served.name, *self.served.adapters)]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, http: HttpRequest):
        return JSONResponse({"status": "ok"})

    async def metrics(self, http: HttpRequest):
        return Response(prometheus_text(self.served.engine.metrics(), self.counts,
                                        self.disconnects), media_type=CONTENT_TYPE)

    async def completions(self, http: HttpRequest):
        body = parse_completion(await self.body(http), vocab_size=self.vocab_size())
        adapter = self.adapter(body.model)
        sampling, echo = body.sampling, body.echo
        if sampling.stream and len(body.prompts) > 1:
            raise ApiError("stream takes one prompt (a string or a list of ids)", "prompt")
        requests = [self.request(self.encode(p), sampling, param="prompt", echo=echo,
                                 adapter=adapter) for p in body.prompts]
        model = body.model or self.served.name
        handles = self.submit_all(requests)
        if sampling.stream:
            return self.event_stream(
                self.completion_events(handles[0], requests[0], model, sampling),
                handles[0].cancel)
        only_prompt = sampling.max_tokens == 0
        try:
            results = await _until_disconnect(http, asyncio.gather(*(
                generation.collect(h, self.served.tokenizer, r, keep_new_tokens=not only_prompt)
                for h, r in zip(handles, requests))), self.ending)
        finally:  # a disconnect, or one choice failing, ends them all (no-op when done)
            for handle in handles:
                handle.cancel()
        choices, generated = [], 0
        for index, (request, result) in enumerate(zip(requests, results)):
            text, entries, texts = result.text, result.entries, result.texts
            if echo:
                prompt_texts = generation.prompt_texts(self.served.tokenizer,
                                                       request.prompt_ids)
                text = "".join(prompt_texts) + text
                entries, texts = result.prompt_entries + entries, prompt_texts + texts
            logprobs = (None if sampling.logprobs is None else
                        responses.completion_logprobs(self.served.tokenizer, entries, texts))
            reason = "length" if only_prompt else result.finish_reason
            choices.append(responses.completion_choice(index, text, logprobs, reason))
            generated += result.generated
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        return JSONResponse(responses.completion(
            responses.new_id("cmpl"), model, choices, responses.usage(prompt_tokens, generated)))

    def submit_all(self, requests) -> list:
        """The engine's handles of `requests`; if one is refused, none run."""
        handles = []
        try:
            for request in requests:
                handles.append(generation.submit(self.served.engine, request))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    async def completion_events(self, handle, request: Request, model: str, sampling):
        request_id, generated = responses.new_id("cmpl"), 0
        try:
            async for step in generation.stream(handle, self.served.tokenizer, request):
                generated += step.generated
                logprobs = (None if sampling.logprobs is None else
                            responses.completion_logprobs(self.served.tokenizer, step.entries,
                                                          step.texts))
                yield responses.sse(responses.completion(request_id, model, [
                    responses.completion_choice(0, step.text, logprobs, step.finish_reason)],
                    None) | {"usage": None})
            if sampling.include_usage:
                yield responses.sse(responses.usage_chunk(
                    request_id, model, "text_completion",
                    responses.usage(len(request.prompt_ids), generated)))
        except Exception as error:  # noqa: BLE001 - one request's failure, told in-stream
            yield responses.sse(self.failure(error).body())
        yield responses.SSE_DONE

    def chat_prompt(self, messages) -> list[int]:
        template = self.served.chat_template
        if template is None:
            raise ApiError(f"{self.served.name} has no chat template; use /v1/completions",
                           "messages")
        from jaxformer.text import encode_chat  # noqa: PLC0415 - jinja2 on first chat

        try:
            return encode_chat(template, self.served.tokenizer, messages)
        except (ValueError, ImportError) as error:
            raise ApiError(str(error), "messages") from error

    async def constraint(self, response_format):
        """The request's TokenConstraint (compiled off the event loop: a new schema's
        index takes a while), or None."""
        if response_format is None:
            return None
        if self.served.make_constraint is None:
            raise ApiError("response_format is not available on this server", "response_format")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, self.served.make_constraint, response_format)
        except ImportError as error:
            raise ApiError(f"response_format: {error}", "response_format") from error
        except ValueError as error:
            raise ApiError(f"response_format: {error}"[:400], "response_format") from error

    async def chat(self, http: HttpRequest):
        body = parse_chat(await self.body(http), vocab_size=self.vocab_size())
        adapter = self.adapter(body.model)
        prompt = self.chat_prompt(body.messages)
        request = self.request(prompt, body.sampling, param="messages", adapter=adapter,
                               constraint=await self.constraint(body.response_format))
        model = body.model or self.served.name
        handle = generation.submit(self.served.engine, request)
        if body.sampling.stream:
            return self.event_stream(self.chat_events(handle, request, model, body.sampling),
                                     handle.cancel)
        try:
            result = await _until_disconnect(http, generation.collect(
                handle, self.served.tokenizer, request), self.ending)
        finally:
            handle.cancel()
        logprobs = (None if body.sampling.logprobs is None else
                    responses.chat_logprobs(self.served.tokenizer, result.entries))
        return JSONResponse(responses.chat_completion(
            responses.new_id("chatcmpl"), model, result.text, logprobs, result.finish_reason,
            responses.usage(len(prompt), result.generated)))

    async def chat_events(self, handle, request: Request, model: str, sampling):
        request_id, generated = responses.new_id("chatcmpl"), 0
        try:
            yield responses.sse(responses.chat_chunk(request_id, model,
                                                     {"role": "assistant", "content": ""}))
            async for step in generation.stream(handle, self.served.tokenizer, request):
                generated += step.generated
                logprobs = (None if sampling.logprobs is None else
                            responses.chat_logprobs(self.served.tokenizer, step.entries))
                delta = {"content": step.text} if step.text or not step.finish_reason else {}
                yield responses.sse(responses.chat_chunk(request_id, model, delta, logprobs,
                                                         step.finish_reason))
            if sampling.include_usage:
                yield responses.sse(responses.usage_chunk(
                    request_id, model, "chat.completion.chunk",
                    responses.usage(len(request.prompt_ids), generated)))
        except Exception as error:  # noqa: BLE001 - one request's failure, told in-stream
            yield responses.sse(self.failure(error).body())
        yield responses.SSE_DONE

    def failure(self, error: Exception) -> ApiError:
        """Any exception as the ApiError the client gets (a traceback in the log)."""
        if isinstance(error, ApiError):
            return error
        print(f"jaxformer serve: request failed: {error!r}", file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        return ApiError(f"the server failed on this request ({type(error).__name__}: "
                        f"{error})"[:400], None, status=500, type="server_error",
                        code="internal_error")

    def client_went(self, path: str, http: HttpRequest) -> None:
        """A client that disconnected before the whole answer: counted, and one line
        in the log (it is not the server's failure: no traceback)."""
        self.disconnects[path] += 1
        peer = f" from {http.client.host}:{http.client.port}" if http.client else ""
        print(f"jaxformer serve: {http.method} {path}: the client{peer} disconnected "
              "before the whole answer", file=sys.stderr, flush=True)

    def route(self, path: str, endpoint, *, protected: bool):
        async def handle(http: HttpRequest):
            try:
                if protected:
                    self.check_key(http)
                response = await endpoint(http)
            except ClientDisconnect:  # mid-body or before the answer
                self.client_went(path, http)
                return Response(status_code=499)  # nginx's "client closed": never sent
            except Exception as error:  # noqa: BLE001 - one request never takes the server down
                response = _error_response(self.failure(error))
            if isinstance(response, EventStream):
                response.on_disconnect = lambda: self.client_went(path, http)
            self.counts[(path, response.status_code)] += 1
            return response
        return handle


def structured_output(tokenizer, *, vocab_size: int, eos_id: int) -> Callable:
    """`ServedModel.make_constraint` over the `Grammars` of serve/constraint.py (built on
    first use: it reads the vocabulary; ImportError without outlines-core)."""
    grammars = []

    def make(response_format: dict):
        from jaxformer.serve import constraint  # noqa: PLC0415 - outlines-core on first use

        if not grammars:
            grammars.append(constraint.Grammars(getattr(tokenizer, "hf_tokenizer", tokenizer),
                                     vocab_size=vocab_size, eos_id=eos_id))
        kind = response_format["type"]
        if kind == "json_schema":
            return grammars[0].json_schema(response_format["schema"])
        if kind == "json_object":
            return grammars[0].json_schema({"type": "object"})
        return grammars[0].regex(response_format["regex"])

    return make


def create_app(served: ServedModel, *, api_key: Optional[str] = None) -> Starlette:
    """The ASGI app serving `served` (started and stopped with the app's lifespan)."""
    api = Api(served, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.engine.start()
        try:
            yield
        finally:  # uvicorn has stopped accepting and waited for open requests
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: served.engine.stop(served.drain_timeout))

    routes = [("/v1/models", api.models, ["GET"], True),
              ("/v1/completions", api.completions, ["POST"], True),
              ("/v1/chat/completions", api.chat, ["POST"], True),
              ("/health", api.health, ["GET"], False),
              ("/metrics", api.metrics, ["GET"], False)]
    async def not_routed(request: HttpRequest, error: HTTPException) -> JSONResponse:
        """The router's errors (an unknown route: 404, a wrong method: 405) as OpenAI
        error bodies, as every other error of the API."""
        what = {404: f"no route {request.url.path}",
                405: f"method {request.method} is not allowed for {request.url.path}"}
        body = ApiError(what.get(error.status_code, str(error.detail)),
                        status=error.status_code,
                        code={404: "not_found", 405: "method_not_allowed"}.get(
                            error.status_code)).body()
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    app = Starlette(routes=[Route(path, api.route(path, endpoint, protected=protected),
                                  methods=methods)
                            for path, endpoint, methods, protected in routes],
                    exception_handlers={HTTPException: not_routed}, lifespan=lifespan)
    app.state.api = api
    return app
