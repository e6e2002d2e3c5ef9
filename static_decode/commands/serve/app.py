"""The HTTP side of `static-decode serve`: a Starlette app speaking the OpenAI API over the decode worker.

Routes: POST /v1/chat/completions, POST /v1/completions (both with `stream`: server-sent events in OpenAI's
chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health, POST /tokenize and /detokenize (as
llama-server has them) and, with --metrics, GET /metrics (Prometheus). Every refusal, including unknown routes
and methods, has OpenAI's error body. A chat reply under reasoning_format "deepseek" has its <think> span as
`reasoning_content` (delta.reasoning_content when streamed), split by static_decode.text.reasoning. A streamed
response whose client goes away cancels its request (the worker stops it at the next read-back); so does a
non-streamed one, watched through the ASGI receive channel. Logprobs and echo in OpenAI's formats:
static_decode.commands.serve.logprobs. A /v1/completions prompt list is answered prompt after prompt, choice `index`
i for prompt i (streamed: each choice's chunks, then its finish, before the next's), with the usage summed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from static_decode.commands.serve import logprobs as scored
from static_decode.commands.serve.api import APIError, Completion, Context, parse_all
from static_decode.commands.serve.metrics import Metrics
from static_decode.commands.serve.tokens import detokenize, tokenize
from static_decode.commands.serve.worker import Job, Usage, Worker
from static_decode.text.reasoning import ReasoningSplit
from static_decode.text.tool_calls import ToolCall, ToolCallSplit

log = logging.getLogger("static_decode.serve")


@dataclass(frozen=True)
class Served:
    """What the app serves: the checked-request context and the worker."""

    ctx: Context
    worker: Worker
    created: int  # when the model was loaded (unix seconds), for /v1/models
    metrics: Metrics | None = None  # serve --metrics: GET /metrics, and every answer counted


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


class _Reply:
    """The response objects of one request (ids and field layout per endpoint)."""

    def __init__(self, served: Served, req: Completion) -> None:
        self.chat, self.model = req.chat, served.ctx.model_name
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.split = ReasoningSplit(in_reasoning=req.reasoning_open) if req.reasoning else None
        self.calls = None if req.tool_format is None else ToolCallSplit(req.tool_format)
        self.called = False  # whether the reply's calls were found (its finish_reason is then "tool_calls")
        self.tokenizer, self.k = served.ctx.tokenizer, req.logprobs

    def logprobs(self, scores: list[scored.TokenScore] | None) -> dict[str, Any] | None:
        """The choice's `logprobs` of these tokens (None when the request asked for none)."""
        if self.k is None or scores is None:
            return None
        fmt = scored.chat_logprobs if self.chat else scored.completion_logprobs
        return fmt(self.tokenizer, scores, self.k)

    def deltas(self, text: str | None) -> list[dict[str, Any]]:
        """The chat deltas of the reply's next text (None: its end): content, or reasoning_content and content
        apart when the reasoning is split off; with tools, the calls the content ends with as tool_calls (their
        text held back from content until the end shows whether they are calls)."""
        if self.split is None:
            reasoning, content = "", text or ""
        else:
            reasoning, content = self.split.flush() if text is None else self.split.feed(text)
        calls: list[ToolCall] = []
        if self.calls is not None:
            content = self.calls.feed(content)
            if text is None:
                rest, calls = self.calls.flush()
                content += rest
        out: list[dict[str, Any]] = [d for d in ({"reasoning_content": reasoning}, {"content": content})
                                     if next(iter(d.values()))]
        if calls:
            self.called = True
            out.append({"tool_calls": [
                {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(calls)]})
        return out

    def finish(self, reason: str) -> str:
        return "tool_calls" if self.called else reason

    def _wrap(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False,
              delta: dict[str, Any] | None = None, scores: list[scored.TokenScore] | None = None,
              index: int = 0) -> dict[str, Any]:
        lp = self.logprobs(scores)
        if self.chat:
            delta = {**({"role": "assistant"} if role else {}), **(delta or {})}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return self._wrap([choice], chunk=True)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._wrap([], chunk=True), "usage": usage.body()}

    def whole(self, answers: list[tuple[str, str, list[scored.TokenScore]]], usage: Usage) -> dict[str, Any]:
        """The response of (text, finish_reason, records) for each prompt, in order."""
        choices = [self._choice(i, *answer) for i, answer in enumerate(answers)]
        return {**self._wrap(choices, chunk=False), "usage": usage.body()}

    def _choice(self, index: int, text: str, finish: str, scores: list[scored.TokenScore]) -> dict[str, Any]:
        lp = self.logprobs(scores)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.split is not None or self.calls is not None:  # as streamed: the whole text, then the end
                parts = [d for piece in (text, None) for d in self.deltas(piece)]
                message["content"] = "".join(d.get("content", "") for d in parts)
                reasoning = "".join(d.get("reasoning_content", "") for d in parts)
                if reasoning:
                    message["reasoning_content"] = reasoning
                calls = [{k: v for k, v in c.items() if k != "index"} for d in parts for c in d.get("tool_calls", [])]
                if calls:
                    message["tool_calls"] = calls
                    message["content"] = message["content"] or None  # OpenAI's: null beside calls
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": self.finish(finish)}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel `job` when the client goes away (the body is read already: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            return


