"""LLMEngine: requests in, incremental RequestOutputs out, one scheduler step at a time.

Three parts, as vLLM v1 splits its engine (docs/architecture.md, "The engine in three parts"):
``InputProcessor`` (tokenise, chat template, admission), ``EngineCore`` (schedule -> execute -> update,
the lookahead protocol; what a multi-process executor will drive) and ``OutputProcessor`` (detokenise,
stops, RequestOutput). This class wires them together and keeps the public API.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from turnout.config import EngineConfig
from turnout.engine.core import EngineCore
from turnout.engine.core_outputs import EngineStats
from turnout.engine.input_processor import ContextLengthError, InputProcessor
from turnout.engine.output_processor import OutputProcessor
from turnout.engine.outputs import RequestOutput
from turnout.engine.rl import RolloutControl
from turnout.engine.sampling_params import SamplingParams
from turnout.engine.scheduler import Scheduler
from turnout.engine.sequence import Sequence
from turnout.engine.speculative import build_draft_engine, build_proposer

logger = logging.getLogger(__name__)

__all__ = ["ContextLengthError", "EngineStats", "LLMEngine"]


def _context_limit(requested: int | None, loaded, layout) -> int:
    """The longest context served exactly: the model's, or the one asked for up to it. Layers that declare a
    sliding window (``layout``: turnout/kv/spec.py) read it out of the paged cache, so their models serve it
    all; a model whose config has a window that its layers do not apply is capped at the window, where full
    attention computes the same."""
    from turnout.kv.spec import SlidingWindowSpec

    limit = loaded.max_model_len
    cfg = loaded.hf_config
    window = getattr(cfg, "sliding_window", None)
    if (getattr(cfg, "use_sliding_window", True) and isinstance(window, int) and 0 < window < limit
            and not any(isinstance(s, SlidingWindowSpec) for s in layout.specs)):
        logger.warning("this model's config has a sliding window (%d tokens) that its layers do not apply: "
                       "contexts are capped at %d tokens, where full attention is exact", window, window)
        limit = window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds what this model serves exactly ({limit} tokens)")
    return requested


def _display_name(model: str | None, loaded) -> str:
    """The id clients use: the model argument as given (as vLLM), or the default model's name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model


