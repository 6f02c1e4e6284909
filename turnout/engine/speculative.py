"""Speculative decoding's engine half: the proposer a ``speculative_config`` asks for (turnout/speculative_config.py),
and the draft-model proposer (the "mtp" and "eagle3" proposers, which read the target's hidden states:
turnout/engine/hidden_drafts.py).

Exactness does not rest on the proposer. The rank verifies a step's k drafts in the one sampler launch that
draws all k + 1 positions, each with the request's seed and its own output step (worker/step.py), and keeps
a draft only where its own draw equals it. Each kept token is therefore the very token a one-token step
would have drawn there: greedy output, and seeded sampled output, are identical to decoding without drafts,
whatever was proposed, even drafts drawn with the same noise (below): every kept token is a deterministic
function of its prefix and of (seed, step), as in one-token decoding. For a draft distribution q that is a
point mass (the n-gram's) this is rejection sampling: the draft d is accepted with probability
p(d) = min(1, p(d) / q(d)), and on rejection the token drawn is distributed as p restricted to tokens other
than d, the renormalised max(p - q, 0). Stop strings, max_tokens, min_tokens, penalties and logprobs are applied per drawn position
(worker/step_sampling.py, engine/output_processor.py), as k + 1 one-token steps would apply them.

The draft model is a second engine of the draft checkpoint, in this process, with its own weights, KV cache
and CUDA graphs. Each step it continues every draftable sequence by k tokens, drawn with the request's
temperature, truncation, penalties, seed and output steps: the sampler's noise is a hash of (seed, step,
token), so the draft's draws and the target's are coupled (Gumbel-max with shared noise), and a draft close
to the target proposes what the target will draw, sampled as well as greedy. Its prompt is the
sequence's tokens so far, so its prefix cache holds the blocks of the previous step's call and the call
computes only the tokens appended since (the accepted ones and the last partial block), then k - 1 decode
steps. Its own block tables follow the target's tokens with no bookkeeping to keep in step: the prefix cache's
hash chain is that bookkeeping. It is built before the target, so the target's memory profile sees it.
"""

from __future__ import annotations

import dataclasses
import logging

from turnout.engine.ngram_proposer import NgramProposer
from turnout.engine.sampling_params import SamplingParams
from turnout.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# The draft engine's share of the memory the target may use on a GPU (its weights, activations and KV cache);
# the target's profile then sees it as taken.
DRAFT_MEMORY_FRACTION = 0.1


def draft_engine_config(config, spec):
    """The draft engine's EngineConfig: the draft model on the target's device and dtype, one rank, no drafts of
    its own, greedy, with a prefix cache (which keeps its KV in step with the target's tokens)."""
    return dataclasses.replace(
        config, model=spec.model if spec.model is not None else config.model,
        num_hidden_layers=spec.num_draft_layers, tokenizer=None, served_model_name=None, speculative_config=None,
        num_speculative_tokens=0, max_model_len=None, enable_prefix_caching=True, tensor_parallel_size=1, nnodes=1, node_rank=0,
        distributed_executor_backend=None, data_parallel_size=1, data_parallel_rank=0, quantization=None,
        kv_offload_gb=0.0, swap_space=0.0, preemption_mode="recompute", max_tokens_per_request=None,
        gpu_memory_utilization=config.gpu_memory_utilization * DRAFT_MEMORY_FRACTION)


def check_draft_vocabulary(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """A draft is useful, and its token ids mean the same text, only with the target's tokenizer (checkpoints
    without one: the same vocabulary size)."""
    if target_tokenizer is None or draft_tokenizer is None:
        if (target_tokenizer is None) != (draft_tokenizer is None) or target_vocab != draft_vocab:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({draft_vocab} tokens, "
                             f"{'no' if draft_tokenizer is None else 'a'} tokenizer) differs from the target's "
                             f"({target_vocab} tokens, {'no' if target_tokenizer is None else 'a'} tokenizer)")
        return
    t, d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t != d:
        diff = next((tok for tok in t if d.get(tok) != t[tok]), None) or next(tok for tok in d if tok not in t)
        raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the target's ({len(d)} "
                         f"against {len(t)} tokens; first difference: {diff!r}); a draft model must share the "
                         "target's vocabulary")


