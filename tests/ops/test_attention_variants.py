"""Attention variants (sliding window, logit soft-cap, sinks, head dims that are not powers of two) in the op
contract: the reference against Hugging Face transformers' own attention code on dense tensors, the conformance
cases catching a mutation of each variant, and the layer's signature and sink loading.

The implementations' conformance on these cases is the generic suite's (tests/ops/test_conformance.py runs every
sample case of ``paged_attention`` / ``rotary_paged_attention``, variants included, on every implementation);
tests/ops/test_attention_variant_kernels.py holds the Triton kernel's own cases (long-context decode, splits).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from turnout.ops import default_registry
from turnout.ops.conformance import iter_cases, run_case
from turnout.ops.reference import attention as ref_attn

hf_gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
hf_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
hf_masks = pytest.importorskip("transformers.masking_utils")


def _paged(qlens, kvlens, hq, hk, d, bs, seed=0, dtype=torch.float32):
    """paged_attention arguments and each sequence's dense keys / values [kv_len, Hk, D]."""
    g = torch.Generator().manual_seed(seed)
    b = len(qlens)
    max_blocks = max(-(-k // bs) for k in kvlens)
    nb = b * max_blocks + 2
    k_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    dense = []
    for s, n in enumerate(kvlens):
        blocks = tables[s, : -(-n // bs)].long()
        dense.append((k_cache[blocks].reshape(-1, hk, d)[:n], v_cache[blocks].reshape(-1, hk, d)[:n]))
    query = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(qlens)).cumsum(0).to(torch.int32)
    args = (query, k_cache, v_cache, tables, torch.tensor(kvlens, dtype=torch.int32), qsl, max(qlens), max(kvlens),
            1.0 / math.sqrt(d))
    return args, dense


def _hf_mask(qpos, kpos, window):
    """Hugging Face's own mask functions (masking_utils) -> an additive [1, 1, L, K] float mask."""
    fn = hf_masks.causal_mask_function if window is None else hf_masks.sliding_window_causal_mask_function(window)
    q_idx = torch.tensor(list(qpos))[:, None]
    kv_idx = torch.tensor(list(kpos))[None, :]
    allowed = fn(torch.tensor(0), torch.tensor(0), q_idx, kv_idx).expand(q_idx.shape[0], kv_idx.shape[1])
    return torch.where(allowed, 0.0, float("-inf"))[None, None]


def _hf_attention(args, dense, window=None, cap=None, sinks=None):
    """Per sequence, HF's eager attention: Gemma 2's (soft-cap) or, with sinks, GPT-OSS's."""
    query, _, _, _, seq_lens, qsl, _, _, scale = args
    hq, hk = query.shape[1], dense[0][0].shape[1]
    module = SimpleNamespace(num_key_value_groups=hq // hk, training=False, head_dim=query.shape[2], sinks=sinks)
    outs = []
    for s, (k, v) in enumerate(dense):
        q = query[int(qsl[s]): int(qsl[s + 1])]
        n, ql = int(seq_lens[s]), q.shape[0]
        mask = _hf_mask(range(n - ql, n), range(n), window)
        qh, kh, vh = (x.transpose(0, 1)[None].double() for x in (q, k, v))  # [1, H, L, D]
        if sinks is not None:
            assert cap is None
            module.sinks = sinks.double()
            o, _ = hf_gpt_oss.eager_attention_forward(module, qh, kh, vh, mask.double(), scale)
        else:
            o, _ = hf_gemma2.eager_attention_forward(module, qh, kh, vh, mask.double(), scaling=scale, softcap=cap)
        outs.append(o[0])  # [L, H, D]
    return torch.cat(outs).float()


_REF_CASES = [  # (query lens, context lens, Hq, Hk, D, block size, window, cap, sinks)
    ([1, 1, 1], [40, 9, 70], 4, 2, 16, 8, 12, None, False),  # decode: window shorter, longer than the context
    ([9, 16], [9, 16], 4, 4, 8, 4, 5, None, False),  # prefill: the window slides inside the chunk
    ([7, 3], [40, 19], 4, 2, 16, 8, 8, None, False),  # chunked prefill over a cached prefix
    ([1, 7, 3], [30, 7, 19], 6, 2, 16, 8, None, 2.0, False),  # soft-cap
    ([1, 7, 3], [30, 7, 19], 6, 2, 12, 8, None, None, True),  # sinks, a head dim of 12
    ([1, 7, 3], [30, 7, 19], 6, 2, 24, 8, 6, None, True),  # window and sinks
    ([1, 7, 3], [30, 7, 19], 6, 3, 20, 8, 6, 3.0, False),  # window and soft-cap
]


@pytest.mark.parametrize("qlens,kvlens,hq,hk,d,bs,window,cap,sinks", _REF_CASES)
def test_reference_equals_hf_eager_attention(qlens, kvlens, hq, hk, d, bs, window, cap, sinks):
    args, dense = _paged(qlens, kvlens, hq, hk, d, bs, seed=len(qlens) + d)
    sink_t = torch.randn(hq, generator=torch.Generator().manual_seed(7)) * 2 if sinks else None
    kw = dict(sliding_window=window, logit_softcap=cap, sinks=sink_t)
    want = _hf_attention(args, dense, window, cap, sink_t)
    torch.testing.assert_close(ref_attn.paged_attention(*args, **kw), want, atol=2e-6, rtol=2e-6)
    # the batch-invariant reference means the same
    from turnout.ops.reference import batch_invariant

    torch.testing.assert_close(batch_invariant.paged_attention(*args, **kw), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("variant", ["window", "cap", "sinks"])
def test_each_variant_changes_the_output(variant):
    """Inputs where each variant must matter: W against W + 1, the cap against none, the sinks against none."""
    args, _ = _paged([1, 5, 1], [30, 5, 12], 4, 2, 16, 8, seed=3)
    if variant == "window":
        a = ref_attn.paged_attention(*args, sliding_window=4)
        b = ref_attn.paged_attention(*args, sliding_window=5)
    elif variant == "cap":
        a = ref_attn.paged_attention(*args, logit_softcap=1.0)
        b = ref_attn.paged_attention(*args)
    else:
        a = ref_attn.paged_attention(*args, sinks=torch.full((4,), 1.5))
        b = ref_attn.paged_attention(*args)
    assert (a - b).abs().max() > 1e-2


def _mutated(reference, mutation, *args, **kwargs):
    """The reference with one variant argument mutated: the window off by one, the cap or the sinks dropped."""
    kwargs = dict(kwargs)
    if mutation == "window":
        kwargs["sliding_window"] += 1
    elif mutation == "cap":
        del kwargs["logit_softcap"]
    else:
        del kwargs["sinks"]
    return reference(*args, **kwargs)


@pytest.mark.parametrize("op", ["paged_attention", "rotary_paged_attention"])
@pytest.mark.parametrize("mutation", ["window", "cap", "sinks"])
def test_conformance_catches_each_mutated_variant(op, mutation):
    """Every conformance case with the variant, run through a deliberately mutated implementation, fails the
    suite's comparison: the cases can tell a kernel that ignores (or is off by one in) a variant."""
    spec = default_registry().ops[op]
    key = {"window": "sliding_window", "cap": "logit_softcap", "sinks": "sinks"}[mutation]
    fn = functools.partial(_mutated, spec.reference, mutation)
    ran = 0
    for dtype, case in iter_cases(spec, "cpu"):
        if dtype != "float32" or key not in case.kwargs:
            continue
        ok, _, msg = run_case(spec, fn, case, dtype)
        assert not ok, f"{op} case {case.label}: a {mutation} mutation passed the comparison"
        ran += 1
    assert ran, f"{op} has no conformance case with {key}"


def test_conformance_cases_cover_each_path():
    """The variant cases include decode, prefill, chunked prefill (new tokens over a prefix), and head dims that
    are not powers of two, for each variant."""
    spec = default_registry().ops["paged_attention"]
    seen = set()
    for dtype, case in iter_cases(spec, "cpu"):
        if dtype != "float32":
            continue
        qsl, lens = case.args[5].tolist(), case.args[4].tolist()
        qlens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        for key in case.kwargs:
            seen |= {(key, "decode") for q in qlens if q == 1}
            seen |= {(key, "prefill") for q, n in zip(qlens, lens) if 1 < q == n}
            seen |= {(key, "chunked") for q, n in zip(qlens, lens) if 1 < q < n}
        d = case.args[0].shape[-1]
        if d & (d - 1):
            seen.add(("head_dim", d))
    for key in ("sliding_window", "logit_softcap", "sinks"):
        for path in ("decode", "prefill", "chunked"):
            if (key, path) not in seen:
                raise AssertionError(f"no conformance case with {key} at {path}")
    assert {("head_dim", d) for d in (72, 80, 96, 192)} <= seen


def test_bad_variant_values_name_the_argument():
    args, _ = _paged([1], [5], 2, 1, 8, 4)
    for kw, name in (({"sliding_window": 0}, "sliding_window"), ({"sliding_window": 2.5}, "sliding_window"),
                     ({"logit_softcap": -1.0}, "logit_softcap"), ({"sinks": torch.zeros(3)}, "sinks"),
                     ({"sinks": torch.zeros(2, dtype=torch.float16)}, "sinks")):
        with pytest.raises(ValueError, match=name):
            ref_attn.paged_attention(*args, **kw)
