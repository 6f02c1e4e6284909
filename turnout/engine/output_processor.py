"""Output processing: sampled tokens -> text, stops and ``RequestOutput``s. No torch.

The engine core hands over, per step, each sequence's new token (``CoreOutput``). Here every sample is
detokenised incrementally, checked for EOS, stop tokens, stop strings and length, and its
``CompletionOutput`` grows. What ends a sequence goes back to the core as a ``(sequence, status)`` pair,
which frees its blocks. An exception while processing one request's token (its detokeniser, its stop
strings) fails that request only: its output finishes with ``finish_reason == "error"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from turnout.engine.core_outputs import CoreOutput, SampledToken
from turnout.engine.detokenizer import IncrementalDetokenizer, NoTextDetokenizer
from turnout.engine.input_processor import EngineRequest, Tokenizer
from turnout.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from turnout.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    request: EngineRequest
    metrics: RequestMetrics
    detoks: dict[int, IncrementalDetokenizer | NoTextDetokenizer] = field(default_factory=dict)  # by sample index
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    error: str | None = None
    # prompt_logprobs: one entry per prompt position (None at 0), filled chunk by chunk (side outputs)
    prompt_logprobs: list | None = None
    # return_routed_experts: rows [L, k] per prompt position (shared by the samples), per sample the rest
    routed_prompt: list | None = None
    routed_samples: dict[int, dict[int, object]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return (len(self.completions) == self.request.params.n
                and all(c.finish_reason for c in self.completions.values()))


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self.generation_tokens_total = 0

    def add_request(self, req: EngineRequest) -> None:
        state = RequestState(req, RequestMetrics(arrival_time=req.arrival_time))
        if req.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(req.prompt_token_ids)
        if req.params.return_routed_experts:
            state.routed_prompt = [None] * len(req.prompt_token_ids)
        self.requests[req.request_id] = state
        self.add_sample(req.request_id, 0)

    def add_sample(self, request_id: str, index: int) -> None:
        """Start the text and completion of one sample (index 0 at admission, the others at their fork)."""
        state = self.requests[request_id]
        p, prompt = state.request.params, state.request.prompt_token_ids
        if self.tokenizer is None:
            state.detoks[index] = NoTextDetokenizer()
        else:
            state.detoks[index] = IncrementalDetokenizer(self.tokenizer, prompt,
                                                         skip_special_tokens=p.skip_special_tokens,
                                                         stop=p.stop_strings,
                                                         include_stop_str_in_output=p.include_stop_str_in_output)
        state.completions[index] = CompletionOutput(index=index, text="", token_ids=[],
                                                    cumulative_logprob=0.0 if p.logprobs is not None else None,
                                                    logprobs=[] if p.logprobs is not None else None)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def finish_aborted(self, request_id: str) -> RequestOutput | None:
        """End a request as aborted and drop it: its final output, with the tokens and logprobs so far and
        ``finish_reason == "abort"`` on every unfinished sample (None if it is not here)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for i in range(state.request.params.n):
            if i not in state.completions:  # a sample not forked yet
                self.requests[request_id] = state
                self.add_sample(request_id, i)
                del self.requests[request_id]
            comp = state.completions[i]
            if comp.finish_reason is None:
                comp.text += state.detoks[i].flush()
                comp.finish_reason = "abort"
        return self._request_output(state)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def process(self, core_out: CoreOutput, now: float, finished_only: bool
                ) -> tuple[list[RequestOutput], list[tuple[Sequence, SequenceStatus]], list[str]]:
        """Returns the outputs to report, the sequences that ended (for the core to finish), and the
        requests that failed while their tokens were processed (for the core to drop)."""
        touched: dict[str, RequestState] = {}
        ended: list[tuple[Sequence, SequenceStatus]] = []
        failed: list[str] = []
        for rid, message in core_out.failed:
            state = self.requests.get(rid)
            if state is not None:
                self._fail(state, message)
                touched[rid] = state
        for side in core_out.side_outputs:
            state = self.requests.get(side.request_id)
            if state is not None and state.error is None:
                self._take_side_output(state, side)
        for st in core_out.sampled:
            state = self.requests.get(st.seq.request_id)
            if state is None or state.error is not None:
                continue
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, st.seq.num_cached_tokens)
            try:
                # a multi-token step's tokens in order: the first that ends the sample cuts the rest
                for i in range(len(st.tokens)):
                    self.generation_tokens_total += 1
                    status = self._emit(state, st, i)
                    if status is not None:
                        ended.append((st.seq, status))
                        break
            except Exception as e:  # noqa: BLE001 - one request's text must not fail the others
                logger.exception("request %r failed in output processing", state.request.request_id)
                self._fail(state, f"output processing failed: {type(e).__name__}: {e}")
                failed.append(state.request.request_id)
            touched[state.request.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request.request_id]
            elif finished_only:
                continue
            outputs.append(self._request_output(state))
        return outputs, ended, failed

    def _take_side_output(self, state: RequestState, side) -> None:
        """A prompt logprob chunk (turnout/worker/prompt_logprobs.py) or a routed-experts chunk
        (turnout/worker/routed_experts.py): its positions written in place, so a prompt recomputed after a
        preemption writes the same values again."""
        if side.kind == "routed_experts":
            if state.routed_prompt is None:
                return
            num_prompt, own = len(state.routed_prompt), state.routed_samples.setdefault(side.index, {})
            for i, row in enumerate(side.array()):
                pos = side.first + i
                if pos < num_prompt:
                    state.routed_prompt[pos] = row
                else:
                    own[pos] = row
            return
        if state.prompt_logprobs is None:
            return
        for pos, tok, lp, rank, top in side.rows():
            entry = {tok: Logprob(lp, rank, self._decode_one(tok))}
            for r, (t, tlp) in enumerate(top):
                entry.setdefault(t, Logprob(tlp, r + 1, self._decode_one(t)))
            state.prompt_logprobs[pos] = entry

    @staticmethod
    def _routed(state: RequestState, comp: CompletionOutput):
        if state.routed_prompt is None or comp.finish_reason is None:
            return None
        if comp.routed_experts is None:  # assembled once, when the sample ends
            comp.routed_experts = _assemble_routing(state.routed_prompt, state.routed_samples.get(comp.index, {}),
                                           len(state.routed_prompt), len(comp.token_ids))
        return comp.routed_experts

    def _fail(self, state: RequestState, message: str) -> None:
        state.error = message
        for i in range(state.request.params.n):
            comp = state.completions.get(i)
            if comp is None:  # a sample not forked yet
                self.add_sample(state.request.request_id, i)
                comp = state.completions[i]
            if comp.finish_reason is None:
                comp.finish_reason, comp.stop_reason = "error", message

    def _decode_one(self, tok: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([tok])

    def _emit(self, state: RequestState, st: SampledToken, i: int) -> SequenceStatus | None:
        """The ``i``-th of a step's tokens of one sample; its finish status, or None."""
        p = state.request.params
        seq, tok = st.seq, st.tokens[i]
        comp = state.completions[seq.index]
        detok = state.detoks[seq.index]
        comp.token_ids.append(tok)
        if st.logprobs is not None and comp.logprobs is not None:
            lp = st.logprobs[i]
            entry = {tok: Logprob(lp, st.ranks[i], self._decode_one(tok))}
            for r, (t, tlp) in enumerate(st.top[i][: p.logprobs]):
                entry.setdefault(t, Logprob(tlp, r + 1, self._decode_one(t)))
            comp.logprobs.append(entry)
            comp.cumulative_logprob += lp
        n_out = len(comp.token_ids)
        finish, stop_reason = None, None
        # the grammar has accepted the step's tokens, all of them: its end shows at the step's last token (one
        # that ended it earlier is a stop token, and the rows after it allowed only stop tokens)
        terminated = getattr(seq.grammar, "is_terminated", None) if i == len(st.tokens) - 1 else None
        if terminated is not None and terminated():
            finish = "stop"  # its grammar took a stop token: the structured text is complete (min_tokens, ignore_eos yield)
        elif tok in self.eos_ids and not p.ignore_eos and n_out > p.min_tokens - 1:
            finish = "stop"
        elif tok in p.stop_token_ids and n_out >= p.min_tokens:
            finish, stop_reason = "stop", tok
        if finish is None:
            comp.text += detok.add(tok, check_stop=n_out >= p.min_tokens)
            if detok.stopped is not None:
                finish, stop_reason = "stop", detok.stopped
            elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens - (len(st.tokens) - 1 - i) >= self.max_model_len:
                finish = "length"
        if finish is None:
            return None
        if detok.stopped is None:
            comp.text += detok.flush()
        comp.finish_reason, comp.stop_reason = finish, stop_reason
        return SequenceStatus.FINISHED_STOPPED if finish == "stop" else SequenceStatus.FINISHED_LENGTH

    def _request_output(self, state: RequestState) -> RequestOutput:
        comps = [CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                  list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
                                  self._routed(state, c))
                 for _, c in sorted(state.completions.items())]
        req = state.request
        plp = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, state.finished, state.metrics,
                             state.num_cached_tokens, prompt_logprobs=plp, error=state.error)


def _assemble_routing(prompt_rows: list, sample_rows: dict, num_prompt: int, num_generated: int):
    """One sample's routed experts, int32 [num_prompt + num_generated - 1, L, k], from its positions' rows
    (numpy [L, k] each; None where not computed): the complete run from position 0 (an abort mid-prompt
    returns what was computed)."""
    import numpy as np

    rows = []
    for pos in range(num_prompt + num_generated - 1):
        row = prompt_rows[pos] if pos < num_prompt else sample_rows.get(pos)
        if row is None:
            break
        rows.append(row)
    return np.stack(rows).astype(np.int32) if rows else None
