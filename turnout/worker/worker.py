"""One rank of the engine: its device, its model shard, its KV cache shard (the model runner's), and, in a
tensor-parallel engine, its place in the process group.

``Worker`` wraps this rank's ``turnout.worker.model_runner.ModelRunner`` (batch -> tensors -> model -> sampler).
In-process (the uniproc executor, and rank 0 of the mp executor) the engine drives the runner directly; in
a spawned process ``serve`` runs the loop the mp executor drives: each step's flat inputs in
(turnout/worker/step_codec.py), this rank's forward with its share of the collectives, nothing back (only
rank 0 samples and returns tokens). ``collective_rpc`` calls reach any public method of the worker.
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback

import torch

from turnout.worker import step_codec
from turnout.worker.kv_sizing import unique_block_tensors
from turnout.worker.layer_gate import LayerGatedCaches

logger = logging.getLogger(__name__)


class Worker:
    """``Worker(...)`` joins the group and loads this rank's shard; ``build_runner()`` then makes the model runner
    (KV cache, memory profile and CUDA graphs: collectives on a GPU, so every rank must have loaded first).
    ``runner=True`` does both at once."""

    def __init__(self, config, *, rank: int = 0, world_size: int = 1, init_method: str | None = None,
                 platform=None, ops=None, runner: bool = True, local_rank: int | None = None):
        """``local_rank``: this rank's device index on its machine (a multi-node or Ray rank; a Ray actor sees
        only its own GPU, index 0). None: the rank itself, every rank on this machine."""
        from turnout.distributed import init_distributed
        from turnout.layers.fusion import plan_fusions
        from turnout.loader import load_model
        from turnout.ops import Policy, resolve
        from turnout.platforms import detect_platform

        self.config, self.rank, self.world_size = config, rank, world_size
        self.platform = platform or detect_platform(config.device)
        if self.platform.is_gpu:
            count = getattr(torch, self.platform.device_type).device_count()
            dp = getattr(config, "data_parallel_size", 1)
            if world_size * dp > count and local_rank is None:
                what = (f"data_parallel_size {dp} x tensor_parallel_size {world_size} = {world_size * dp}" if dp > 1
                        else f"tensor_parallel_size: {world_size}")
                raise ValueError(f"{what} ranks but {count} {self.platform.name} device(s) on this machine")
            if local_rank is not None and local_rank >= count:
                raise ValueError(f"tensor_parallel_size: rank {rank} needs {self.platform.name} device {local_rank}, "
                                 f"but this machine has {count}")
            if local_rank is None:  # data-parallel replica r uses devices [r tp, (r + 1) tp)
                local_rank = getattr(config, "data_parallel_rank", 0) * world_size + rank
            self.device = self.platform.device(local_rank)
            getattr(torch, self.platform.device_type).set_device(self.device)
        else:
            self.device = self.platform.device(None)
            if world_size > 1:  # ranks share the host's cores
                torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        timeout = float(getattr(config, "distributed_timeout_s", 300.0))
        self.tp = init_distributed(self.platform, rank=rank, world_size=world_size, init_method=init_method,
                                   device=self.device if self.platform.is_gpu else None,
                                   timeout_s=max(timeout, 300.0), collective_timeout_s=timeout)
        if world_size > 1:
            from turnout.worker.lifecycle import check_same_config

            check_same_config(config, rank, self.tp.group)
        self.ops = ops or resolve(self.platform, Policy.for_config(config, platform=self.platform))
        torch.manual_seed(config.seed)
        self.loaded = load_model(config.model, load_format=config.load_format, dtype=config.dtype, device=self.device,
                                 ops=self.ops, seed=config.seed, tokenizer=config.tokenizer,
                                 plan=plan_fusions(self.ops), tp=self.tp if world_size > 1 else None,
                                 enable_expert_parallel=config.enable_expert_parallel,
                                 quantization=config.quantization,
                                 model_impl=getattr(config, "model_impl", "auto"),
                                 num_layers=getattr(config, "num_hidden_layers", None))
        self.runner = None
        self._swap_gate = None  # swap-ins received for the next step (swap)
        if runner:
            self.build_runner()

    def build_runner(self, step_publisher=None):
        """``step_publisher``: on the driver rank of several, what sends each step's inputs to the others."""
        from turnout.worker.model_runner import ModelRunner

        self.runner = ModelRunner(self.config, self.platform, self.ops, self.loaded, step_publisher=step_publisher)
        return self.runner

    # ---- reachable through collective_rpc -------------------------------------------------------
    def describe(self) -> dict:
        """This rank's place and shard (for tests and diagnostics)."""
        model = self.runner.model
        return {"rank": self.rank, "world_size": self.world_size, "tp_rank": self.tp.rank, "tp_size": self.tp.size,
                "device": str(self.device), "num_blocks": self.runner.num_blocks,
                "num_kv_heads": self.runner.num_kv_heads,
                "embed_rows": int(model.model.embed_tokens.weight.shape[0]), "pid": os.getpid()}

    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def check_weights(self, items) -> None:
        """Raise, naming the weight, if ``items`` (name -> shape and dtype) would not load into this rank's model."""
        self.runner.memory.check_weights(items)

    # ---- a step on a rank that does not sample ---------------------------------------------------
    @torch.inference_mode()
    def run_step(self, msg: bytes) -> None:
        """This rank's part of a step the driver rank runs: the same forward, so that every collective of the
        model meets its peers; logits are computed (the LM head gathers them) only where the driver computes
        them, and never sampled here."""
        r = self.runner
        input_ids, positions, meta, sample_idx, has_lanes, pending = step_codec.decode_step(msg)
        if meta.group_tables is not None:  # several table groups: each layer's, as this rank's layout says
            meta.layer_group = r.layer_group
        if pending:  # a lookahead step: its inputs are the driver's sampled tokens, still on its device
            import torch.distributed as dist

            input_ids = torch.empty(input_ids.shape, dtype=torch.long, device=self.device)
            dist.broadcast(input_ids, src=0, group=self.tp.group)
        gate, self._swap_gate = self._swap_gate, None  # swap-ins sent ahead of this step (SWAP_IN)
        if has_lanes == 1 and r.graphs is not None and r.graphs.can_run(len(sample_idx), meta):
            if gate is not None:  # the graph reads every layer
                gate.finish()
            r.graphs.run(input_ids, positions, meta)  # the driver replays its graph: so does this rank
            return
        dev_ids, positions, meta = r._to_device(input_ids, positions, meta)
        if not pending:
            input_ids = dev_ids
        try:
            hidden = r.model(input_ids, positions, r.kv_caches if gate is None else LayerGatedCaches(r.kv_caches, gate),
                             meta)
        finally:
            if gate is not None:
                gate.finish()
        if not has_lanes:
            return
        if len(sample_idx) != hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(sample_idx, dtype=torch.long, device=self.device))
        r.model.compute_logits(hidden)

    def flush_swaps(self) -> None:
        """Land the swap-ins of a step whose forward never came (the driver's step failed before it): before
        any other message, so that what follows sees the blocks filled."""
        gate, self._swap_gate = self._swap_gate, None
        if gate is not None:
            gate.finish()

    def swap(self, msg: bytes) -> None:
        """The driver's swap-outs (run now, in line) or swap-ins (a gate the next step's forward passes layer
        by layer), on this rank's shard of the blocks (turnout/worker/kv_transfer.py)."""
        pairs = step_codec.decode_copy(msg)
        if step_codec.kind_of(msg) == step_codec.SWAP_OUT:
            self.runner.kv_transfer.swap_out(pairs)
        else:
            self._swap_gate = self.runner.kv_transfer.swap_in(pairs)

    def copy_blocks(self, msg: bytes) -> None:
        pairs = step_codec.decode_copy(msg)
        mapping = torch.tensor(pairs, dtype=torch.long, device=self.device)
        self.ops.copy_blocks(unique_block_tensors(self.runner.kv_caches), mapping)

    def serve(self, conn_in, conn_out, progress=None) -> None:
        """The loop of a spawned rank: until the engine says quit or its end of the pipe closes.
        ``progress[rank]``: steps this rank has finished (what the engine's step watchdog reads)."""
        steps = 0
        while True:
            try:
                msg = conn_in.recv_bytes()
            except (EOFError, OSError):  # the engine process is gone: leave, no orphan
                break
            kind = step_codec.kind_of(msg)
            if kind != step_codec.STEP:
                self.flush_swaps()
            if kind == step_codec.STEP:
                self.run_step(msg)
                steps += 1
                if progress is not None:
                    progress[self.rank] = steps
            elif kind == step_codec.COPY:
                self.copy_blocks(msg)
            elif kind in (step_codec.SWAP_OUT, step_codec.SWAP_IN):
                self.swap(msg)
            elif kind == step_codec.RPC:
                # From the engine process that spawned this rank, over a private pipe; no request reaches it.
                method, args, kwargs = pickle.loads(msg[8:])
                try:
                    fn = method if callable(method) else getattr(self, method)
                    result = ("ok", fn(self, *args, **kwargs) if callable(method) else fn(*args, **kwargs))
                except Exception as e:  # noqa: BLE001 - the caller gets it, named with this rank
                    result = ("error", f"rank {self.rank}: {type(e).__name__}: {e}")
                conn_out.send(result)
            elif kind == step_codec.QUIT:
                break


