"""LLMEngine: requests in, incremental RequestOutputs out, one scheduler step at a time."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from turnout.config import EngineConfig
from turnout.engine.detokenizer import NoTextDetokenizer
from turnout.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from turnout.engine.sampling_params import SamplingParams
from turnout.engine.sequence import SequenceStatus

logger = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int):
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len
        if max_tokens is None:
            msg = (f"prompt: this model's maximum context length is {max_model_len} tokens, but the prompt "
                   f"has {prompt_len} tokens")
        else:
            msg = (f"prompt: this model's maximum context length is {max_model_len} tokens, but {prompt_len} "
                   f"prompt tokens + {max_tokens} max_tokens = {prompt_len + max_tokens} were requested")
        super().__init__(msg)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    lookahead_steps_total: int = 0  # decode steps launched before the last one's tokens were read back


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: dict[int, object] = field(default_factory=dict)  # sample index -> Sequence
    detoks: dict[int, object] = field(default_factory=dict)
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n and all(c.finish_reason for c in self.completions.values())


def _context_limit(requested: int | None, loaded) -> int:
    """The longest context served exactly. Sliding-window attention (Mistral v0.1, Mixtral) is not
    implemented, so such models are capped at their window, where full attention computes the same."""
    limit = loaded.max_model_len
    cfg = loaded.hf_config
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) and isinstance(window, int) and 0 < window < limit:
        logger.warning("this model uses sliding-window attention (window %d tokens), which turnout does not "
                       "implement yet: contexts are capped at %d tokens, where full attention is exact",
                       window, window)
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


@dataclass
class _Step:
    """A launched step: what was scheduled, the sequences that draw a token (in row order), the
    sampler's output on the device, and its copy on the host with the event that says it landed."""
    out: object  # SchedulerOutput
    lanes: list
    result: object  # SamplerOutput (device)
    host: object  # SamplerOutput (host; the same object where the device is the host)
    ready: object = None  # torch.cuda.Event or None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        import torch

        from turnout.engine.model_runner import ModelRunner
        from turnout.engine.scheduler import Scheduler
        from turnout.kv.block_manager import BlockManager
        from turnout.loader import load_model
        from turnout.ops import Policy, log_table, resolve
        from turnout.platforms import detect_platform

        t0 = time.perf_counter()
        self.config = config
        self.platform = detect_platform(config.device)
        self.ops = resolve(self.platform, Policy.from_sources(config.ops_policy, platform=self.platform))
        log_table(self.ops, logger)
        torch.manual_seed(config.seed)
        loaded = load_model(config.model, load_format=config.load_format, dtype=config.dtype,
                            device=self.platform.device(0 if self.platform.is_gpu else None), ops=self.ops,
                            seed=config.seed, tokenizer=config.tokenizer)
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.model_name = config.served_model_name or _display_name(config.model, loaded)
        self.max_model_len = _context_limit(config.max_model_len, loaded)
        self.runner = ModelRunner(config, self.platform, self.ops, loaded)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   max(config.max_num_batched_tokens, 1), self.max_model_len)
        self.eos_ids = self._eos_ids()
        self._rng = random.Random(config.seed)
        self._requests: dict[str, _Request] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._async = self.platform.is_gpu if config.async_scheduling is None else config.async_scheduling
        self._inflight: _Step | None = None  # a launched lookahead step, read back by the next step()
        self.num_lookahead_steps = 0
        logger.info("engine ready in %.1fs: %s on %s (%s), dtype %s, max_model_len %d, %d KV blocks, "
                    "async scheduling %s, PDL %s", time.perf_counter() - t0, self.model_name, self.platform.name,
                    self.platform.description, loaded.dtype, self.max_model_len, self.runner.num_blocks,
                    "on" if self._async else "off", "on" if self.runner.pdl else "off")

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.hf_config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(i for i in src if isinstance(i, int))
        return ids

    # ---- requests --------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; give token ids")
        return self.tokenizer.encode(prompt)

    def _decode_one(self, tok: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([tok])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs 'role' and 'content'")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        from turnout.engine.detokenizer import IncrementalDetokenizer
        from turnout.engine.sequence import Sequence

        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError("prompt: must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt: must not be empty")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        vocab = self.runner.vocab_size
        params.verify_for_model(vocab)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len or (params.max_tokens is not None
                                              and len(ids) + params.max_tokens > self.max_model_len):
            raise ContextLengthError(len(ids), params.max_tokens, self.max_model_len)
        now = time.time() if arrival_time is None else arrival_time
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(self.scheduler.new_seq_id(), request_id, ids, params, seed=seed % 2**63, n=params.n,
                       arrival_time=now)
        self.scheduler.add(seq)  # may raise ValueError if it can never fit
        req = _Request(request_id, text, ids, params, RequestMetrics(arrival_time=now))
        self._requests[request_id] = req
        self._track(req, seq)

    def _track(self, req: _Request, seq) -> None:
        from turnout.engine.detokenizer import IncrementalDetokenizer

        p = req.params
        req.seqs[seq.index] = seq
        if self.tokenizer is None:
            req.detoks[seq.index] = NoTextDetokenizer()
        else:
            req.detoks[seq.index] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                       skip_special_tokens=p.skip_special_tokens,
                                                       stop=p.stop_strings,
                                                       include_stop_str_in_output=p.include_stop_str_in_output)
        req.completions[seq.index] = CompletionOutput(index=seq.index, text="", token_ids=[],
                                                      cumulative_logprob=0.0 if p.logprobs is not None else None,
                                                      logprobs=[] if p.logprobs is not None else None)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort(rid)
            self._requests.pop(rid, None)

    @property
    def async_scheduling(self) -> bool:
        """Whether decode steps are launched ahead of the last one's read-back (docs/architecture.md)."""
        return self._async

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_cache_usage=self.block_manager.usage, num_preemptions_total=s.num_preemptions,
                           prompt_tokens_total=self._prompt_tokens_total,
                           generation_tokens_total=self._generation_tokens_total,
                           prefix_cache_hit_tokens_total=s.num_prefix_cached_tokens,
                           lookahead_steps_total=self.num_lookahead_steps)

    # ---- the step --------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduler step. Returns a RequestOutput for every request that got a token, or with
        ``finished_only`` (offline callers that only collect results) just for the finished ones, which
        skips copying every running request's tokens and text each step.

        With async scheduling, the next decode step is launched before this step's tokens are read
        back (``_launch_lookahead``), so the device never waits for the host in steady decoding."""
        step = self._inflight
        self._inflight = None
        if step is None:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            step = self._launch(out)
            if step is None:  # prefill chunks only: nothing sampled
                return []
        if self._async:
            self._inflight = self._launch_lookahead(step)
        outputs = self._finalize(step, finished_only)
        nxt = self._inflight
        if nxt is not None:
            # the lookahead's KV is (being) written: advance its sequences now that their inputs, the
            # tokens just appended, are known (prefix-cache hashes need them); drop it if all ended
            self.scheduler.postprocess(nxt.out)
            if not any(seq.status == SequenceStatus.RUNNING for seq in nxt.lanes):
                self._inflight = None
        return outputs

    def _launch(self, out) -> _Step | None:
        """Account for a scheduled step and launch its forward and sampling (no sync)."""
        now = time.time()
        lanes, rows = [], []
        sample_row = {}
        for i, s in enumerate(out.scheduled):
            req = self._requests.get(s.seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if s.start < s.seq.num_prompt_tokens:
                self._prompt_tokens_total += min(s.num_tokens, s.seq.num_prompt_tokens - s.start)
            if s.sample:
                sample_row[i] = len(sample_row)
                lanes.append(s.seq)
                rows.append(sample_row[i])
        for parent_idx, child in out.forks:
            req = self._requests[child.request_id]
            self._track(req, child)
            lanes.append(child)
            rows.append(sample_row[parent_idx])
        want = max((seq.params.logprobs for seq in lanes if seq.params.logprobs is not None), default=-1)
        result = self.runner.execute(out.scheduled, lanes, rows, self.eos_ids, want, out.copy_on_write)
        self.scheduler.postprocess(out)
        if result is None:
            return None
        return _Step(out, lanes, result, *self.runner.start_readback(result))

    def _launch_lookahead(self, prev: _Step) -> _Step | None:
        """Launch the decode step after ``prev`` with ``prev``'s tokens, still on the device, as its
        inputs; None where that step is not certain to be the next one (see Scheduler.schedule_lookahead)
        or a request needs its tokens on the host first (penalties) or is about to end by length.
        A request that ends on a stop token or string at ``prev`` wastes one token of work, discarded."""
        for seq in prev.lanes:
            p = seq.params
            n_out = len(seq.output_token_ids) + 1  # with prev's token
            if p.has_penalties or (p.max_tokens is not None and n_out >= p.max_tokens) \
                    or seq.num_tokens + 1 >= self.max_model_len:
                return None
        out = self.scheduler.schedule_lookahead(prev.out)
        if out is None:
            return None
        lanes = [s.seq for s in out.scheduled]  # prev's lanes, in prev's order: row i = prev's token i
        want = max((seq.params.logprobs for seq in lanes if seq.params.logprobs is not None), default=-1)
        result = self.runner.execute(out.scheduled, lanes, list(range(len(lanes))), self.eos_ids, want,
                                     out.copy_on_write, input_tokens=prev.result.tokens)
        self.num_lookahead_steps += 1
        return _Step(out, lanes, result, *self.runner.start_readback(result))

    def _finalize(self, step: _Step, finished_only: bool) -> list[RequestOutput]:
        """Wait for the step's tokens on the host (the one sync) and hand them to their requests."""
        if step.ready is not None:
            step.ready.synchronize()  # this step's copy only, not the lookahead queued behind it
        result, lanes = step.host, step.lanes
        tokens = result.tokens.tolist()
        extra = None
        if result.logprobs is not None:
            extra = (result.logprobs.tolist(), result.ranks.tolist(),
                     result.top_ids.tolist() if result.top_ids is not None else None,
                     result.top_logprobs.tolist() if result.top_logprobs is not None else None)
        now = time.time()
        touched: dict[str, _Request] = {}
        for lane, (seq, tok) in enumerate(zip(lanes, tokens)):
            req = self._requests.get(seq.request_id)
            if req is None or seq.status.is_finished:  # aborted, or ended while a lookahead ran
                continue
            seq.append_token(tok)
            self._generation_tokens_total += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            req.num_cached_tokens = max(req.num_cached_tokens, getattr(seq, "num_cached_tokens", 0))
            self._emit(req, seq, tok, lane, extra)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self._requests[req.request_id]
            elif finished_only:
                continue
            outputs.append(self._request_output(req))
        return outputs

    def _emit(self, req: _Request, seq, tok: int, lane: int, extra) -> None:
        p = req.params
        comp = req.completions[seq.index]
        detok = req.detoks[seq.index]
        comp.token_ids.append(tok)
        if extra is not None and comp.logprobs is not None:
            lps, ranks, top_ids, top_lps = extra
            entry = {tok: Logprob(lps[lane], ranks[lane], self._decode_one(tok))}
            if top_ids is not None:
                for r, (t, lp) in enumerate(zip(top_ids[lane][: p.logprobs], top_lps[lane][: p.logprobs])):
                    entry.setdefault(t, Logprob(lp, r + 1, self._decode_one(t)))
            comp.logprobs.append(entry)
            comp.cumulative_logprob += lps[lane]
        n_out = len(comp.token_ids)
        finish, stop_reason = None, None
        is_eos = tok in self.eos_ids and not p.ignore_eos and n_out > p.min_tokens - 1
        if is_eos:
            finish = "stop"
        elif tok in p.stop_token_ids and n_out >= p.min_tokens:
            finish, stop_reason = "stop", tok
        if finish is None:
            comp.text += detok.add(tok, check_stop=n_out >= p.min_tokens)
            if detok.stopped is not None:
                finish, stop_reason = "stop", detok.stopped
            elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
                finish = "length"
        if finish is not None:
            if detok.stopped is None:
                comp.text += detok.flush()
            comp.finish_reason, comp.stop_reason = finish, stop_reason
            status = SequenceStatus.FINISHED_STOPPED if finish == "stop" else SequenceStatus.FINISHED_LENGTH
            self.scheduler.finish(seq, status)

    def _request_output(self, req: _Request) -> RequestOutput:
        comps = [CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                  list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)
                 for _, c in sorted(req.completions.items())]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, req.finished, req.metrics,
                             req.num_cached_tokens)
