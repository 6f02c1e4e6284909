"""The FastAPI app: routes, error mapping, model loading, health (auth and HTTP limits: http_guard.py).

``build_app(state)`` makes an app around a ``ServerState``; the engine is built in a worker thread
after the app starts, so /health answers 503 while the model loads instead of refusing connections.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import turnout
from turnout.engine.async_engine import AsyncLLMEngine
from turnout.entrypoints.openai import protocol as P
from turnout.entrypoints.openai.errors import APIError, error_response
from turnout.entrypoints.openai.health import health_response
from turnout.entrypoints.openai.http_guard import RequestGuard
from turnout.entrypoints.openai.metrics import ServerMetrics
from turnout.entrypoints.openai.rl_routes import register_rl_routes
from turnout.entrypoints.openai.serve_options import ServeOptions
from turnout.entrypoints.openai.serving_chat import create_chat_completion
from turnout.entrypoints.openai.serving_completions import create_completion
from turnout.entrypoints.openai.serving_tokenize import TokenizeLane, add_tokenize_routes
from turnout.entrypoints.openai.web import register_web_routes

logger = logging.getLogger("turnout.serve")


@dataclass(eq=False)
class ServerState:
    engine_factory: Callable[[], object] | None = None  # () -> LLMEngine, run in a worker thread
    engine: object | None = None  # an already-built LLMEngine (tests)
    served_model_names: list[str] | None = None
    api_key: str | None = None
    enable_rl_endpoints: bool = False  # /sleep, /wake_up, /pause, ... (rl_routes.py)
    enable_docs: bool = False  # GET /openapi.json, behind the key (no /docs or /redoc pages: they load a CDN)
    stall_after_s: float = 30.0  # /health answers 503 "stalled" when work waits on an engine this long silent
    max_queue: int = 1024
    max_num_seqs: int = 256
    max_request_bytes: int = 4 << 20
    max_header_count: int = 100
    drain_timeout: float = 30.0
    options: ServeOptions = field(default_factory=ServeOptions)  # tool calls, reasoning, chat template, logprobs
    on_ready: Callable[["ServerState"], None] | None = None
    on_load_failed: Callable[[BaseException], None] | None = None
    on_engine_dead: Callable[[BaseException], None] | None = None  # the engine thread died (event loop)
    # filled in at start-up
    phase: str = "loading"  # loading | ready | failed | draining | dead
    async_engine: AsyncLLMEngine | None = None
    max_model_len: int = 0
    vocab_size: int = 0
    ops_report: list = field(default_factory=list)
    metrics: ServerMetrics | None = None

    def __post_init__(self):
        self.metrics = ServerMetrics(self)
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="turnout-tokenizer")  # one: HF tokenizers
        self.tokenize_lane = TokenizeLane()  # /tokenize and /detokenize: a thread of their own
        self._decode_cache: dict[int, str] = {}

    # ---------------------------------------------------------------- engine life
    async def load(self) -> None:
        try:
            engine = self.engine if self.engine is not None else await asyncio.to_thread(self.engine_factory)
            self.engine = engine
            try:  # our own copy: the engine thread detokenizes with its tokenizer while we encode
                self.tokenizer = copy.deepcopy(engine.tokenizer)
            except Exception:  # noqa: BLE001
                self.tokenizer = engine.tokenizer
            self.max_model_len = int(engine.max_model_len)
            self.vocab_size = _model_vocab(engine)
            if not self.served_model_names:
                self.served_model_names = [str(engine.model_name)]
            ops = getattr(engine, "ops", None)
            self.ops_report = list(ops.report()) if ops is not None and hasattr(ops, "report") else []
            async_cls = AsyncLLMEngine
            if hasattr(engine, "replicas"):  # --data-parallel-size > 1 (turnout/engine/dp.py)
                from turnout.engine.dp import DPAsyncEngine as async_cls
            self.async_engine = async_cls(engine, max_queue=self.max_queue, max_num_seqs=self.max_num_seqs,
                                          observer=self.metrics, on_dead=self._engine_died).start()
        except BaseException as e:  # noqa: BLE001
            self.phase = "failed"
            logger.error("model loading failed: %s: %s", type(e).__name__, e,
                         exc_info=logger.isEnabledFor(logging.DEBUG))
            if self.on_load_failed:
                self.on_load_failed(e)
            return
        self.phase = "ready"
        if self.on_ready:
            self.on_ready(self)

    def _engine_died(self, exc: BaseException) -> None:
        # The engine has already failed every waiting request; /health turns 503, new requests get 503.
        self.phase = "dead"
        logger.error("the engine died (%s: %s): every request failed; the server will exit non-zero",
                     type(exc).__name__, exc)
        if self.on_engine_dead:
            self.on_engine_dead(exc)

    @property
    def engine_dead(self) -> bool:
        return self.phase == "dead" or (self.async_engine is not None and self.async_engine.dead is not None)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        if self.async_engine is not None:
            await self.async_engine.shutdown(drain_timeout)
        self._tok_pool.shutdown(wait=False, cancel_futures=True)
        self.tokenize_lane.shutdown()

    def start_draining(self) -> None:
        if self.phase == "dead":
            return
        self.phase = "draining"
        if self.async_engine is not None:
            self.async_engine.start_draining()

    @property
    def healthy(self) -> bool:
        return self.phase == "ready" and self.async_engine is not None and self.async_engine.is_running

    def require_ready(self) -> None:
        if self.phase == "loading":
            raise APIError(503, "The model is still loading.", type="service_unavailable", code="loading",
                           headers={"Retry-After": "5"})
        if self.phase == "draining":
            raise APIError(503, "The server is shutting down.", type="service_unavailable", code="shutting_down",
                           headers={"Retry-After": "5", "Connection": "close"})
        if not self.healthy:
            raise APIError(503, "The engine is not available.", type="service_unavailable", code="engine_dead")

    def check_model(self, name: str | None) -> str:
        names = self.served_model_names or []
        if name is None or not names:
            return names[0] if names else (name or "")
        if name not in names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves {', '.join(names)}.",
                           param="model", code="model_not_found")
        return names[0]  # aliases answer as the first name, as vLLM's --served-model-name

    # ---------------------------------------------------------------- tokenizer (off the event loop)
    async def _tok(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, lambda: fn(*args, **kwargs))

    async def tokenize(self, text: str) -> list[int]:
        return list(await self._tok(self.tokenizer.encode, text))

    async def detokenize(self, ids: list[int]) -> str:
        return await self._tok(self.tokenizer.decode, ids)

    async def chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        if self.options.chat_template is not None:  # --chat-template
            kwargs["chat_template"] = self.options.chat_template
        try:
            ids = await self._tok(self.engine.apply_chat_template, messages,
                                  add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template rejecting the conversation is the client's mistake
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_messages") from None
        return list(ids)

    def decode_token(self, tid: int) -> str:
        s = self._decode_cache.get(tid)
        if s is None:
            s = self._decode_cache[tid] = self.tokenizer.decode([tid])
        return s


def _model_vocab(engine) -> int:
    """Token ids the model accepts: its embedding rows (the runner's vocab), else the tokenizer's size."""
    for holder in (engine, getattr(engine, "runner", None)):
        v = getattr(holder, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    return len(engine.tokenizer)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        load = asyncio.ensure_future(state.load())
        try:
            yield
        finally:
            load.cancel()
            await state.shutdown(0.0)

    # FastAPI's /docs and /redoc pages load their scripts from a CDN: never served. The API description
    # itself only with --enable-docs, and then behind the key (http_guard.KEYED_PATHS).
    app = FastAPI(title="turnout", version=turnout.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if state.enable_docs else None)
    app.state.turnout = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        # routes parse their bodies themselves (serving.parse); this is FastAPI's own, for a future route
        first = (exc.errors() or [{}])[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'request'}: {first.get('msg', 'invalid')}", param=param,
                              code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, msg, code=code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", type="internal_server_error",
                              code="internal_error")

    @app.get("/health")
    async def health():
        return health_response(state)

    @app.get("/version")
    async def version():
        return {"version": turnout.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=n, root=n, max_model_len=state.max_model_len or None)
                                 for n in state.served_model_names or []]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(state, request)

    register_web_routes(app, state)
    register_rl_routes(app, state)  # --enable-rl-endpoints (rl_routes.py)
    add_tokenize_routes(app, state)
    app.add_middleware(RequestGuard, state=state, max_header_count=state.max_header_count)
    return app