def worker_main(rank: int, world_size: int, init_method: str, config, conn_in, conn_out,
                local_rank: int | None = None, parent_pid: int | None = None, health=None,
                pdeathsig: bool = True) -> None:
    """Entry point of a spawned rank: build the worker, say ready (with its KV block count) or why not, serve.
    ``parent_pid``: the engine process, which this rank does not outlive; ``health``: the engine's shared
    ``(progress, beats)`` arrays (turnout/executor/rank_health.py); both None for a rank on another node."""
    from turnout.distributed import destroy_distributed
    from turnout.worker import lifecycle

    if parent_pid is not None:
        lifecycle.die_with_parent(parent_pid, pdeathsig)
    progress = None
    if health is not None:
        progress, beats = health
        lifecycle.start_heartbeat(beats, rank)
    stage = "start-up"
    try:
        worker = Worker(config, rank=rank, world_size=world_size, init_method=init_method, runner=False,
                        local_rank=local_rank)
        conn_out.send(("loaded", None))
        stage = "building the model runner"
        worker.build_runner()
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which fails its start-up with it
        conn_out.send(("error", f"rank {rank}, {stage}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn_out.send(("ready", worker.runner.num_blocks))
    try:
        worker.serve(conn_in, conn_out, progress)
    finally:
        destroy_distributed()
