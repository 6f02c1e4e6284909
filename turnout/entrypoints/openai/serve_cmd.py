"""`turnout serve [MODEL]`: the OpenAI-compatible server (flag names as in vLLM).

SIGTERM (or Ctrl-C) drains: new requests get 503, running ones finish (up to --drain-timeout), then the
process exits 0. A second signal stops at once.

Exit status: 0 after a drain; 1 when the model failed to load or the engine died. An engine that dies (a
fault no request owns: a lost device, a broken kernel) fails every waiting client at once, and the
process exits 1 --dead-engine-grace seconds later, so that systemd, Kubernetes or Ray restarts it; a
signal to a server whose engine is dead exits 1 too. 2: a bad flag or an address already in use.

This module holds the flags and wires the app; the listening socket and the draining uvicorn server are
serve_lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import logging

from turnout import envs
from turnout.entrypoints.engine_args import add_engine_args, add_vllm_noop_args, engine_kwargs, note_vllm_noop_args
from turnout.entrypoints.openai.serve_lifecycle import bind_socket
from turnout.utils.gc_freeze import freeze_startup_heap
from turnout.worker.concurrency import MAX_DEFAULT_SEQS

logger = logging.getLogger("turnout.serve")


# Argument groups, in --help order; docs/serve.md's flag tables are generated from them (serve_docs.py).
GROUPS = ("model", "engine", "server", "API", "HTTP limits", "lifecycle", "vLLM flags without effect")


def add_arguments(p) -> None:
    g = {name: p.add_argument_group(name) for name in GROUPS}
    m, e, s, api, h, life, vllm = (g[n] for n in GROUPS)
    m.add_argument("model", nargs="?", default=None,
                   help="HF model id, local directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    m.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                   help="the same as the positional MODEL (vLLM's spelling); give one of the two")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the model answers to in the API; others get 404 (default: MODEL, else the "
                        "model's name)")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; a model whose config needs its repository's own "
                        "code is refused at start-up all the same (turnout never runs model code)")
    # Every other engine flag comes from EngineConfig's fields (turnout/config.py holds their help texts).
    add_engine_args(p, exclude=("model", "served_model_name"), groups={"model": m, "engine": e},
                    helps={"max_model_len": "context length; longer requests get 400 context_length_exceeded "
                                            "(default: the model's)",
                           "max_tokens_per_request": "the most one request may cost: n x (prompt + max_tokens) "
                                                     "plus its logprob entries; more is refused with 400 "
                                                     "(default: no limit)"})
    e.add_argument("--headless", action="store_true",
                   help="nodes 1.. of a multi-node engine: run this node's ranks with node 0's engine "
                        "configuration, no HTTP; exits when node 0 goes")

    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on; bound before the model loads, so a port in use fails at once")
    s.add_argument("--enable-rl-endpoints", action="store_true", help="serve the RL control endpoints (/sleep, /wake_up, /pause, /resume, /update_weights_from_disk, ...; docs/architecture.md)")
    s.add_argument("--api-key", default=envs.get().api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /ops, the RL "
                        "endpoints and /openapi.json; an empty KEY is an error (default: $TURNOUT_API_KEY)")
    s.add_argument("--enable-docs", action="store_true",
                   help="serve the API description at /openapi.json (behind --api-key); the /docs and /redoc "
                        "pages are never served: they load their scripts from a CDN")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests beyond the free running slots; more get 503 + Retry-After")

    from turnout.entrypoints.openai.reasoning import REASONING_PARSERS
    from turnout.entrypoints.openai.serve_options import DEFAULT_MAX_LOGPROBS
    from turnout.entrypoints.openai.tool_parsers import TOOL_PARSERS

    api.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='serve tool_choice "auto" (the default with tools): the model writes calls in its '
                          'own syntax, which the tool-call parser below reads; without this flag "auto" is a '
                          '400 ("required" and named choices need neither: structured output enforces them)')
    api.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                     help="the model's tool-call syntax (Qwen2.5 / Qwen3 / Hermes: hermes; Llama 3.x: "
                          "llama3_json; Mistral: mistral; GPT-OSS's harmony: openai)")
    api.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                     help="split <think> ... </think> (GPT-OSS: openai_gptoss, its analysis channel) off into "
                          "message.reasoning_content (and delta.reasoning_content when streaming)")
    api.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    api.add_argument("--grammar-timeout", type=float, default=10.0,
                     help="seconds a request's structured output / tool schemas may take to build and compile "
                          "(off the event loop); longer is a 400 naming the field")
    api.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                     help="the most logprobs / top_logprobs a request may ask for (more: 400)")

    h.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    h.add_argument("--max-connections", type=int, default=None,
                   help="open connections beyond this are refused with 503 "
                        "(default: --max-queue + --max-num-seqs + 64; 1024 for an automatic --max-num-seqs)")
    h.add_argument("--timeout-header", type=float, default=15.0,
                   help="seconds a connection may take to send its request headers (else 408, closed)")
    h.add_argument("--timeout-body", type=float, default=60.0,
                   help="seconds a request may take to send its body after the headers (else 408, closed)")
    h.add_argument("--timeout-write", type=float, default=60.0,
                   help="seconds a client may leave a response unread (no byte acknowledged) before it is "
                        "closed and its request aborted")
    h.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open")
    h.add_argument("--h11-max-incomplete-event-size", type=int, default=64 << 10,
                   help="bytes of request line + headers (larger: 400)")
    h.add_argument("--h11-max-header-count", type=int, default=100, help="header fields (more: 431)")

    life.add_argument("--drain-timeout", type=float, default=30.0,
                      help="seconds running requests may take to finish after SIGTERM; the rest are aborted")
    life.add_argument("--dead-engine-grace", type=float, default=3.0,
                      help="seconds between the engine dying and the process exiting 1 (clients get their "
                           "errors meanwhile; /health answers 503)")
    add_vllm_noop_args(vllm, server=True)


def resolve_model(args) -> str | None:
    """MODEL given as the positional or as --model (vLLM's spelling); both, differing, is a mistake."""
    flag = getattr(args, "model_flag", None)
    if flag is not None and args.model is not None and flag != args.model:
        raise ValueError(f"--model: the model is given twice ({args.model!r} and --model {flag!r}); give one")
    return args.model if args.model is not None else flag


def build_config(args):
    from turnout.config import EngineConfig

    note_vllm_noop_args(args)
    return EngineConfig(**engine_kwargs(args, exclude=("model", "served_model_name")), model=resolve_model(args),
                        served_model_name=(args.served_model_name or [None])[0])


def serve_options(args):
    """The API group's flags, checked (a ValueError naming the flag); the chat template file is read now."""
    from turnout.entrypoints.openai.serve_options import ServeOptions, load_chat_template

    return ServeOptions(enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, chat_template=load_chat_template(args.chat_template),
                        max_logprobs=args.max_logprobs, grammar_timeout=args.grammar_timeout)


def run(args) -> int:
    if args.headless or args.node_rank:  # node 1.. of a multi-node engine: its ranks only, no HTTP
        from turnout.executor.multinode import run_headless

        if not args.headless:
            raise ValueError(f"--node-rank: node {args.node_rank} runs no engine and serves no HTTP; add --headless")
        return run_headless(build_config(args))
    if args.max_queue < 0:
        raise ValueError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key: empty; give a key, or leave the flag (and $TURNOUT_API_KEY) out to serve "
                         "without one")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes: must be >= 1024, got {args.max_request_bytes}")
    for flag in ("timeout_header", "timeout_body", "timeout_write", "dead_engine_grace", "drain_timeout"):
        if not getattr(args, flag) >= 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 0 seconds, got {getattr(args, flag)}")
    max_connections = args.max_connections
    if max_connections is None:
        max_connections = args.max_queue + (args.max_num_seqs or MAX_DEFAULT_SEQS) + 64
    if max_connections < 1:
        raise ValueError(f"--max-connections: must be >= 1, got {max_connections}")
    for flag in ("h11_max_incomplete_event_size", "h11_max_header_count"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    config = build_config(args)  # ValueError naming the field, before anything starts
    if config.data_parallel_size > 1 and args.enable_rl_endpoints:
        raise ValueError("--enable-rl-endpoints: the RL control plane drives one engine; not with "
                         "--data-parallel-size > 1")
    if args.enable_rl_endpoints and not args.api_key:
        logger.warning("WARNING: --enable-rl-endpoints without --api-key: anyone who can reach this port can put "
                       "the engine to sleep, pause it and replace its weights")
    options = serve_options(args)
    sock = bind_socket(args.host, args.port)  # before any heavy import or the model: fail in milliseconds
    port = sock.getsockname()[1]  # the one bound, also for --port 0

    import uvicorn

    from turnout.entrypoints.openai.api_server import ServerState, build_app
    from turnout.entrypoints.openai.http_guard import guarded_h11_protocol
    from turnout.entrypoints.openai.serve_lifecycle import DrainingServer

    def make_engine():
        from turnout.engine.llm_engine import LLMEngine
        from turnout.entrypoints.openai.serve_options import refuse_remote_code

        refuse_remote_code(config.model, args.trust_remote_code)
        if config.data_parallel_size > 1:  # N replicas, a process each (turnout/engine/dp.py)
            from turnout.engine.dp import DataParallelEngine

            return DataParallelEngine(config)  # replicas size their own; the server admits up to the bound
        engine = LLMEngine.from_config(config)
        state.max_num_seqs = engine.config.max_num_seqs  # None resolved when the cache was sized
        return engine

    server: DrainingServer | None = None
    exit_code = 0

    def on_ready(state):
        freeze_startup_heap()  # this process keeps its engine until it exits (turnout/utils/gc_freeze.py)
        logger.info("turnout %s ready on http://%s:%d | model %r | max_model_len=%d max_num_seqs=%d "
                    "max_queue=%d api_key=%s drain_timeout=%.0fs", _version(), args.host, port,
                    ", ".join(state.served_model_names), state.max_model_len, state.max_num_seqs, args.max_queue,
                    "required" if args.api_key else "off", args.drain_timeout)

    def on_load_failed(exc):
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    def on_engine_dead(exc):  # on the event loop
        nonlocal exit_code
        exit_code = 1
        logger.error("exiting in %.1fs with status 1 (engine dead) so that a supervisor restarts the server",
                     args.dead_engine_grace)
        if server is not None:
            asyncio.get_running_loop().call_later(max(args.dead_engine_grace, 0.0), server.exit_now)

    # As vLLM: the API name is --served-model-name, else the MODEL argument, else the engine's display name.
    names = args.served_model_name or ([config.model] if config.model else None)
    state = ServerState(engine_factory=make_engine, served_model_names=names,
                        api_key=args.api_key, enable_rl_endpoints=args.enable_rl_endpoints, enable_docs=args.enable_docs,
                        max_queue=args.max_queue,
                        max_num_seqs=args.max_num_seqs or MAX_DEFAULT_SEQS,
                        max_request_bytes=args.max_request_bytes, max_header_count=args.h11_max_header_count,
                        drain_timeout=args.drain_timeout, options=options,
                        on_ready=on_ready, on_load_failed=on_load_failed, on_engine_dead=on_engine_dead)
    app = build_app(state)
    protocol = guarded_h11_protocol(args.timeout_header, args.timeout_body, args.timeout_write, max_connections)
    uv_config = uvicorn.Config(app, host=args.host, port=port, log_level="warning", access_log=False,
                               http=protocol, timeout_keep_alive=args.timeout_keep_alive,
                               timeout_graceful_shutdown=5, lifespan="on", server_header=False,
                               h11_max_incomplete_event_size=args.h11_max_incomplete_event_size)
    server = DrainingServer(uv_config, state)
    logger.info("loading model %s ...", config.model or "(default SmolLM2-135M-Instruct)")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.started is False and exit_code == 0:
        exit_code = 1  # uvicorn could not start; it has logged why
    if state.engine_dead:
        exit_code = 1  # also when a signal, not the grace timer, ended a server whose engine had died
    return exit_code


def _version() -> str:
    import turnout

    return turnout.__version__
