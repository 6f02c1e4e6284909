"""LLM: the offline API, shaped like vLLM's so that switching is one import."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence as Seq

from turnout.config import engine_config
from turnout.engine.generation_gate import GenerationGate
from turnout.engine.llm_engine import LLMEngine
from turnout.engine.outputs import RequestOutput
from turnout.engine.rl import TokenOutput
from turnout.engine.sampling_params import SamplingParams
from turnout.utils.gc_freeze import release_device_memory


class LLM:
    def __init__(self, model: str | None = None, **options):
        """``options``: any EngineConfig field by name (turnout/config.py documents each). A name that is none
        is a ValueError naming the closest field; vLLM's options that change nothing here (enable_chunked_prefill,
        disable_log_stats, ...) are accepted with an INFO line (turnout/config.py)."""
        self.config = engine_config(model=model, **options)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()
        self._gate = GenerationGate(self.engine)  # pause / abort from another thread (generation_gate.py)

    def shutdown(self) -> None:
        """Release what the engine holds: the other ranks' processes and the process group (so another
        tensor-parallel LLM can start in this process), the weights and the KV cache. Idempotent; any later
        call on this LLM is a RuntimeError. Also done by leaving ``with LLM(...) as llm:``, and, for ranks and
        process group, when a dropped LLM is garbage-collected."""
        engine = self.engine
        if isinstance(engine, _ShutDown):
            return
        self.engine = self._gate = _ShutDown()
        engine.shutdown()
        del engine
        release_device_memory("cuda")  # the engine's parts refer to each other: free the weights and the cache now

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self):
        """The engine's counters (EngineStats): requests, tokens, prefix-cache hits, preemptions by mode and
        the KV tiers' swaps and host-tier hits (docs/architecture.md, "KV tiers")."""
        return self.engine.get_stats()

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: must be a string, a list of token ids, or a list of them")
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt) for c in convs]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, params, use_tqdm: bool, request_ids: list[str] | None = None) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"sampling_params: {len(plist)} given for {len(prompts)} prompts")
        order = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                rid = request_ids[i] if request_ids else str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                order[rid] = len(order)
        except Exception:
            self.engine.abort_request(list(order))  # nothing half-admitted
            raise
        results: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(order)) if use_tqdm else None
        try:
            with self._gate.generating():
                while self.engine.has_unfinished_requests():
                    for out in self._gate.checkpoint() + self.engine.step(finished_only=True):
                        if out.finished and out.request_id in order:
                            results[out.request_id] = out
                            if bar is not None:
                                bar.done(out)
        except BaseException:
            self.engine.abort_request([r for r in order if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in sorted(order, key=order.get)]

    # ---- RL rollout (turnout/engine/rl.py; docs/architecture.md "RL rollout") ---------------------------
    def generate_tokens(self, prompt_ids, sampling_params: SamplingParams | None = None,
                        request_id: str | None = None) -> TokenOutput | list[TokenOutput]:
        """Token ids in, token ids out: one prompt (a list of ids) -> a TokenOutput with the sampled tokens,
        the logprob of each and the stop reason ("completed" | "aborted"); a list of prompts -> a list.
        ``request_id`` (one prompt only) names the request in logs and outputs."""
        one = isinstance(prompt_ids, (list, tuple)) and (not prompt_ids or isinstance(prompt_ids[0], int))
        prompts = [list(prompt_ids)] if one else [list(p) for p in prompt_ids]
        if request_id is not None and not one:
            raise ValueError("request_id: only for a single prompt")
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n: generate_tokens returns one sample per prompt (got n={params.n}); repeat the "
                             "prompt instead")
        if params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # the sampled token's logprob, no top-N
        outs = self._run(prompts, params, use_tqdm=False, request_ids=[request_id] if request_id else None)
        toks = [TokenOutput.from_request_output(o) for o in outs]
        return toks[0] if one else toks

    def sleep(self, level: int = 1) -> None:
        """Release device memory between rollouts: level 1 moves the weights to host memory (pinned) and
        discards the KV cache; level 2 discards both (push weights with update_weights after wake_up)."""
        self._gate.check_quiet("sleep")
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both)."""
        self._gate.check_quiet("wake_up")
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def update_weights(self, weights) -> list[str]:
        """Overwrite weights from (HF checkpoint name, full tensor) pairs (an iterable, e.g.
        ``trainer_model.named_parameters()``, or a dict): any subset, any order, per-expert or stacked MoE
        tensors, tied embeddings. All or nothing: an unknown name or a wrong shape is a ValueError naming the
        tensor, with the model unchanged. The prefix cache is reset. Returns the parameter names written."""
        self._gate.check_quiet("update_weights")
        return self.engine.update_weights(weights)

    def update_weights_from_disk(self, path: str) -> list[str]:
        """As update_weights, from a safetensors checkpoint directory (every rank reads it itself)."""
        self._gate.check_quiet("update_weights_from_disk")
        return self.engine.update_weights_from_disk(path)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "gloo", timeout: float | None = None) -> list[int]:
        """Join a trainer's torch.distributed broadcast group (the trainer is rank 0 and hosts the store at
        master_address:master_port; engine rank r is rank_offset + r). Returns the engine ranks' group ranks.
        TimeoutError when the group has not formed within ``timeout`` seconds (default 60)."""
        self._gate.check_quiet("init_weight_update_group")
        return self.engine.init_weight_update_group(master_address, master_port, rank_offset, world_size, backend,
                                                    timeout)

    def update_weights_from_distributed(self, names, dtypes, shapes, timeout: float | None = None) -> list[str]:
        """Receive tensors the trainer broadcasts (``turnout.worker.weight_broadcast.broadcast_weights``), in
        the order of ``names``, and write them as update_weights does (each within ``timeout`` seconds)."""
        self._gate.check_quiet("update_weights_from_distributed")
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, timeout)

    def update_weights_from_ipc(self, buckets) -> list[str]:
        """Tensors another process shares by handle (CUDA IPC on a GPU, shared memory on the host), in buckets
        made by ``turnout.worker.weight_ipc.make_bucket``: one per engine rank, or one in a world of one."""
        self._gate.check_quiet("update_weights_from_ipc")
        return self.engine.update_weights_from_ipc(buckets)

    def reset_prefix_cache(self) -> int:
        self._gate.check_quiet("reset_prefix_cache")
        return self.engine.reset_prefix_cache()

    clear_kv_cache = reset_prefix_cache

    def abort_all_requests(self) -> list[RequestOutput]:
        """End every unfinished request (a generate() in another thread returns them with
        finish_reason "abort" and their partial tokens); generation stays paused until resume_generation()."""
        return self._gate.pause("abort")

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """"abort": as abort_all_requests; "keep": a running generate() parks between two steps (this returns
        once it has) and continues after resume_generation(), e.g. with new weights."""
        return self._gate.pause(mode)

    def resume_generation(self) -> None:
        self._gate.resume()

    def collective_rpc(self, method, args=(), kwargs=None) -> list:
        """``method`` (a worker method name, or a callable taking the worker first) on every rank."""
        return self.engine.executor.collective_rpc(method, args, kwargs)


class _ShutDown:
    """What ``LLM.engine`` is after ``shutdown()``: every use says so."""

    def __getattr__(self, name):
        raise RuntimeError("this LLM was shut down (LLM.shutdown()); create a new one")


class _ProgressBar:
    """vLLM's progress bar: requests done out of all, with the estimated input and output speeds."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.prompt_tokens = 0
        self.output_tokens = 0

    def done(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.postfix = (f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.output_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