class LLMEngine:
    def __init__(self, config: EngineConfig):
        import torch

        from turnout.executor import make_executor
        from turnout.kv.block_manager import BlockManager
        from turnout.kv.group_blocks import GroupedBlockManager
        from turnout.loader.source import check_model_exists
        from turnout.ops import Policy, log_table, resolve
        from turnout.platforms import detect_platform

        t0 = time.perf_counter()
        check_model_exists(config.model)  # a mistyped path fails now, not after the platform and op table
        self.config = config
        self.platform = detect_platform(config.device)
        self.ops = resolve(self.platform, Policy.for_config(config, platform=self.platform))
        log_table(self.ops, logger)
        draft = build_draft_engine(config, type(self))  # speculative decoding's draft model, before the target
        torch.manual_seed(config.seed)
        # The executor loads the model (its shard on every rank) and builds each rank's model runner.
        self.executor = make_executor(config, self.platform, self.ops)
        loaded = self.executor.loaded
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.model_name = config.served_model_name or _display_name(config.model, loaded)
        self.runner = self.executor.runner  # rank 0's ModelRunner: the core drives it
        self.max_model_len = _context_limit(config.max_model_len, loaded, self.runner.cache_layout)
        # max_num_seqs=None: the runner chose it when it sized the cache (turnout/worker/concurrency.py)
        self.config = config = dataclasses.replace(config, max_num_seqs=self.runner.max_num_seqs)
        xfer = self.runner.kv_transfer  # the KV tiers' host pools and preemption mode (worker/kv_transfer.py)
        layout = self.runner.cache_layout  # what the layers store (turnout/kv/spec.py): the window, the states
        if len(layout.table_groups) > 1:  # full and sliding layers: a block table per group (kv/group_blocks.py)
            self.block_manager = GroupedBlockManager(
                [g.window for g in layout.table_groups], self.executor.num_blocks, config.block_size,
                config.enable_prefix_caching, swap_blocks=xfer.num_swap_blocks, offload_blocks=xfer.num_offload_blocks)
        else:
            self.block_manager = BlockManager(
                self.executor.num_blocks, config.block_size, config.enable_prefix_caching,
                swap_blocks=xfer.num_swap_blocks, offload_blocks=xfer.num_offload_blocks, window=layout.window,
                state_slots=self.runner.num_state_slots, state_swap_slots=xfer.num_host_state_slots)
        scheduler = Scheduler(self.block_manager, config.max_num_seqs, max(config.max_num_batched_tokens, 1),
                              self.max_model_len, fair_share_seqs=config.fair_share_seqs, preemption=xfer.preemption)
        self.eos_ids = self._eos_ids()
        self.input_processor = InputProcessor(self.tokenizer, self.runner.vocab_size, self.max_model_len,
                                              config.max_tokens_per_request, config.seed,
                                              stop_token_ids=sorted(self.eos_ids))
        is_async = self.platform.is_gpu if config.async_scheduling is None else config.async_scheduling
        self.core = EngineCore(scheduler, self.runner, self.eos_ids, self.max_model_len, is_async)
        self.core.proposer = build_proposer(config, self.tokenizer, self.runner.vocab_size, draft,
                                             self.runner)  # speculative decoding (or None)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len)
        self.rl = RolloutControl(self)  # sleep / wake, weight updates, pause / resume (turnout/engine/rl.py)
        logger.info("engine ready in %.1fs: %s on %s (%s), dtype %s, max_model_len %d, %d KV blocks, "
                    "async scheduling %s, PDL %s", time.perf_counter() - t0, self.model_name, self.platform.name,
                    self.platform.description, loaded.dtype, self.max_model_len, self.runner.num_blocks,
                    "on" if is_async else "off", "on" if self.runner.pdl else "off")

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    def shutdown(self) -> None:
        """Stop the other ranks' processes and leave the process group (tensor parallel); idempotent. The
        engine's memory goes with its last reference."""
        self.executor.shutdown()
        draft = getattr(self.core.proposer, "engine", None)  # a draft model's engine (engine/speculative.py)
        if draft is not None:
            draft.shutdown()

    def _eos_ids(self) -> set[int]:
        from turnout.loader.source import generation_eos_ids

        ids = {i for i in generation_eos_ids(self.config.model) if i < self.runner.vocab_size}
        for src in (getattr(self.hf_config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(i for i in src if isinstance(i, int))
        return ids

    # ---- the parts, for the callers that look inside ---------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def num_lookahead_steps(self) -> int:
        return self.core.num_lookahead_steps

    @property
    def async_scheduling(self) -> bool:
        """Whether decode steps are launched ahead of the last one's read-back (docs/architecture.md)."""
        return self.core.async_scheduling

    # ---- requests --------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.input_processor.encode(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
                            ) -> list[int]:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, **template_kwargs)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Admit a request (ValueError naming the field if it cannot be served as asked)."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.rl.check_can_admit()  # RuntimeError while sleeping or paused
        now = time.time() if arrival_time is None else arrival_time
        req = self.input_processor.process(request_id, prompt, params, now)
        p = req.params
        if p.return_routed_experts and not self.runner.routing.num_layers:
            raise ValueError("return_routed_experts: this model has no MoE layers")
        seq = Sequence(self.core.scheduler.new_seq_id(), request_id, req.prompt_token_ids, p,
                       seed=req.seed, n=p.n, arrival_time=now)
        seq.grammar = self.input_processor.new_grammar_state(req)  # structured output (its forks copy it)
        self.core.add(seq)  # may raise: it can never fit
        self.output_processor.add_request(req)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.core.abort(rid)
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def get_stats(self) -> EngineStats:
        s = self.core.scheduler
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_cache_usage=self.block_manager.usage, num_preemptions_total=s.num_preemptions,
                           prompt_tokens_total=self.core.prompt_tokens_total,
                           generation_tokens_total=self.output_processor.generation_tokens_total,
                           prefix_cache_hit_tokens_total=s.num_prefix_cached_tokens,
                           lookahead_steps_total=self.core.num_lookahead_steps,
                           **self.core.draft_counts.stats(),
                           num_failed_requests_total=self.core.num_failed_requests,
                           **self._tier_stats())

    def _tier_stats(self) -> dict:
        s, bm = self.core.scheduler, self.block_manager
        hc = bm.host_cache
        return {"num_swapped": len(s.swapped), "swap_preemptions_total": s.num_swap_preemptions,
                "recompute_preemptions_total": s.num_preemptions - s.num_swap_preemptions,
                "swap_pool_full_total": s.num_swap_pool_full,
                "swapped_out_blocks_total": bm.num_swapped_out_blocks,
                "swapped_in_blocks_total": bm.num_swapped_in_blocks,
                "host_tier_hit_tokens_total": bm.num_host_hit_tokens,
                "host_tier_offloaded_blocks_total": 0 if hc is None else hc.num_offloaded,
                "host_tier_used_blocks": 0 if hc is None else hc.num_used}

    # ---- the step --------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduler step. Returns a RequestOutput for every request that got a token (or failed),
        or with ``finished_only`` (offline callers that only collect results) just for the finished
        ones, which skips copying every running request's tokens and text each step.

        With async scheduling, the next decode step is launched before this step's tokens are read
        back (EngineCore), so the device never waits for the host in steady decoding. A fault traced to
        one request fails that request only (its output has ``finish_reason == "error"``)."""
        if self.rl.paused is not None:  # pause_generation(mode="keep"): the requests wait where they are
            return []
        core_out = self.core.step()
        now = time.time()
        out = self.output_processor
        for rid in core_out.scheduled_request_ids:
            state = out.requests.get(rid)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
        for child in core_out.forked:
            if out.has_request(child.request_id):
                out.add_sample(child.request_id, child.index)
        outputs, ended, failed = out.process(core_out, now, finished_only)
        self.core.update(ended, failed)
        return outputs

    # ---- the RL control plane (turnout/engine/rl.py; each reaches every rank through collective_rpc) -----
    def sleep(self, level: int = 1) -> None:
        self.rl.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.rl.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.rl.is_sleeping()

    def update_weights(self, weights) -> list[str]:
        return self.rl.update_weights(weights)

    def update_weights_from_disk(self, path: str) -> list[str]:
        return self.rl.update_weights_from_disk(path)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "gloo", timeout: float | None = None) -> list[int]:
        return self.rl.init_weight_update_group(master_address, master_port, rank_offset, world_size, backend,
                                                timeout)

    def update_weights_from_distributed(self, names, dtypes, shapes, timeout: float | None = None) -> list[str]:
        return self.rl.update_weights_from_distributed(names, dtypes, shapes, timeout)

    def update_weights_from_ipc(self, buckets) -> list[str]:
        return self.rl.update_weights_from_ipc(buckets)

    def reset_prefix_cache(self) -> int:
        return self.rl.reset_prefix_cache()

    def abort_all_requests(self) -> list[RequestOutput]:
        return self.rl.abort_all_requests()

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        return self.rl.pause_generation(mode)

    def resume_generation(self) -> None:
        self.rl.resume_generation()
