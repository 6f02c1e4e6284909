"""Per-expert checkpoint tensors load into the stacked parameters through the declarative weight map."""

import pytest
import torch

from turnout.layers.moe.experts import FusedExperts, expert_weight_rules
from turnout.loader.weight_map import _compile_rules, load_weights, map_weight_name


class _Holder(torch.nn.Module):
    weight_name_rules = expert_weight_rules()

    def __init__(self, e=3, h=8, i=4):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = FusedExperts(e, h, i, ops=None)


def _per_expert(e=3, h=8, i=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for x in range(e):
        out[f"mlp.experts.{x}.gate_proj.weight"] = torch.randn(i, h, generator=gen)
        out[f"mlp.experts.{x}.up_proj.weight"] = torch.randn(i, h, generator=gen)
        out[f"mlp.experts.{x}.down_proj.weight"] = torch.randn(h, i, generator=gen)
    return out


def test_per_expert_tensors_fill_the_stack():
    m, ckpt = _Holder(), _per_expert()
    load_weights(m, ckpt.items())
    ex = m.mlp.experts
    for x in range(3):
        assert torch.equal(ex.gate_up_proj[x, :4], ckpt[f"mlp.experts.{x}.gate_proj.weight"])
        assert torch.equal(ex.gate_up_proj[x, 4:], ckpt[f"mlp.experts.{x}.up_proj.weight"])
        assert torch.equal(ex.down_proj[x], ckpt[f"mlp.experts.{x}.down_proj.weight"])


def test_mapping_and_direct_loader_call():
    rules = _compile_rules(_Holder())
    assert map_weight_name("model.layers.5.mlp.experts.17.up_proj.weight", rules) == \
        ("model.layers.5.mlp.experts.gate_up_proj", (17, "up"))
    ex = FusedExperts(2, 8, 4, ops=None)
    t = torch.randn(4, 8)
    ex.weight_loader(ex.gate_up_proj, t, 1, "up")  # the documented 4-argument form
    assert torch.equal(ex.gate_up_proj[1, 4:], t)


def test_stacked_checkpoint_loads_whole():
    m = _Holder()
    gu, down = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    load_weights(m, [("mlp.experts.gate_up_proj", gu), ("mlp.experts.down_proj", down)])
    assert torch.equal(m.mlp.experts.gate_up_proj, gu) and torch.equal(m.mlp.experts.down_proj, down)


def test_missing_expert_and_bad_shape_are_named():
    ckpt = _per_expert()
    del ckpt["mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensor.*\(2, 'up'\)"):
        load_weights(_Holder(), ckpt.items())
    ckpt = _per_expert()
    ckpt["mlp.experts.1.down_proj.weight"] = torch.randn(4, 8)
    with pytest.raises(ValueError, match="experts.1.down_proj"):
        load_weights(_Holder(), ckpt.items())
