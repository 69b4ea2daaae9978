"""The FastAPI app: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``;
``/health``; ``/metrics``; vLLM's ``/tokenize`` and ``/detokenize``.

This module only registers routes and the guard: each endpoint family is a module of its own over one
`state.ServerState` (`completions.create_completion`, `chat.create_chat_completion`,
`responses.create_response`), as vLLM's serving_* classes are.

`create_app(runner, tokenizer, config)` builds it over an `EngineRunner` (the engine steps in the
runner's thread; handlers only await their requests' outputs, so the event loop never blocks on a
step). A request flows: API key and body size (`_Guard`, before any parsing) -> pydantic validation
-> model name -> tokenize / chat template -> `SamplingParams` checks -> `EngineRunner.submit` (with
stop strings, a stop check the engine thread runs, which decodes the text) -> outputs turned into text by
`output.ChoiceText`
-> one JSON response, or server-sent events ending in ``data: [DONE]``.

Every failure is an OpenAI error object with its status: 400 bad parameter (pydantic's or the
engine's `ValueError`, with ``param`` naming the field), 401 missing or wrong ``--api-key``, 404
unknown model or path, 413 body over the limit, 429 more requests than the bounded queue takes,
503 shutting down. A client that disconnects (streamed or not) aborts its requests, which frees
their pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jax_sparse_kv.server.chat import create_chat_completion
from jax_sparse_kv.server.completions import create_completion
from jax_sparse_kv.server.engine_thread import EngineRunner
from jax_sparse_kv.server.metrics import CONTENT_TYPE, Metrics
from jax_sparse_kv.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    now,
)
from jax_sparse_kv.server.responses import ResponsesRequest, create_response
from jax_sparse_kv.server.state import ServerConfig, ServerState, error_response, valid_text
from jax_sparse_kv.server.tokenizer import TextTokenizer

__all__ = ["create_app", "ServerConfig"]

log = logging.getLogger("jax_sparse_kv.server")

_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the server's limit of {limit} bytes")


class _Guard:
    """Pure ASGI middleware: API key, body size, and the response counter (streaming untouched)."""

    def __init__(self, app, config: ServerConfig, metrics: Metrics):
        self.app, self.config, self.metrics = app, config, metrics
        self._key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = []

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            headers = dict(scope.get("headers") or [])
            if self._key is not None and path.startswith("/v1") and not self._authorized(headers):
                body = error_body(
                    "missing or wrong API key (send 'Authorization: Bearer <key>')",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
                return await JSONResponse(body, 401)(scope, receive, counted_send)
            limit = self.config.max_request_bytes
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                body = error_body(
                    f"request body exceeds the server's limit of {limit} bytes",
                    "invalid_request_error",
                    None,
                    "request_too_large",
                )
                return await JSONResponse(body, 413)(scope, receive, counted_send)
            seen = 0

            async def limited_receive():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise _BodyTooLarge(limit)
                return message

            await self.app(scope, limited_receive, counted_send)
        finally:
            endpoint = path if path in _ENDPOINTS else "other"
            self.metrics.http_responses.labels(endpoint, str(status[0] if status else 499)).inc()

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


def create_app(runner: EngineRunner, tokenizer: TextTokenizer, config: ServerConfig) -> FastAPI:
    """The app; its lifespan starts the runner's thread and shuts it down (aborting what still runs). Every handler
    reads the one `ServerState` from ``request.app.state.server``."""
    metrics = Metrics(lambda: runner.stats, lambda: runner.in_flight, runner)
    runner.on_stats = metrics.observe_step
    app = FastAPI(title="jax_sparse_kv", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(runner, tokenizer, config, metrics)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.get("/health")(_health)
    app.get("/metrics")(_metrics)
    app.get("/v1/models")(_models)
    app.get("/v1/models/{model:path}")(_model)
    app.post("/tokenize")(_tokenize)
    app.post("/detokenize")(_detokenize)
    app.post("/v1/completions")(_completions)
    app.post("/v1/chat/completions")(_chat_completions)
    app.post("/v1/responses")(_responses)
    return _Guard(app, config, metrics)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    runner = app.state.server.runner
    runner.start(asyncio.get_running_loop())
    try:
        yield
    finally:
        await asyncio.get_running_loop().run_in_executor(None, runner.shutdown)


def _server(request: Request) -> ServerState:
    return request.app.state.server


# ------------------------------------------------------------ errors: OpenAI's error object


async def _api_error(request: Request, e: APIError):
    return error_response(e.status, e.message, e.param, e.code, e.type)


async def _validation_error(request: Request, e: RequestValidationError):
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
    return error_response(400, message, param, code=first.get("type"))


async def _http_error(request: Request, e: StarletteHTTPException):
    message = str(e.detail) if e.status_code != 404 else f"no route {request.url.path}"
    return error_response(e.status_code, message, code="request_too_large" if e.status_code == 413 else None)


async def _internal_error(request: Request, e: Exception):
    log.exception("internal error")
    return error_response(500, f"internal server error: {type(e).__name__}", type="server_error")


# ------------------------------------------------------------ health, metrics, models


async def _health(request: Request):
    runner, config = _server(request).runner, _server(request).config
    if runner.error is not None:
        return JSONResponse({"status": "error", "error": repr(runner.error)}, 503)
    if runner.draining:
        return JSONResponse({"status": "shutting down"}, 503)
    if not runner.ready.is_set():
        done, total = runner.warmup_progress
        body = {"status": "starting"}
        if runner.warmup:
            body["warmup"] = {"compiled_programs": done, "total_programs": total}
        return JSONResponse(body, 503)
    waited = 0.0 if runner.sync is None else runner.sync.waiting_s
    if waited > config.stall_timeout_s:
        message = f"waiting {waited:.0f} s for the other processes: one of them died or hangs"
        return JSONResponse({"status": "stalled", "error": message}, 503)
    return {"status": "ok"}


async def _metrics(request: Request):
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(server: ServerState) -> dict:
    return {
        "id": server.config.model_name,
        "object": "model",
        "created": now(),
        "owned_by": "jax_sparse_kv",
        "max_model_len": server.max_model_len,
    }


async def _models(request: Request):
    return {"object": "list", "data": [_model_card(_server(request))]}


async def _model(model: str, request: Request):
    server = _server(request)
    server.check_model(model)
    return _model_card(server)


# ------------------------------------------------------------ vLLM's /tokenize and /detokenize


async def _tokenize(req: TokenizeRequest, request: Request):
    """vLLM's: the ids of a prompt, or of chat messages as the template renders them."""
    server = _server(request)
    tokenizer = server.tokenizer
    server.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if req.messages is not None:
        _, ids = await asyncio.to_thread(
            server.render_chat, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs
        )
    else:
        ids = tokenizer.encode(valid_text(req.prompt, "prompt"), add_special_tokens=req.add_special_tokens)
    out = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}
    out["token_strs"] = [tokenizer.token_text(t) for t in ids] if req.return_token_strs else None
    return out


async def _detokenize(req: DetokenizeRequest, request: Request):
    server = _server(request)
    tokenizer = server.tokenizer
    server.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(
            400,
            f"tokens: {bad[0]} is not a token id of this tokenizer (0 <= id < {tokenizer.vocab_size})",
            param="tokens",
        )
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


# ------------------------------------------------------------ generation: the endpoint modules


async def _completions(req: CompletionRequest, request: Request):
    return await create_completion(_server(request), req, request)


async def _chat_completions(req: ChatCompletionRequest, request: Request):
    return await create_chat_completion(_server(request), req, request)


async def _responses(req: ResponsesRequest, request: Request):
    return await create_response(_server(request), req, request)
