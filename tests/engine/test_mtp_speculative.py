"""The "mtp" speculative method (turnout/engine/hidden_drafts.py) on a tiny random DeepSeek-V3-shaped checkpoint
with one multi-token-prediction layer (float32, CPU):

- greedy output with k = 1 and k = 3 identical to no speculation, 32 tokens on three prompts, also over
  prefix-cache hits and chunked prefill;
- every draft the proposer made equals an independent reference: transformers' DeepSeek-V3 computes the target's
  stream before its final norm and the MTP block (as a one-layer model whose norm and head are
  ``shared_head``'s), the glue ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))`` written here, chained on the
  block's own output stream for k > 1;
- an MTP layer built to predict the target exactly (blocks that add nothing: each next token is a function of the
  current one, and the MTP layer computes that function of the token it is given): every draft accepted, and the
  counters say so per position;
- seeded sampling: the samples with MTP are the samples without, seed by seed;
- "mtp" on a model without MTP layers is a start-up error naming speculative_config.method.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

V, H, L = 96, 64, 2
PROMPTS = [[1, 2, 3, 4, 5], [7, 30, 31, 8, 9, 60, 61, 62, 11, 5, 2], list(range(40, 60))]
KW = dict(kv_cache_memory=4 << 20, enforce_eager=True, device="cpu", block_size=16, async_scheduling=False)


def _config(layers: int, first_dense: int = 1):
    return transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, q_lora_rank=24,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=first_dense, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        num_nextn_predict_layers=0)


def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))


def _mtp_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = f"model.layers.{L}."
    return {p + "enorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
            p + "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
            p + "eh_proj.weight": torch.randn(H, 2 * H, generator=g) * (2 * H) ** -0.5,
            p + "embed_tokens.weight": torch.randn(V, H, generator=g),
            p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
            p + "shared_head.head.weight": torch.randn(V, H, generator=g) * H ** -0.5}


def _save(hf3, extra: dict, path) -> str:
    """``hf3``'s L + 1 layers saved as an L-layer checkpoint whose layer L (with ``extra``) is its MTP layer."""
    from safetensors.torch import save_file

    hf3.save_pretrained(path, safe_serialization=True)
    tensors = {k: v.contiguous() for k, v in hf3.state_dict().items()}
    tensors.update(extra)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    hf3 = transformers.DeepseekV3ForCausalLM(_config(L + 1)).eval()
    _randomise(hf3, 1)
    extra = _mtp_tensors(2)
    path = _save(hf3, extra, tmp_path_factory.mktemp("dsv3_mtp"))
    sd = hf3.state_dict()
    target = transformers.DeepseekV3ForCausalLM(_config(L)).eval()
    target.load_state_dict({k: v for k, v in sd.items() if not k.startswith(f"model.layers.{L}.")})
    block = transformers.DeepseekV3ForCausalLM(_config(1, first_dense=0)).eval()  # layer 0 = MTP block
    p = f"model.layers.{L}."
    block.load_state_dict({**{k.replace(p, "model.layers.0."): v for k, v in sd.items() if k.startswith(p)},
                           "model.embed_tokens.weight": extra[p + "embed_tokens.weight"],
                           "model.norm.weight": extra[p + "shared_head.norm.weight"],
                           "lm_head.weight": extra[p + "shared_head.head.weight"]})
    return path, target, block, {k.replace(p, ""): v for k, v in extra.items()}


def _prenorm(model, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], the stream before the final norm [T, H]) of one unbatched forward."""
    got = {}
    h = model.model.norm.register_forward_pre_hook(lambda m, a: got.setdefault("x", a[0].detach().clone()))
    try:
        logits = model(**kw).logits[0]
    finally:
        h.remove()
    return logits, got["x"][0]


@torch.no_grad()
def _reference_drafts(tiny, tokens: list[int], start: int, k: int) -> list[int]:
    """The MTP drafts after ``tokens``, the layer's context starting at position ``start``."""
    _, target, block, w = tiny
    n = len(tokens)
    _, h = _prenorm(target, input_ids=torch.tensor([tokens[:-1]]))  # h_t, t < n - 1

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def pair(tok: int, hidden):
        e = w["embed_tokens.weight"][tok]
        return torch.cat([rms(e, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])]) @ w["eh_proj.weight"].T

    inputs = [pair(tokens[t + 1], h[t]) for t in range(start, n - 1)]
    out = []
    for _ in range(k):
        logits, stream = _prenorm(block, inputs_embeds=torch.stack(inputs)[None],
                                  position_ids=torch.arange(start, start + len(inputs))[None])
        out.append(int(logits[-1].argmax()))
        inputs.append(pair(out[-1], stream[-1]))
    return out


def _recording(llm) -> list:
    """Wrap the proposer: each call's (tokens, the draft context's start, drafts) per sequence."""
    prop, log = llm.engine.core.proposer, []
    inner = prop.propose

    def propose(seqs):
        out = inner(seqs)
        for s in seqs:
            if s.seq_id in out:
                log.append((list(s.token_ids), prop._lanes[s.seq_id].start, list(out[s.seq_id])))
        return out
    prop.propose = propose
    return log


