"""select_experts: each routing rule on hand-checked cases, and against transformers' own routers."""

import math

import pytest
import torch

from turnout.layers.moe.router import RoutingConfig, select_experts
from turnout.ops.reference.routing import stable_topk


def _by_id(weights, ids):
    """Rows sorted by expert id, so that routings that differ only in slot order compare equal."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


# ---- hand-checked rules ------------------------------------------------------------------------

def test_softmax_topk_weights_and_renormalisation():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # softmax = [.1, .2, .3, .4]
    w, ids = select_experts(logits, RoutingConfig(num_experts=4, top_k=2))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.3]]))
    w, ids = select_experts(logits, RoutingConfig(num_experts=4, top_k=2, renormalize=True))
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7]]))


def test_softmax_after_topk_equals_softmax_topk_renormalise():
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    w1, i1 = select_experts(logits, RoutingConfig(num_experts=8, top_k=2, softmax_after_topk=True))
    w2, i2 = select_experts(logits, RoutingConfig(num_experts=8, top_k=2, renormalize=True))
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2)


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(3, 6)
    _, ids = select_experts(logits, RoutingConfig(num_experts=6, top_k=3))
    assert ids.tolist() == [[0, 1, 2]] * 3
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.5, 1.0]])
    _, ids = select_experts(logits, RoutingConfig(num_experts=6, top_k=2, scoring="sigmoid"))
    assert ids.tolist() == [[1, 3]]
    v, i = stable_topk(torch.tensor([[2.0, 5.0, 5.0, 2.0]]), 3)
    assert i.tolist() == [[1, 2, 0]]


def test_correction_bias_chooses_but_never_weights():
    logits = torch.zeros(1, 4)  # sigmoid = 0.5 everywhere
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    w, ids = select_experts(logits, RoutingConfig(num_experts=4, top_k=2, scoring="sigmoid", has_correction_bias=True),
                            e_score_correction_bias=bias)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5]]))


def _grouped(bias: bool, **kw):
    return RoutingConfig(num_experts=8, top_k=2, scoring="sigmoid", n_group=4, topk_group=1,
                         has_correction_bias=bias, **kw)


def test_groups_ranked_by_top2_sum_with_bias_and_by_max_without():
    # group 0 = experts {0,1} has the best single expert; group 1 = {2,3} the best pair.
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.6, 0.1, 0.1, 0.2, 0.1]])
    logits = torch.logit(scores.clamp(1e-6, 1 - 1e-6))
    w, ids = select_experts(logits, _grouped(True), e_score_correction_bias=torch.zeros(8))
    assert sorted(ids[0].tolist()) == [2, 3]  # sum of top-2: 1.2 > 0.9
    w, ids = select_experts(logits, _grouped(False))
    assert sorted(ids[0].tolist()) == [0, 1]  # max: 0.9 > 0.6
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.0]]), atol=1e-5, rtol=0)


def test_dropped_groups_are_minus_infinity_not_zero():
    # Biased scores of the kept group are negative; a dropped expert masked to 0 would beat them.
    cfg = RoutingConfig(num_experts=4, top_k=2, scoring="sigmoid", n_group=2, topk_group=1, has_correction_bias=True)
    logits = torch.zeros(1, 4)  # 0.5 each
    bias = torch.tensor([-1.0, -1.1, -1.4, -1.5])  # biased: [-.5, -.6, -.9, -1.0]
    w, ids = select_experts(logits, cfg, e_score_correction_bias=bias)
    assert ids.tolist() == [[0, 1]]
    # top_k larger than one group: the second pick must still come from a kept group
    cfg2 = RoutingConfig(num_experts=8, top_k=3, scoring="sigmoid", n_group=4, topk_group=2, has_correction_bias=True)
    bias2 = torch.tensor([-1.0, -1.0, -1.2, -1.2, -3.0, -3.0, -3.0, -3.0])
    _, ids2 = select_experts(torch.zeros(1, 8), cfg2, e_score_correction_bias=bias2)
    assert set(ids2[0].tolist()) <= {0, 1, 2, 3}


def test_scaling_factor_then_per_expert_scale():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    scale = torch.tensor([1.0, 10.0, 100.0, 1000.0])
    cfg = RoutingConfig(num_experts=4, top_k=2, renormalize=True, routed_scaling_factor=2.5, has_per_expert_scale=True)
    w, ids = select_experts(logits, cfg, per_expert_scale=scale)
    assert ids.tolist() == [[3, 2]]  # the scale does not choose
    torch.testing.assert_close(w, torch.tensor([[4 / 7 * 2.5 * 1000.0, 3 / 7 * 2.5 * 100.0]]))


def test_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        RoutingConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="divisible"):
        RoutingConfig(num_experts=6, top_k=2, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="kept groups"):
        RoutingConfig(num_experts=8, top_k=3, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="scoring"):
        RoutingConfig(num_experts=4, top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="no MoE routing rules"):
        RoutingConfig.from_hf_config(type("C", (), {"model_type": "llama"})())


# ---- against transformers' routers ----------------------------------------------------------------

def _hf_cases():
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    common = dict(hidden_size=32, num_experts_per_tok=4)
    yield "qwen3_moe", Qwen3MoeConfig(num_experts=16, norm_topk_prob=True, **common), Qwen3MoeTopKRouter
    yield "qwen3_moe_no_norm", Qwen3MoeConfig(num_experts=16, norm_topk_prob=False, **common), Qwen3MoeTopKRouter
    yield "qwen2_moe", Qwen2MoeConfig(num_experts=12, norm_topk_prob=False, **common), Qwen2MoeTopKRouter
    yield "mixtral", MixtralConfig(num_local_experts=8, **{**common, "num_experts_per_tok": 2}), MixtralTopKRouter
    yield "glm4_moe", Glm4MoeConfig(n_routed_experts=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    norm_topk_prob=True, **common), Glm4MoeTopkRouter
    yield "glm4_moe_one_group", Glm4MoeConfig(n_routed_experts=16, n_group=1, topk_group=1, routed_scaling_factor=1.8,
                                              norm_topk_prob=False, **common), Glm4MoeTopkRouter
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    except ImportError:  # an optional comparison: a renamed upstream class must not break the suite
        return
    yield "deepseek_v3", DeepseekV3Config(n_routed_experts=32, n_group=8, topk_group=3, routed_scaling_factor=2.5,
                                          **{**common, "num_experts_per_tok": 6}), DeepseekV3TopkRouter


@pytest.mark.parametrize("case", list(_hf_cases()), ids=lambda c: c[0])
def test_matches_transformers_router(case):
    name, config, router_cls = case
    gen = torch.Generator().manual_seed(1)
    router = router_cls(config).float()
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:  # a bias big enough to change which experts win
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    x = torch.randn(64, config.hidden_size, generator=gen)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
    cfg = RoutingConfig.from_hf_config(config)
    assert cfg.top_k == config.num_experts_per_tok
    w, ids = select_experts(logits, cfg, e_score_correction_bias=bias)
    hw, hi = _by_id(hf_w.float(), hf_ids)
    ow, oi = _by_id(w, ids)
    assert torch.equal(oi, hi), f"{name}: different experts chosen"
    torch.testing.assert_close(ow, hw, atol=1e-6, rtol=1e-5)


def test_routing_config_per_family():
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig

    q = RoutingConfig.from_hf_config(Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True))
    assert (q.num_experts, q.top_k, q.scoring, q.renormalize, q.grouped) == (128, 8, "softmax", True, False)
    m = RoutingConfig.from_hf_config(MixtralConfig())
    assert m.softmax_after_topk and m.top_k == 2 and m.num_experts == 8
    g = RoutingConfig.from_hf_config(Glm4MoeConfig(n_routed_experts=160, n_group=1, topk_group=1,
                                                   routed_scaling_factor=2.5, num_experts_per_tok=8))
    assert (g.scoring, g.has_correction_bias, g.routed_scaling_factor, g.renormalize) == ("sigmoid", True, 2.5, True)
    assert math.isclose(g.routed_scaling_factor, 2.5)