class DraftModelProposer:
    """A DraftProposer (engine/drafts.py): the draft engine's continuation of each sequence, k tokens."""

    def __init__(self, engine, k: int, max_batch: int | None = None):
        self.engine, self.k, self.max_batch = engine, k, max_batch
        self._calls = 0

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        eng = self.engine
        self._calls += 1
        asked = {}
        for seq in seqs:
            room = min(self.k, eng.max_model_len - seq.num_tokens)
            if room < 1:  # past the draft's context: this sequence decodes without drafts
                continue
            rid = f"draft-{self._calls}-{seq.seq_id}"
            try:
                eng.add_request(rid, list(seq.token_ids), _draft_params(seq.params, room, seq.seed))
            except ValueError:  # the draft cannot take it (its own limits): no drafts, never an error
                continue
            queued = eng.scheduler.waiting[-1]
            if queued.request_id == rid:
                # the target's outputs count as the draft's: its draws then use the target's output steps, so
                # the same noise as the target's own draws at those positions
                queued.num_prompt_tokens = seq.num_prompt_tokens
            asked[rid] = seq.seq_id
        out = {}
        try:
            while eng.has_unfinished_requests():
                for o in eng.step(finished_only=True):
                    if o.finished and o.request_id in asked:
                        out[asked[o.request_id]] = list(o.outputs[0].token_ids)
        except Exception:
            eng.abort_request(list(asked))
            raise
        return out


def _draft_params(p: SamplingParams | None, room: int, seed: int) -> SamplingParams:
    """The draft's sampling: the target request's temperature, truncation, penalties and seed, so that a draft
    model close to the target draws what the target will (coupled by the sampler's noise, a hash of seed, step
    and token: the target's own checkpoint as draft is accepted every time, sampled or greedy); ``room`` tokens,
    no stops (a draft past a stop is cut by the target's own stop)."""
    if p is None:
        return SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True, skip_special_tokens=False)
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=seed,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, max_tokens=room,
                          ignore_eos=True, skip_special_tokens=False)


def build_draft_engine(config, engine_cls):
    """The draft model's engine where ``config`` asks for one, else None. ``engine_cls``: the engine class (passed
    in, so this module imports no engine above it). Built before the target's, whose memory profile then
    counts it."""
    spec = getattr(config, "speculative", None)
    if spec is None or spec.method != "draft_model":
        return None
    from turnout.loader.source import check_model_exists

    try:
        if spec.model is not None:  # None: the target's own checkpoint (a layer-truncated self-draft)
            check_model_exists(spec.model)
    except ValueError as e:
        raise ValueError(f"speculative_config.{e}") from None
    return engine_cls(draft_engine_config(config, spec))


def build_proposer(config, target_tokenizer, target_vocab: int, draft_engine=None, runner=None):
    """The DraftProposer ``config.speculative`` asks for (None: no speculation); ``draft_engine``: the draft
    model's engine (build_draft_engine), checked against the target's tokenizer here; ``runner``: the driver
    rank's ModelRunner, whose model and hidden states the "mtp" and "eagle3" heads read
    (turnout/engine/hidden_drafts.py)."""
    spec = getattr(config, "speculative", None)
    if spec is None:
        return None
    k, cap = spec.num_speculative_tokens, spec.disable_by_batch_size
    if spec.method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max, max_batch=cap)
    if spec.method in ("mtp", "eagle3"):
        from turnout.engine.hidden_drafts import build_hidden_state_proposer

        return build_hidden_state_proposer(spec, runner, config.tensor_parallel_size)
    check_draft_vocabulary(target_tokenizer, draft_engine.tokenizer, target_vocab, draft_engine.runner.vocab_size)
    return DraftModelProposer(draft_engine, k, max_batch=cap)
