"""The HTTP routes (FastAPI): OpenAI's completions, chat completions and models endpoints, and
a health check, on top of an `Engine`.

Every request is checked and tokenized here, then queued in the engine (one engine request
per choice when `n` > 1); its tokens (and, if asked, their logprobs) come back
through an asyncio queue (the engine thread hands them over with `call_soon_threadsafe`),
are detokenized and checked for stop strings (`text.CompletionText`), and go out as one JSON
body or as server-sent events. A stop string, a client that disconnects, or a request task
cancelled at shutdown cancels the request in the engine, which frees its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cca_jax.serve import schemas
from cca_jax.serve.engine import Engine, EngineStopped, QueueFull
from cca_jax.serve.engine import Request as EngineRequest
from cca_jax.serve.text import CompletionText, TokenStrings

SEED_RANGE = 2**31   # request seeds are taken modulo this (jax.random.PRNGKey's int32 seeds)


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_name: str
    retry_after_s: int = 1          # the Retry-After of a 503 (queue full, starting)
    shutdown_timeout_s: float = 30.0


class APIError(Exception):
    """An OpenAI-style error response: status, message, type, param, code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = schemas.ErrorResponse(error=schemas.ErrorBody(
            message=str(self), type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


class TokenQueue:
    """The engine's events for one request, moved onto the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, token, reason, logprobs=None) -> None:   # on the engine thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, reason, logprobs))

    async def get(self):
        return await self.queue.get()


@dataclasses.dataclass
class Generation:
    """One request in flight, from the route's side."""
    engine: Engine
    handle: object
    tokens: TokenQueue
    text: CompletionText
    prompt_tokens: int
    strings: TokenStrings | None = None   # set when the request asked for logprobs
    completion_tokens: int = 0
    finish_reason: str | None = None
    pending: list = dataclasses.field(default_factory=list)   # logprob entries not yet sent
    text_offset: int = 0

    async def pieces(self):
        """Yield text pieces until the request ends; then `finish_reason` is set. With
        logprobs, each token's entry waits in `pending` (`take_logprobs`)."""
        try:
            while self.finish_reason is None:
                token, reason, logprobs = await self.tokens.get()
                if token is not None and logprobs is not None and self.strings is not None:
                    self.pending.append(self._entry(token, logprobs))
                if token is None:
                    if reason in ("cancelled", "error"):
                        raise APIError(503 if reason == "cancelled" else 500,
                                       "the request was cancelled: the server is shutting "
                                       "down." if reason == "cancelled" else
                                       "the engine failed; see the server's log.",
                                       type="server_error", code=reason)
                    self.finish_reason = reason
                    piece = self.text.finish()
                else:
                    self.completion_tokens += 1
                    piece = self.text.push(token)
                    if self.text.stopped:
                        self.engine.cancel(self.handle)
                        self.finish_reason = "stop"
                if piece:
                    yield piece
        finally:
            if self.finish_reason is None:
                self.engine.cancel(self.handle)

    def _entry(self, token: int, logprobs) -> dict:
        """One token's logprob entry: its text, logprob and bytes, and the alternatives'."""
        def item(tok, lp):
            text = self.strings.text(tok)
            return {"token": text, "logprob": lp, "bytes": self.strings.bytes(tok, text)}
        entry = item(token, logprobs.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in zip(logprobs.top_ids,
                                                              logprobs.top_logprobs)]
        self.strings.push(token)
        return entry

    def take_logprobs(self) -> list[dict]:
        """The logprob entries of the tokens since the last call (in order)."""
        taken, self.pending = self.pending, []
        return taken

    def completion_logprobs(self, entries: list[dict]) -> schemas.CompletionLogprobs | None:
        """Entries (`take_logprobs`) in the completions format (offsets run on across
        chunks); None without logprobs."""
        if self.strings is None:
            return None
        out = schemas.CompletionLogprobs()
        for e in entries:
            out.tokens.append(e["token"])
            out.token_logprobs.append(e["logprob"])
            out.top_logprobs.append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
            out.text_offset.append(self.text_offset)
            self.text_offset += len(e["token"])
        return out

    def chat_logprobs(self, entries: list[dict]) -> schemas.ChoiceLogprobs | None:
        """Entries (`take_logprobs`) in the chat format; None without logprobs."""
        if self.strings is None:
            return None
        return schemas.ChoiceLogprobs(content=[schemas.TokenLogprob(**e) for e in entries])


def usage(gens: list[Generation]) -> schemas.Usage:
    """A request's usage: its prompt once, the tokens of all its choices."""
    prompt, completion = gens[0].prompt_tokens, sum(g.completion_tokens for g in gens)
    return schemas.Usage(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)


def _sse(obj) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def create_app(engine: Engine, tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI application; its lifespan starts the engine (compiling its programs:
    /health answers 503 until they are ready) and shuts it down."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown, settings.shutdown_timeout_s)

    app = FastAPI(title="cca-jax", lifespan=lifespan)
    app.state.engine = engine
    max_len = engine.config.max_len

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                        param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    def check_common(body: schemas.SamplingParams) -> None:
        if body.model != settings.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist: this server runs "
                           f"{settings.model_name!r} (GET /v1/models).", param="model",
                           code="model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        if not engine.ready.is_set():
            raise APIError(503, "the server is still compiling its programs; retry shortly.",
                           type="server_error", code="starting",
                           headers={"Retry-After": str(settings.retry_after_s)})

    def check_length(prompt_ids: list[int], max_tokens: int, param: str) -> None:
        if len(prompt_ids) + max_tokens > max_len:
            raise APIError(400, f"this server's maximum context length is {max_len} tokens: "
                           f"the prompt has {len(prompt_ids)} and max_tokens asks for "
                           f"{max_tokens} more. Shorten the prompt or lower max_tokens.",
                           param=param, code="context_length_exceeded")

    def submit(body: schemas.SamplingParams, prompt_ids: list[int], max_tokens: int,
               logprobs: int | None = None) -> list[Generation]:
        """The request's `n` choices, queued; choice i samples with seed + i. If one cannot
        be queued, those already queued are cancelled."""
        base = secrets.randbelow(SEED_RANGE) if body.seed is None else body.seed
        gens = []
        try:
            for i in range(body.n):
                gens.append(submit_one(body, prompt_ids, max_tokens, (base + i) % SEED_RANGE,
                                       logprobs))
        except APIError:
            cancel_all(gens)
            raise
        return gens

    def submit_one(body: schemas.SamplingParams, prompt_ids: list[int], max_tokens: int,
                   seed: int, logprobs: int | None) -> Generation:
        request = EngineRequest(prompt_ids, max_tokens=max_tokens,
                                temperature=float(body.temperature), top_k=body.top_k or None,
                                top_p=float(body.top_p), seed=seed, logprobs=logprobs)
        tokens = TokenQueue(asyncio.get_running_loop())
        try:
            handle = engine.submit(request, tokens)
        except QueueFull as e:
            raise APIError(503, f"the server is busy ({e}); retry shortly.",
                           type="server_error", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_s)}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_value") from None
        return Generation(engine, handle, tokens,
                          CompletionText(tokenizer, prompt_ids, body.stop_strings()),
                          len(prompt_ids),
                          None if logprobs is None else TokenStrings(tokenizer, prompt_ids))

    def cancel_all(gens: list[Generation]) -> None:
        for gen in gens:
            engine.cancel(gen.handle)

    async def collect(gens: list[Generation], request: Request) -> list[str]:
        """Each choice's whole text; a client that goes away cancels them all."""
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.1)
            cancel_all(gens)

        async def text(gen):
            return "".join([piece async for piece in gen.pieces()])

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.gather(*(text(gen) for gen in gens))
        except BaseException:
            cancel_all(gens)
            raise
        finally:
            watcher.cancel()

    async def stream(gens: list[Generation], chunk, first=None, include_usage=False):
        """Server-sent events: `first(i)` per choice (if given), `chunk(i, piece, None,
        entries)` per piece of choice i as it comes (`entries`: its tokens' logprobs), the
        final `chunk(i, None, finish_reason, entries)` of each, the usage chunk if asked,
        then [DONE]. A client that goes away cancels every choice."""
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for piece in gen.pieces():
                    await events.put((i, piece, None, gen.take_logprobs()))
                await events.put((i, None, gen.finish_reason, gen.take_logprobs()))
            except APIError as e:
                await events.put((i, e, "error", []))

        pumps = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
        try:
            if first is not None:
                for i in range(len(gens)):
                    yield _sse(first(i))
            for _ in range(len(gens)):
                while True:
                    i, piece, finish, entries = await events.get()
                    if finish == "error":
                        raise piece
                    yield _sse(chunk(i, piece, finish, entries))
                    if finish is not None:
                        break
            if include_usage:
                yield _sse(chunk(0, None, None, [], usage=usage(gens)))
        except APIError as e:
            yield _sse(schemas.ErrorResponse(error=schemas.ErrorBody(
                message=str(e), type=e.type, param=e.param, code=e.code)))
        finally:
            for task in pumps:   # their generators cancel the requests still running
                task.cancel()
        yield "data: [DONE]\n\n"

    def streaming(events) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error", "message": str(engine.error)}, 503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "starting"}, 503,
                                headers={"Retry-After": str(settings.retry_after_s)})
        return {"status": "ok", **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return schemas.ModelList(data=[schemas.ModelCard(id=settings.model_name)])

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request):
        check_common(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request: send the others separately.",
                               param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):   # off the event loop: a long prompt takes a while
            prompt_ids = list((await asyncio.to_thread(tokenizer, prompt))["input_ids"])
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise APIError(400, "the prompt is empty.", param="prompt", code="invalid_value")
        check_length(prompt_ids, body.max_tokens, "prompt")
        gens = submit(body, prompt_ids, body.max_tokens, logprobs=body.logprobs)
        cid = schemas.new_id("cmpl")

        def choice(i, text, finish, entries):
            return schemas.CompletionChoice(index=i, text=text or "", finish_reason=finish,
                                            logprobs=gens[i].completion_logprobs(entries))

        def chunk(i, piece, finish, entries, usage=None):
            choices = [] if usage else [choice(i, piece, finish, entries)]
            return schemas.Completion(id=cid, model=settings.model_name, choices=choices,
                                      usage=usage)

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return streaming(stream(gens, chunk, include_usage=include))
        texts = await collect(gens, request)
        return schemas.Completion(id=cid, model=settings.model_name, usage=usage(gens),
                                  choices=[choice(i, text, gen.finish_reason,
                                                  gen.take_logprobs())
                                           for i, (gen, text) in enumerate(zip(gens, texts))])

    def chat_prompt(body: schemas.ChatRequest) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"the model {settings.model_name!r} has no chat template "
                           "(its tokenizer_config.json sets no chat_template): use "
                           "/v1/completions with a plain prompt instead.", param="messages",
                           code="chat_template_missing")
        messages = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):   # content parts: the text ones, joined
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            messages.append({"role": m.role, "content": content or ""})
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        except Exception as e:  # noqa: BLE001  (jinja templates raise anything)
            raise APIError(400, f"the chat template refused these messages: {e}",
                           param="messages", code="invalid_value") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, request: Request):
        check_common(body)
        prompt_ids = await asyncio.to_thread(chat_prompt, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(max_len - len(prompt_ids), 1)
        check_length(prompt_ids, max_tokens, "messages")
        gens = submit(body, prompt_ids, max_tokens,
                      logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        cid = schemas.new_id("chatcmpl")

        def chunk(i, piece, finish, entries, usage=None, role=None):
            choices = [] if usage else [schemas.ChatChunkChoice(
                index=i, delta=schemas.Delta(role=role, content=piece), finish_reason=finish,
                logprobs=None if role else gens[i].chat_logprobs(entries))]
            return schemas.ChatCompletionChunk(id=cid, model=settings.model_name,
                                               choices=choices, usage=usage)

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return streaming(stream(gens, chunk, include_usage=include,
                                    first=lambda i: chunk(i, "", None, [], role="assistant")))
        texts = await collect(gens, request)
        return schemas.ChatCompletion(
            id=cid, model=settings.model_name, usage=usage(gens),
            choices=[schemas.ChatChoice(index=i, message=schemas.AssistantMessage(content=text),
                                        finish_reason=gen.finish_reason,
                                        logprobs=gen.chat_logprobs(gen.take_logprobs()))
                     for i, (gen, text) in enumerate(zip(gens, texts))])

    return app
