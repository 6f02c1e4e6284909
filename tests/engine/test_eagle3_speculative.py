"""The "eagle3" speculative method (turnout/models/eagle3.py, turnout/engine/hidden_drafts.py): a tiny random Llama
target and a tiny random EAGLE-3 head written in the published layout (config.json with
``LlamaForCausalLMEagle3`` and ``draft_vocab_size``; ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` over a draft
vocabulary of half the target's, ``d2t`` / ``t2d``; no ``embed_tokens``: the target's is shared):

- greedy output with k = 3 identical to no speculation, also over prefix-cache hits;
- every draft equals an independent reference written here: transformers' Llama gives the streams entering layers
  2, L // 2 and L - 3, and the head's layer is plain torch (RMSNorm, rotate-half rope, causal GQA, SwiGLU);
- a head whose hidden_size is not the target's, or without d2t, or whose d2t points outside the target's
  vocabulary, is a start-up error naming speculative_config.model; eagle3 on a target without its hidden states
  exposed (the MTP-less refusals are test_mtp_speculative's).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

V, DV, H, L, HEADS, KV_HEADS, D = 96, 48, 64, 8, 4, 2, 16
AUX = (2, L // 2, L - 3)
PROMPTS = [[1, 2, 3, 4, 5], [7, 30, 31, 8, 9, 60, 61, 62, 11, 5, 2], list(range(40, 60))]
KW = dict(kv_cache_memory=4 << 20, enforce_eager=True, device="cpu", block_size=16, async_scheduling=False)
THETA, EPS = 10000.0, 1e-5


def _head_tensors(seed: int, hidden: int = H) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(rows, cols):
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    def norm():
        return 1 + 0.1 * torch.randn(hidden, generator=g)

    ids = torch.sort(torch.randperm(V, generator=g)[:DV]).values  # the draft vocabulary's target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m = "midlayer."
    return {"fc.weight": w(hidden, 3 * H), m + "self_attn.q_proj.weight": w(HEADS * D, 2 * hidden),
            m + "self_attn.k_proj.weight": w(KV_HEADS * D, 2 * hidden),
            m + "self_attn.v_proj.weight": w(KV_HEADS * D, 2 * hidden), m + "self_attn.o_proj.weight": w(hidden, HEADS * D),
            m + "mlp.gate_proj.weight": w(128, hidden), m + "mlp.up_proj.weight": w(128, hidden),
            m + "mlp.down_proj.weight": w(hidden, 128), m + "input_layernorm.weight": norm(),
            m + "hidden_norm.weight": norm(), m + "post_attention_layernorm.weight": norm(), "norm.weight": norm(),
            "lm_head.weight": w(DV, hidden) * 4, "d2t": ids - torch.arange(DV), "t2d": t2d}


def _write_head(path, tensors, hidden: int = H) -> str:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": D, "intermediate_size": 128,
        "num_hidden_layers": 1, "rms_norm_eps": EPS, "vocab_size": V, "draft_vocab_size": DV,
        "max_position_embeddings": 256, "rope_theta": THETA, "hidden_act": "silu", "tie_word_embeddings": False}))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D,
                                   max_position_embeddings=256, rms_norm_eps=EPS, rope_theta=THETA,
                                   tie_word_embeddings=False)
    target = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in target.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    root = tmp_path_factory.mktemp("eagle3")
    target.save_pretrained(root / "target", safe_serialization=True)
    w = _head_tensors(2)
    return str(root / "target"), _write_head(root / "head", w), target, w


def _rms(x, weight):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rope(x, pos):  # x [T, h, D], rotate-half
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _ref_layer(w, emb, hid, pos):
    """The head's decoder layer over a whole causal sequence: emb, hid [T, H], positions [T] -> [T, H]."""
    m, t = "midlayer.", emb.shape[0]
    x = torch.cat([_rms(emb, w[m + "input_layernorm.weight"]), _rms(hid, w[m + "hidden_norm.weight"])], -1)
    q = _rope((x @ w[m + "self_attn.q_proj.weight"].T).view(t, HEADS, D), pos)
    k = _rope((x @ w[m + "self_attn.k_proj.weight"].T).view(t, KV_HEADS, D), pos)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, KV_HEADS, D)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, HEADS * D)
    h = o @ w[m + "self_attn.o_proj.weight"].T + hid
    y = _rms(h, w[m + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
    return act @ w[m + "mlp.down_proj.weight"].T + h


@torch.no_grad()
def _reference_drafts(tiny, tokens: list[int], start: int, k: int) -> list[int]:
    _, _, target, w = tiny
    n = len(tokens)
    hs = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states  # [i]: entering layer i
    aux = torch.cat([hs[i][0] for i in AUX], -1) @ w["fc.weight"].T  # [n - 1, H]
    embed = target.model.embed_tokens.weight
    embs = [embed[tokens[t + 1]] for t in range(start, n - 1)]
    hids = [aux[t] for t in range(start, n - 1)]
    out = []
    for _ in range(k):
        y = _ref_layer(w, torch.stack(embs), torch.stack(hids), torch.arange(start, start + len(embs)))
        d = int((_rms(y[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        out.append(d + int(w["d2t"][d]))
        embs.append(embed[out[-1]])
        hids.append(y[-1])
    return out


def _run(llm, prompts, sp):
    before = llm.get_stats()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    after = llm.get_stats()
    return [o.outputs[0].token_ids for o in outs], after.draft_tokens_total - before.draft_tokens_total


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_identical_and_drafts_equal_the_reference(tiny, async_scheduling):
    """Also with async scheduling (the GPU default: lookahead steps between drafting steps)."""
    path, head, _, _ = tiny
    llm = LLM(path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              **{**KW, "async_scheduling": async_scheduling})
    prop, log = llm.engine.core.proposer, []
    assert prop.head.aux_layers == AUX and llm.engine.runner.hidden_capture.points == AUX
    inner = prop.propose

    def propose(seqs):
        out = inner(seqs)
        log.extend((list(s.token_ids), prop._lanes[s.seq_id].start, out[s.seq_id]) for s in seqs if s.seq_id in out)
        return out
    prop.propose = propose
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got, drafted = _run(llm, PROMPTS, sp)
    want, off = _run(llm, PROMPTS, dataclasses.replace(sp, speculative_decoding=False))
    assert got == want and drafted > 0 and off == 0
    again, _ = _run(llm, PROMPTS, sp)  # prefix-cache hits
    assert again == want
    assert any(start > 0 for _, start, _ in log)
    picked = log[:: max(1, len(log) // 12)] + [next(e for e in log if e[1] > 0)]
    for tokens, start, drafts in picked:
        assert all(0 <= d < V for d in drafts)
        assert drafts == _reference_drafts(tiny, tokens, start, len(drafts)), (tokens, start)
    llm.shutdown()


@pytest.mark.parametrize("edit,match", [
    (lambda w: w.pop("d2t"), "no 'd2t' tensor"),
    (lambda w: w.update(d2t=w["d2t"] + V), "d2t .* does not map"),
    (lambda w: w.update(t2d=torch.ones(V, dtype=torch.bool)), "t2d .* does not mark"),
    (lambda w: w.pop("midlayer.hidden_norm.weight"), "missing.*midlayer.hidden_norm.weight"),
])
def test_bad_heads_are_refused_naming_the_field(tiny, tmp_path, edit, match):
    path, _, _, w = tiny
    w = dict(w)
    edit(w)
    head = _write_head(tmp_path / "bad", w)
    with pytest.raises(ValueError, match=f"^speculative_config\\.model: .*{match}"):
        LLM(path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2}, **KW)


def test_a_head_of_another_hidden_size_is_refused(tiny, tmp_path):
    path = tiny[0]
    head = _write_head(tmp_path / "wide", _head_tensors(3, hidden=32), hidden=32)
    cfg = json.loads((tmp_path / "wide" / "config.json").read_text())
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": 48}))
    with pytest.raises(ValueError, match=r"^speculative_config\.model: .*hidden_size \(48\) differs .* \(64\)"):
        LLM(path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2}, **KW)
    (tmp_path / "wide" / "config.json").write_text(json.dumps(cfg))  # no target_hidden_size: hidden_size is it
    with pytest.raises(ValueError, match=r"^speculative_config\.model: .*hidden_size \(32\) differs"):
        LLM(path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2}, **KW)
