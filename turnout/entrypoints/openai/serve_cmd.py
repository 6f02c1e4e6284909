"""`turnout serve [MODEL]`: the OpenAI-compatible server (flag names as in vLLM).

SIGTERM (or Ctrl-C) drains: new requests get 503, running ones finish (up to --drain-timeout), then the
process exits 0. A second signal stops at once.

Exit status: 0 after a drain; 1 when the model failed to load or the engine died. An engine that dies (a
fault no request owns: a lost device, a broken kernel) fails every waiting client at once, and the
process exits 1 --dead-engine-grace seconds later, so that systemd, Kubernetes or Ray restarts it; a
signal to a server whose engine is dead exits 1 too. 2: a bad flag or an address already in use.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from turnout import envs

logger = logging.getLogger("turnout.serve")


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model id, local directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=envs.get().api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TURNOUT_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the model answers to in the API (default: the model's name)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests beyond the free running slots; more get 503 + Retry-After")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV-cache bytes (CPU default 1 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode step before the last one's tokens are read back "
                        "(default: on for GPUs, off on CPU)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--ops-policy", default=None, help="op dispatch policy (as TURNOUT_OPS)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM")
    p.add_argument("--timeout-keep-alive", type=int, default=5)
    p.add_argument("--dead-engine-grace", type=float, default=3.0,
                   help="seconds between the engine dying and the process exiting 1 (clients get their "
                        "errors meanwhile; /health answers 503)")


def build_config(args):
    from turnout.config import EngineConfig

    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        load_format=args.load_format, seed=args.seed, ops_policy=args.ops_policy,
        served_model_name=(args.served_model_name or [None])[0])


def run(args) -> int:
    import uvicorn

    from turnout.entrypoints.openai.api_server import ServerState, build_app

    if args.max_queue < 0:
        raise ValueError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes: must be >= 1024, got {args.max_request_bytes}")
    config = build_config(args)  # ValueError naming the field, before anything starts

    def make_engine():
        from turnout.engine.llm_engine import LLMEngine

        return LLMEngine.from_config(config)

    server: _DrainingServer | None = None
    exit_code = 0

    def on_ready(state):
        logger.info("turnout %s ready on http://%s:%d | model %r | max_model_len=%d max_num_seqs=%d "
                    "max_queue=%d api_key=%s drain_timeout=%.0fs", _version(), args.host, args.port,
                    ", ".join(state.served_model_names), state.max_model_len, args.max_num_seqs, args.max_queue,
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
    names = args.served_model_name or ([args.model] if args.model else None)
    state = ServerState(engine_factory=make_engine, served_model_names=names,
                        api_key=args.api_key or None, max_queue=args.max_queue, max_num_seqs=args.max_num_seqs,
                        max_request_bytes=args.max_request_bytes, drain_timeout=args.drain_timeout,
                        on_ready=on_ready, on_load_failed=on_load_failed, on_engine_dead=on_engine_dead)
    app = build_app(state)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                               timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=5,
                               lifespan="on", server_header=False)
    server = _DrainingServer(uv_config, state)
    logger.info("loading model %s ...", config.model or "(default SmolLM2-135M-Instruct)")
    server.run()
    if server.started is False and exit_code == 0:
        exit_code = 1  # could not bind, for instance; uvicorn has logged why
    if state.engine_dead:
        exit_code = 1  # also when a signal, not the grace timer, ended a server whose engine had died
    return exit_code


def _version() -> str:
    import turnout

    return turnout.__version__


class _DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the listening socket."""

    def __new__(cls, config, state):
        import uvicorn

        class DrainingServer(uvicorn.Server):
            def __init__(self, config, state):
                super().__init__(config)
                self.state = state
                self._drain_requested = False
                self._drain_task = None

            def exit_now(self):
                self.should_exit = True

            def handle_exit(self, sig, frame):  # a signal handler: only set flags here
                if self._drain_requested or self.state.phase != "ready":
                    self.should_exit = True
                    if self._drain_task is not None and sig == signal.SIGINT:
                        self.force_exit = True
                    return
                self._drain_requested = True
                self.state.start_draining()

            async def on_tick(self, counter):
                if self._drain_requested and self._drain_task is None:
                    self._drain_task = asyncio.ensure_future(self._drain())
                return await super().on_tick(counter)

            async def _drain(self):
                eng = self.state.async_engine
                n = eng.num_in_flight if eng else 0
                logger.info("shutting down: refusing new requests, draining %d in-flight request(s) "
                            "(up to %.0fs)", n, self.state.drain_timeout)
                if eng is not None:
                    await eng.shutdown(self.state.drain_timeout)
                logger.info("drained; exiting")
                self.should_exit = True

        return DrainingServer(config, state)
