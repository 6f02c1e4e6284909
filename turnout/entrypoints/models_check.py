"""The model-level conformance check of `turnout models --check`: each architecture built from a tiny random config
(turnout/models/transformers_backend/tiny.py), run through turnout on this machine's platform and op table, and
compared with HF transformers on the CPU in float32: greedy tokens through the engine (``LLM``) for three prompts,
and the last-position logits of one batched prefill through the loaded model."""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

LOGITS_TOLERANCE = 1e-4


@dataclass
class CheckResult:
    model_type: str
    architecture: str
    model_impl: str
    ok: bool
    greedy_equal: bool | None = None
    max_logit_diff: float | None = None
    seconds: float = 0.0
    error: str | None = None
    reference_error: bool = False  # the error came from making HF's own tiny model: nothing of turnout's was checked

    def as_dict(self) -> dict:
        return asdict(self)


def _prefill_last_logits(model, prompts: list[list[int]], device, dtype, block_size: int = 16) -> list[torch.Tensor]:
    """Our logits at the last position of each prompt, from one batched prefill over a fresh paged cache."""
    from turnout.layers.attention import AttentionMetadata
    from turnout.worker.kv_sizing import allocate_caches, model_cache_layout

    lens = [len(p) for p in prompts]
    per_seq = math.ceil(max(lens) / block_size)
    tables = torch.arange(len(lens) * per_seq, dtype=torch.int32).view(len(lens), per_seq)
    slots = [int(tables[b, i // block_size]) * block_size + i % block_size for b, n in enumerate(lens) for i in range(n)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), block_tables=tables.to(device),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                             max_query_len=max(lens), max_seq_len=max(lens))
    caches = allocate_caches(model_cache_layout(model, dtype), len(lens) * per_seq, block_size, 1, device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.tensor([i for n in lens for i in range(n)], device=device)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, caches, meta))
    return [logits[e - 1].cpu() for e in starts[1:]]


def check_architecture(model_type: str, model_impl: str, device: str = "auto", tokens: int = 32) -> CheckResult:
    """One architecture through ``model_impl`` against HF (see the module docstring). Never raises for the model's
    own failure: the result says what went wrong."""
    from turnout.engine.llm import LLM
    from turnout.engine.sampling_params import SamplingParams
    from turnout.loader import load_model
    from turnout.models.transformers_backend.tiny import PROMPTS, hf_greedy, save_tiny
    from turnout.ops import Policy, resolve
    from turnout.platforms import detect_platform

    t0 = time.perf_counter()
    res = CheckResult(model_type, "?", model_impl, ok=False)
    try:
        with tempfile.TemporaryDirectory(prefix=f"turnout-check-{model_type}-") as d:
            try:
                hf = save_tiny(model_type, d)
                res.architecture = type(hf).__name__
                refs = [hf_greedy(hf, p, tokens) for p in PROMPTS]
            except Exception:
                res.reference_error = True
                raise
            platform = detect_platform(device)
            ops = resolve(platform, Policy.from_sources(None, platform=platform))
            dev = platform.device(0 if platform.is_gpu else None)
            loaded = load_model(d, device=dev, ops=ops, dtype="float32", model_impl=model_impl)
            ours = _prefill_last_logits(loaded.model, PROMPTS, dev, torch.float32)
            res.max_logit_diff = max(float((o - r).abs().max()) for o, (_, r) in zip(ours, refs))
            del loaded
            llm = LLM(model=d, model_impl=model_impl, device=device, dtype="float32", kv_cache_memory=16 << 20)
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)
            res.greedy_equal = all(list(o.outputs[0].token_ids) == ref for o, (ref, _) in zip(outs, refs))
            res.ok = res.greedy_equal and res.max_logit_diff <= LOGITS_TOLERANCE
    except Exception as e:  # noqa: BLE001 - reported per architecture, the suite goes on
        res.error = f"{type(e).__name__}: {e}"
    res.seconds = time.perf_counter() - t0
    return res