async def _stream(reply: _Reply, job: Job, include_usage: bool, metrics: Metrics | None) -> AsyncIterator[bytes]:
    index, usages = 0, []  # the prompt being answered; the usage of those answered
    try:
        if reply.chat:
            yield _sse(reply.chunk("", role=True))
        while True:
            event = await job.events.get()
            if event[0] == "text" and reply.chat:
                deltas = reply.deltas(event[1]) or ([{}] if event[2] else [])  # records with no text yet
                for i, delta in enumerate(deltas):  # the records go with the event's last delta
                    yield _sse(reply.chunk(None, delta=delta, scores=event[2] if i == len(deltas) - 1 else None))
            elif event[0] == "text":
                yield _sse(reply.chunk(event[1], scores=event[2], index=index))
            elif event[0] == "done":
                _, finish, usage = event
                _observe(metrics, usage)
                usages.append(usage)
                if reply.chat:
                    for delta in reply.deltas(None):
                        yield _sse(reply.chunk(None, delta=delta))
                final = reply.chunk(None if reply.chat else "", reply.finish(finish), index=index)
                if include_usage:
                    final["usage"] = None
                yield _sse(final)
                index += 1
                if index < len(job.requests):
                    continue
                if include_usage:
                    yield _sse(reply.usage_chunk(Usage.total(usages)))
                yield _sse("[DONE]")
                return
            else:  # an error after the response started: OpenAI's error body as the last event
                yield _sse(event[1].body())
                return
    finally:  # also on a disconnect (the response task is cancelled) or a write to a closed connection
        job.cancelled.set()


async def _complete(request: Request, chat: bool) -> Response:
    served: Served = request.app.state.served
    try:
        reqs: list[Completion] = parse_all(await request.body(), served.ctx, chat=chat)
        req = reqs[0]  # what the response's form depends on is the same for every prompt of a list
        job = Job(reqs, asyncio.get_running_loop())
        served.worker.submit(job)
    except APIError as e:
        return error_response(e)
    except Exception as e:  # noqa: BLE001 - a failure while reading the request still gets OpenAI's error body
        log.exception("reading a request failed")
        return error_response(APIError(500, f"the request could not be read: {type(e).__name__}: {e}",
                                       type="server_error"))
    reply = _Reply(served, req)
    if req.stream:
        return StreamingResponse(_stream(reply, job, req.include_usage, served.metrics),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    parts: list[str] = []
    scores: list[scored.TokenScore] = []
    answers: list[tuple[str, str, list[scored.TokenScore]]] = []
    usages: list[Usage] = []
    try:
        while True:
            event = await job.events.get()
            if event[0] == "text":
                parts.append(event[1])
                scores.extend(event[2])
            elif event[0] == "done":
                _observe(served.metrics, event[2])
                answers.append(("".join(parts), event[1], scores))
                usages.append(event[2])
                parts, scores = [], []
                if len(answers) == len(reqs):
                    return JSONResponse(reply.whole(answers, Usage.total(usages)))
            else:
                return error_response(event[1])
    finally:
        watcher.cancel()
        job.cancelled.set()  # a no-op once done; a cancelled handler (shutdown) stops the decode


def _observe(metrics: Metrics | None, usage: Usage) -> None:
    if metrics is not None:
        metrics.observe(usage.prefill_ms, usage.ms_per_token, usage.completion_tokens)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def models(request: Request) -> Response:
    served: Served = request.app.state.served
    return JSONResponse({"object": "list", "data": [
        {"id": served.ctx.model_name, "object": "model", "created": served.created, "owned_by": "static-decode"}
    ]})


async def health(request: Request) -> Response:
    served: Served = request.app.state.served
    return JSONResponse({"status": "ok", "waiting": served.worker.waiting, **served.worker.counts})


async def tokenize_route(request: Request) -> Response:
    try:
        return JSONResponse(tokenize(await request.body(), request.app.state.served.ctx.tokenizer))
    except APIError as e:
        return error_response(e)


async def detokenize_route(request: Request) -> Response:
    try:
        return JSONResponse(detokenize(await request.body(), request.app.state.served.ctx.tokenizer))
    except APIError as e:
        return error_response(e)


async def metrics_route(request: Request) -> Response:
    body, kind = request.app.state.served.metrics.body()
    return Response(body, media_type=kind)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(APIError(exc.status_code, message, code=kind, headers=dict(exc.headers or {})))


async def _server_error(request: Request, exc: Exception) -> Response:
    """Anything else that fails in a handler: OpenAI's error body, not a bare text 500."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"{request.method} {request.url.path} failed: {type(exc).__name__}: {exc}",
                                   type="server_error"))


ROUTES = (
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/tokenize", tokenize_route, methods=["POST"]),
    Route("/detokenize", detokenize_route, methods=["POST"]),
)


def build_app(served: Served) -> Any:
    """The ASGI app over `served` (its worker already running); with metrics, GET /metrics and every answer
    counted."""
    routes = [*ROUTES] + ([] if served.metrics is None else [Route("/metrics", metrics_route, methods=["GET"])])
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.served = served
    return app if served.metrics is None else served.metrics.asgi(app)
