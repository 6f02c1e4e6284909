"""The Attention layer's variants: its signature, what it passes to the ops, and its sink parameter's loading
(sliced by head under tensor parallelism)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from turnout.distributed.parallel_state import TPGroup
from turnout.layers.attention import Attention, AttentionMetadata
from turnout.ops.reference import cache as ref_cache
from turnout.ops.reference import attention as ref_attn


class _Ops:
    """The two ops the layer calls, as the reference defines them, recording the keywords it passes."""

    def __init__(self):
        self.calls = []

    def reshape_and_cache(self, *args, **kw):
        ref_cache.reshape_and_cache(*args, **kw)

    def paged_attention(self, *args, **kw):
        self.calls.append(kw)
        return ref_attn.paged_attention(*args, **kw)


def test_signature_is_the_contract():
    params = inspect.signature(Attention).parameters
    assert list(params)[:5] == ["num_heads", "num_kv_heads", "head_dim", "scale", "ops"]
    for name, default in (("sliding_window", None), ("logit_softcap", None), ("sinks", False)):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is default


def test_layer_passes_its_variant_and_equals_the_op():
    torch.manual_seed(0)
    ops = _Ops()
    hq, hk, d, bs, n = 4, 2, 16, 4, 11
    attn = Attention(hq, hk, d, d ** -0.5, ops, sliding_window=5, logit_softcap=3.0, sinks=True)
    attn.sinks.data.copy_(torch.randn(hq))
    k_cache, v_cache = torch.zeros(4, bs, hk, d), torch.zeros(4, bs, hk, d)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hk, d), torch.randn(n, hk, d)
    meta = AttentionMetadata(torch.arange(n), torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n, n)
    out = attn(q, k, v, (k_cache, v_cache), meta)
    assert set(ops.calls[-1]) == {"sliding_window", "logit_softcap", "sinks"}
    want = ref_attn.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, n, n,
                                    d ** -0.5, sliding_window=5, logit_softcap=3.0, sinks=attn.sinks)
    torch.testing.assert_close(out, want)
    plain = Attention(hq, hk, d, d ** -0.5, ops)
    plain(q, k, v, (k_cache, v_cache), meta)
    assert ops.calls[-1] == {}  # no variant: the plain call, which every implementation takes
    assert "sinks" not in dict(plain.named_parameters())


def test_sinks_load_this_ranks_heads():
    total = torch.arange(8, dtype=torch.bfloat16)
    whole = Attention(8, 2, 16, 0.25, None, sinks=True)
    whole.sinks.weight_loader(whole.sinks, total)
    assert whole.sinks.dtype == torch.float32 and whole.sinks.tolist() == list(range(8))
    for rank in range(2):
        tp = TPGroup(rank=rank, size=2, group=object())
        attn = Attention(4, 1, 16, 0.25, None, sinks=True, tp=tp)
        attn.sinks.weight_loader(attn.sinks, total)
        assert attn.sinks.tolist() == list(range(4 * rank, 4 * rank + 4))
    with pytest.raises(ValueError, match="sinks"):
        whole.sinks.weight_loader(whole.sinks, torch.zeros(6))


@pytest.mark.parametrize("kw,name", [({"sliding_window": 0}, "sliding_window"), ({"logit_softcap": 0.0}, "logit_softcap"),
                                     ({"sliding_window": True}, "sliding_window")])
def test_bad_variant_names_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        Attention(4, 2, 16, math.sqrt(1 / 16), None, **kw)
