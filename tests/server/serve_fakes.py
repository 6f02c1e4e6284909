"""A small stand-in for LLMEngine (same interface) for edge-case unit tests of the server.

Tokens are bytes (id = byte value); generation is deterministic: each step every running request gets
one letter derived from (seed, position). `fail_after_steps` makes step() raise, to test engine death;
the stop string ``FAIL-REQUEST`` makes that request alone fail (RequestOutput.error) at its second token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from turnout.engine.llm_engine import EngineStats
from turnout.engine.outputs import CompletionOutput, Logprob, RequestOutput


class ContextLengthError(ValueError):
    def __init__(self, prompt_len, max_model_len):
        super().__init__(f"prompt: {prompt_len} tokens exceed max_model_len {max_model_len}")
        self.prompt_len, self.max_model_len = prompt_len, max_model_len


class FakeTokenizer:
    eos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if 2 <= i < 256).decode("utf-8", "replace")

    def __len__(self):
        return 256


class FakeOps:
    def report(self):
        return [{"op": "rms_norm", "chosen": "reference.torch", "candidates": []},
                {"op": "sample", "chosen": "reference.torch", "candidates": []}]


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: object
    arrival: float
    outs: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)


class FakeEngine:
    def __init__(self, max_model_len=128, max_num_seqs=4, step_delay=0.01, fail_after_steps=None,
                 num_blocks=64, block_size=16):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.model_name = "fake-model"
        self.ops = FakeOps()
        self.step_delay = step_delay
        self.fail_after_steps = fail_after_steps
        self.num_blocks, self.block_size = num_blocks, block_size
        self.running: dict[str, _Req] = {}
        self.waiting: dict[str, _Req] = {}
        self.steps = 0
        self.stats = EngineStats()
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, arrival_time=None):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = next((t for t in ids if not 0 <= t < 256), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, 256)")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(len(ids), self.max_model_len)
        if request_id in self.running or request_id in self.waiting:
            raise ValueError(f"request_id: duplicate {request_id}")
        r = _Req(request_id, ids, params, arrival_time or time.time())
        r.outs = [[] for _ in range(params.n)]
        r.finish = [None] * params.n
        self.waiting[request_id] = r
        self.stats.prompt_tokens_total += len(ids)

    def abort_request(self, request_id):
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.running.pop(rid, None)
            self.waiting.pop(rid, None)
            self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.running or self.waiting)

    def _token(self, r, i, pos):
        seed = r.params.seed or 0
        if r.params.temperature == 0:
            seed = 0
        return ord("a") + (seed * 7 + pos * 3 + i) % 26

    def step(self):
        self.steps += 1
        if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
            raise RuntimeError("simulated device failure")
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid = next(iter(self.waiting))
            self.running[rid] = self.waiting.pop(rid)
        outputs = []
        for rid, r in list(self.running.items()):
            p = r.params
            comps = []
            for i, toks in enumerate(r.outs):
                if r.finish[i] is None:
                    toks.append(self._token(r, i, len(toks)))
                    self.stats.generation_tokens_total += 1
                    text = self.tokenizer.decode(toks)
                    hit = next((s for s in p.stop_strings if s in text), None)
                    if hit:
                        r.finish[i] = "stop"
                    elif len(toks) >= p.max_tokens:
                        r.finish[i] = "length"
                text = self.tokenizer.decode(toks)
                stop_reason = None
                for s in p.stop_strings:
                    if s in text:
                        text, stop_reason = text[:text.index(s)], s
                lps = None
                if p.logprobs is not None:
                    lps = [{t: Logprob(-0.5, 1, chr(t))} | {ord("z"): Logprob(-2.0, 2, "z")} for t in toks]
                comps.append(CompletionOutput(i, text, list(toks), None, lps, r.finish[i], stop_reason))
            done = all(f is not None for f in r.finish)
            error = None
            if "FAIL-REQUEST" in p.stop_strings and len(r.outs[0]) >= 2:  # a fault traced to this request
                error, done = "injected fault in this request's sampling inputs", True
                for c in comps:
                    c.finish_reason, c.stop_reason = "error", error
            outputs.append(RequestOutput(rid, None, r.prompt_ids, comps, done, error=error))
            if done:
                del self.running[rid]
        self.stats.num_running = len(self.running)
        return outputs

    def get_stats(self):
        s = self.stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        used = sum(-(-(len(r.prompt_ids) + max(len(o) for o in r.outs)) // self.block_size)
                   for r in self.running.values())
        s.kv_cache_usage = used / self.num_blocks
        return EngineStats(**vars(s))

    def apply_chat_template(self, messages, add_generation_prompt=True):
        for m in messages:
            if not isinstance(m.get("content"), str):
                raise ValueError("messages: content must be a string")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.tokenizer.encode(text + ("<assistant>" if add_generation_prompt else ""))