def _run(llm, prompts, sp):
    before = llm.get_stats()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    after = llm.get_stats()
    return ([o.outputs[0].token_ids for o in outs], after.draft_tokens_total - before.draft_tokens_total,
            after.accepted_draft_tokens_total - before.accepted_draft_tokens_total)


def _off(sp):
    return dataclasses.replace(sp, speculative_decoding=False)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_and_drafts_equal_the_reference(tiny, k):
    llm = LLM(tiny[0], speculative_config={"method": "mtp", "num_speculative_tokens": k}, **KW)
    log = _recording(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got, drafted, accepted = _run(llm, PROMPTS, sp)  # first: no prefix-cache hits, the drafts' context is whole
    want, off_drafted, _ = _run(llm, PROMPTS, _off(sp))
    assert got == want and off_drafted == 0
    assert drafted > 0 and len(log) > 0
    for tokens, start, drafts in log[:: max(1, len(log) // 12)]:  # a dozen proposals across the run
        assert drafts == _reference_drafts(tiny, tokens, start, len(drafts)), (tokens, start)
    again, drafted2, _ = _run(llm, PROMPTS, sp)  # prefix-cache hits: the draft context starts after them
    assert again == want and drafted2 > 0
    assert any(start > 0 for _, start, _ in log)
    tokens, start, drafts = next(e for e in log if e[1] > 0)
    assert drafts == _reference_drafts(tiny, tokens, start, len(drafts))
    s = llm.get_stats()
    assert sum(s.draft_tokens_per_position) == s.draft_tokens_total
    assert len(s.draft_tokens_per_position) == k
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_batching(tiny, async_scheduling):
    """Chunks of 8 tokens, three prompts at once; with async scheduling too (the GPU default: a step without
    drafts may be followed by a lookahead step, whose hidden states the drafter must still get in order)."""
    llm = LLM(tiny[0], speculative_config={"method": "mtp", "num_speculative_tokens": 2}, max_num_batched_tokens=8,
              **{**KW, "async_scheduling": async_scheduling})
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got, drafted, _ = _run(llm, PROMPTS, sp)
    want, _, _ = _run(llm, PROMPTS, _off(sp))
    assert got == want and drafted > 0
    llm.shutdown()


def test_seeded_samples_are_the_samples_without_drafts(tiny):
    """The kept tokens are the target's own draws (seed, step): 200 seeded samples of 6 tokens at temperature 1
    with MTP drafts equal those without, seed by seed, so the two empirical distributions are equal (total
    variation 0), and both paths of verification (kept and rejected drafts) ran."""
    llm = LLM(tiny[0], speculative_config={"method": "mtp", "num_speculative_tokens": 2}, max_num_seqs=256, **KW)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in range(200)]
    got, drafted, accepted = _run(llm, [PROMPTS[1]] * 200, params)
    want, _, _ = _run(llm, [PROMPTS[1]] * 200, [_off(p) for p in params])
    assert got == want
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
    llm.shutdown()


def test_a_predictor_that_copies_the_target_is_always_accepted(tiny, tmp_path):
    """Every block adds nothing (o_proj, experts and MLPs zero), so the target's stream at t is embed(x_t) and its
    next token f(x_t) = argmax head(norm(embed(x_t))). The MTP layer with eh_proj = [I, 0], unit enorm, the
    target's embedding, final norm and head computes f(x_{t+1}): the target's next token after x_{t+1}, exactly
    what it drafts for. Every draft is accepted, at every position."""
    from safetensors.torch import load_file, save_file

    src = tiny[0]
    tensors = load_file(f"{src}/model.safetensors")
    for name in list(tensors):
        if "o_proj" in name or "down_proj" in name:  # (transformers 5 stacks the experts: no .weight suffix)
            tensors[name] = torch.zeros_like(tensors[name])
    p = f"model.layers.{L}."
    tensors.update({p + "enorm.weight": torch.ones(H), p + "eh_proj.weight": torch.cat([torch.eye(H),
                                                                                          torch.zeros(H, H)], 1),
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    p + "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **KW)
    sp = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    got, drafted, accepted = _run(llm, PROMPTS, sp)
    want, _, _ = _run(llm, PROMPTS, _off(sp))
    assert got == want
    s = llm.get_stats()
    assert drafted > 0 and accepted == drafted
    assert s.accepted_draft_tokens_per_position == s.draft_tokens_per_position
    # 32 tokens after the first: k + 1 = 4 a step, 8 steps with drafts per prompt
    assert s.num_drafts_total == 8 * len(PROMPTS) and s.mean_accepted_length == 4.0
    llm.shutdown()


def test_mtp_without_mtp_layers_is_refused(tmp_path):
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(_config(L)).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"^speculative_config\.method: 'mtp'.*num_nextn_predict_layers 0"):
        LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **KW)
