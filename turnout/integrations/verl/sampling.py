"""verl's per-request sampling dict -> turnout's SamplingParams, and the engine's output -> the fields of
verl's ``TokenOutput``, read the way verl's vLLM server reads and writes them."""

from __future__ import annotations

import dataclasses
from typing import Any

from turnout.engine.sampling_params import SamplingParams

_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def sampling_params(sp: dict, num_prompt: int, *, max_model_len: int, prompt_length: int, response_length: int,
                    defaults: dict[str, Any], routed_experts: bool) -> SamplingParams:
    """As verl's server: ``max_tokens`` (or SGLang's ``max_new_tokens``; default the response length, within
    the prompt + response budget) clamped to [1, room left]; ``logprobs`` truthy -> the sampled token's;
    ``defaults`` (the rollout config's repetition penalty, ignore_eos) where the request gives none. Any
    other key must be a SamplingParams field: an unknown one is a ValueError naming it."""
    if not isinstance(sp, dict):
        raise ValueError(f"sampling_params: must be a dict, got {type(sp).__name__}")
    sp = dict(sp)
    room = max_model_len - num_prompt
    if room < 1:
        raise ValueError(f"prompt_ids: {num_prompt} tokens leave no room to generate within max_model_len "
                         f"{max_model_len}")
    key = "max_tokens" if "max_tokens" in sp else "max_new_tokens" if "max_new_tokens" in sp else None
    if key == "max_tokens" and "max_new_tokens" in sp:
        raise ValueError("sampling_params: give max_tokens or max_new_tokens, not both")
    max_tokens = sp.pop(key) if key else min(response_length, prompt_length + response_length - num_prompt)
    if type(max_tokens) is not int:
        raise ValueError(f"sampling_params.{key}: must be an integer, got {max_tokens!r}")
    max_tokens = max(1, min(max_tokens, room))
    sp["logprobs"] = 0 if sp.pop("logprobs", False) else None
    for k, v in defaults.items():
        sp.setdefault(k, v)
    if routed_experts:
        sp.setdefault("return_routed_experts", True)
    unknown = sorted(set(sp) - _FIELDS)
    if unknown:
        raise ValueError(f"sampling_params.{unknown[0]}: not a sampling parameter turnout knows")
    if sp.get("n", 1) != 1:
        raise ValueError(f"sampling_params.n: generate returns one sample (got {sp['n']}); repeat the request")
    return SamplingParams(**sp, max_tokens=max_tokens)  # every value checked, naming its field


def token_output_fields(out, params: SamplingParams, global_steps) -> dict[str, Any]:
    """The keyword arguments of verl's ``TokenOutput`` for the engine's last ``RequestOutput``."""
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        raise RuntimeError(f"request {out.request_id!r} failed inside the engine: {out.error}")
    log_probs = None
    if params.logprobs is not None:
        log_probs = [e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs or [])]
    reason = comp.finish_reason
    stop = "aborted" if reason == "abort" else "completed" if reason in ("stop", "length") else reason
    extra: dict[str, Any] = {"global_steps": global_steps, "num_cached_tokens": out.num_cached_tokens}
    k = params.prompt_logprobs
    if k is not None and out.prompt_logprobs is not None:
        # verl's shape (its vLLM server's extract_prompt_logprobs): per prompt position after the first, the
        # top-k ids and logprobs by rank (k == 0: the prompt token's own), then one dummy row for the last
        ids, lps = [], []
        for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            if k == 0:
                ids.append([tok])
                lps.append([entry[tok].logprob])
                continue
            row_ids, row_lps = [None] * k, [None] * k
            for t, lp in entry.items():
                if lp.rank is not None and 1 <= lp.rank <= k:
                    row_ids[lp.rank - 1], row_lps[lp.rank - 1] = int(t), lp.logprob
            ids.append(row_ids)
            lps.append(row_lps)
        ids.append([0] * max(k, 1))
        lps.append([0.0] * max(k, 1))
        extra["prompt_ids"], extra["prompt_logprobs"] = ids, lps
    return {"token_ids": list(comp.token_ids), "log_probs": log_probs, "routed_experts": comp.routed_experts,
            "stop_reason": stop, "num_preempted": None, "extra_fields": extra}
