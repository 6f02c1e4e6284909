"""LLM: the offline API, shaped like vLLM's so that switching is one import."""

from __future__ import annotations

import itertools
from typing import Sequence as Seq

from turnout.config import EngineConfig
from turnout.engine.llm_engine import LLMEngine
from turnout.engine.outputs import RequestOutput
from turnout.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True, load_format: str = "auto", seed: int = 0,
                 ops_policy: str | None = None, block_size: int = 16, enforce_eager: bool = False,
                 tokenizer: str | None = None, async_scheduling: bool | None = None):
        self.config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                                   enable_prefix_caching=enable_prefix_caching, load_format=load_format, seed=seed,
                                   ops_policy=ops_policy, block_size=block_size, enforce_eager=enforce_eager,
                                   tokenizer=tokenizer, async_scheduling=async_scheduling)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: must be a string, a list of token ids, or a list of them")
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt) for c in convs]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"sampling_params: {len(plist)} given for {len(prompts)} prompts")
        order = {}
        try:
            for prompt, p in zip(prompts, plist):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                order[rid] = len(order)
        except Exception:
            self.engine.abort_request(list(order))  # nothing half-admitted
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generating", unit="req", dynamic_ncols=True)
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            generated += sum(len(c.token_ids) for c in out.outputs)
                            bar.update(1)
                            bar.set_postfix(tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        except BaseException:
            self.engine.abort_request([r for r in order if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in sorted(order, key=order.get)]
