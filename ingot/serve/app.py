"""The HTTP side: an OpenAI-compatible API on FastAPI, in front of an Engine.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events)
    GET  /v1/models             GET  /health           GET /metrics (Prometheus text)

Requests are parsed and checked here (pydantic models of the OpenAI schema); anything wrong is a
4xx with OpenAI's body, {"error": {"message", "type", "param", "code"}}; a full queue is 429. The
scheduler thread talks back through an asyncio queue per request; a client that goes away cancels
its request, and the scheduler frees the slot before its next step.

Sampling parameters served: max_tokens (max_completion_tokens), temperature, top_p, seed, stop (up
to 4), n (independent samples, each in its own slot, choice i seeded seed + i; more than the slots
is a 400), presence_penalty and frequency_penalty (over the tokens generated so far, as OpenAI
describes them), logit_bias, logprobs/top_logprobs (the model's own, before biases and penalties).
response_format other than {"type": "text"} is refused by name (no constrained decoding). With
--device cuda, requests without logprobs, biases or penalties have their tokens chosen on the GPU
(serve/sampling.py): a seed repeats that server's answers, drawn otherwise than `ingot generate`'s.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
import traceback
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import IngotError
from .engine import Engine, Event, QueueFull, Request, SamplingParams

MAX_BODY_BYTES = 4 << 20       # a request body larger than this is refused (413)
MAX_STOP = 4                   # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300           # entries of logit_bias (OpenAI's limit)


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Schema):
    type: Literal["text"]
    text: str


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Schema):
    include_usage: bool = False


class ResponseFormat(_Schema):
    type: str


class _Common(_Schema):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)                   # independent samples, each in its own slot
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in value.items():
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"keys are token ids, not {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in -100..100, not {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings")
        return stops


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, le=False)            # not implemented
    suffix: str | None = Field(None, max_length=0)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind)


def error_response(status: int, message: str, param=None, code=None, kind: str | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return (f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid request")), where or None


def create_app(engine: Engine, model_id: str | None = None) -> FastAPI:
    """The FastAPI application serving `engine` (base model id: the model file's name)."""
    base_id = model_id or os.path.splitext(os.path.basename(os.path.normpath(engine.path)))[0]
    ids = {base_id: None, **{name: name for name in engine.adapters if name is not None}}
    created = int(time.time())
    app = FastAPI(title="ingot serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.model_ids = list(ids)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        message, param = _validation_message(e)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        traceback.print_exception(e)      # the server's log; the client gets one sentence
        return error_response(500, f"internal error ({type(e).__name__}).")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(engine.running), "waiting": len(engine.waiting)}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "ingot",
                                            **({"parent": base_id} if a else {})} for i, a in ids.items()]}

    async def parse(http: HttpRequest, schema: type[_Schema]):
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body has {declared} bytes; at most {MAX_BODY_BYTES} are accepted.")
        body = bytearray()
        async for part in http.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes.")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:     # (UnicodeDecodeError is a ValueError)
            raise ApiError(400, f"the request body is not valid JSON ({str(e)[:200]}).") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object.")
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise ApiError(400, message, param) from None
        if req.model not in ids:
            raise ApiError(404, f"The model {req.model!r} does not exist; this server has {', '.join(sorted(ids))}.",
                           "model", "model_not_found")
        return req

    def sampling(req: _Common, prompt_tokens: int, max_tokens: int | None, logprobs: bool, top: int) -> SamplingParams:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens >= engine.context:
            raise ApiError(400, f"{name} is {max_tokens} but the context holds {engine.context} tokens.", name)
        if req.response_format is not None and req.response_format.type != "text":
            raise ApiError(400, f"response_format {req.response_format.type!r} is not supported; this server writes "
                                f"free text only (response_format {{\"type\": \"text\"}}).", "response_format")
        if req.n > engine.max_batch:
            raise ApiError(400, f"n is {req.n} but this server runs {engine.max_batch} sequences at once "
                                f"(--max-batch); ask for at most {engine.max_batch}.", "n")
        vocab = engine.config.vocab_size
        bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
        if any(t >= vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias: token ids must be in 0..{vocab - 1}.", "logit_bias")
        limit = max_tokens if max_tokens is not None else engine.context - prompt_tokens
        return SamplingParams(max_tokens=limit, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                              stop=tuple(req.stop or ()), logprobs=logprobs, top_logprobs=top,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              logit_bias=bias)

    def submit(req: _Common, ids_: list[int], params: SamplingParams) -> tuple[list[Request], asyncio.Queue]:
        """req.n requests (choice i's seed: seed + i), their events on one queue as (i, event)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def on_event_of(index: int):
            def on_event(event: Event) -> None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (index, event))
                except RuntimeError:   # the loop is gone (shutdown)
                    pass
            return on_event
        requests = []
        try:
            for i in range(req.n):
                choice = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                requests.append(engine.submit(Request(ids_, choice, adapter=ids[req.model], on_event=on_event_of(i))))
        except (QueueFull, IngotError) as e:
            for request in requests:
                request.cancel()
            engine.wake()
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), code="queue_full", kind="rate_limit_error") from None
            raise ApiError(400, str(e), "messages" if isinstance(req, ChatRequest) else "prompt",
                           "context_length_exceeded" if "context" in str(e) else None) from None
        return requests, queue

    def encode_chat(req: ChatRequest) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            return engine.llm.encode_prompt(messages)
        except IngotError as e:
            raise ApiError(400, f"messages: {e}", "messages") from None

    def encode_completion(req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            vocab = engine.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in 0..{vocab - 1}.", "prompt")
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request is served, not {len(prompt)}.", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: the prompt is empty.", "prompt")
        return engine.llm.encode_prompt(prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        req = await parse(http, ChatRequest)
        ids_ = encode_chat(req)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", "top_logprobs")
        params = sampling(req, len(ids_), req.max_completion_tokens or req.max_tokens, req.logprobs, top)
        requests, queue = submit(req, ids_, params)
        return await respond(http, req, requests, queue, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        req = await parse(http, CompletionRequest)
        ids_ = encode_completion(req)
        limit = req.max_completion_tokens or req.max_tokens
        params = sampling(req, len(ids_), limit if limit is not None else 16, req.logprobs is not None, req.logprobs or 0)
        requests, queue = submit(req, ids_, params)
        return await respond(http, req, requests, queue, chat=False)

    async def respond(http: HttpRequest, req: _Common, requests: list[Request], queue: asyncio.Queue, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        want_logprobs = requests[0].params.logprobs
        if req.stream:
            usage_chunk = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(engine, requests, queue, rid, now, req.model, chat, want_logprobs, usage_chunk),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        def cancel():
            for request in requests:
                request.cancel()
            engine.wake()
        n = len(requests)
        text, entries, done = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        while any(d is None for d in done):
            try:
                i, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    cancel()
                    return Response(status_code=499)
                continue
            except asyncio.CancelledError:
                cancel()
                raise
            if event.kind == "text":
                text[i].append(event.text)
                entries[i].extend(event.logprobs)
            elif event.kind == "error":
                cancel()
                return error_response(event.status, event.message)
            else:
                done[i] = event
        choices = []
        for i in range(n):
            body, reason = "".join(text[i]), done[i].finish_reason
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": body},
                                "logprobs": {"content": [_chat_logprob(e) for e in entries[i]]} if want_logprobs else None,
                                "finish_reason": reason})
            else:
                choices.append({"index": i, "text": body,
                                "logprobs": _completion_logprobs(entries[i], 0) if want_logprobs else None,
                                "finish_reason": reason})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now, "model": req.model,
                "choices": choices, "usage": _usage([d.usage for d in done])}

    return app


def _usage(usages: list[dict]) -> dict:
    """The usage of n choices of one prompt: the prompt counted once, the completions summed."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": first["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": max(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}}


async def _stream(engine: Engine, requests: list[Request], queue: asyncio.Queue, rid: str, now: int, model: str,
                  chat: bool, want_logprobs: bool, usage_chunk: bool):
    """Server-sent events of one request's n choices (each chunk names its index); leaving early (client
    gone) cancels them all."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(requests)
    usages: list[dict | None] = [None] * n
    offsets = [0] * n
    failed = False

    def chunk(choice: dict | None, **extra) -> str:
        body = {"id": rid, "object": obj, "created": now, "model": model, "choices": [choice] if choice else [], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if chat:
            for i in range(n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        while any(u is None for u in usages):
            i, event = await queue.get()
            if event.kind == "text":
                if chat:
                    logprobs = {"content": [_chat_logprob(e) for e in event.logprobs]} if want_logprobs else None
                    yield chunk({"index": i, "delta": {"content": event.text}, "logprobs": logprobs, "finish_reason": None})
                else:
                    logprobs = _completion_logprobs(event.logprobs, offsets[i]) if want_logprobs else None
                    yield chunk({"index": i, "text": event.text, "logprobs": logprobs, "finish_reason": None})
                offsets[i] += len(event.text)
            elif event.kind == "error":
                failed = True
                yield f"data: {json.dumps({'error': {'message': event.message, 'type': 'server_error' if event.status >= 500 else 'invalid_request_error', 'param': None, 'code': None}})}\n\n"
                break
            else:
                usages[i] = event.usage
                if chat:
                    yield chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason})
                else:
                    yield chunk({"index": i, "text": "", "logprobs": None, "finish_reason": event.finish_reason})
        if usage_chunk and not failed:
            yield chunk(None, usage=_usage(usages))
        yield "data: [DONE]\n\n"
    finally:
        if failed or any(u is None for u in usages):
            for request in requests:
                request.cancel()
            engine.wake()


def _chat_logprob(entry: dict) -> dict[str, Any]:
    def one(e):
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8"))}
    return {**one(entry), "top_logprobs": [one(t) for t in entry.get("top_logprobs", [])]}


def _completion_logprobs(entries: list[dict], offset: int) -> dict[str, Any]:
    tokens, offsets, at = [], [], offset
    for e in entries:
        tokens.append(e["token"])
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
            "text_offset": offsets}
