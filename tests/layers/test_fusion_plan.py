"""The fusion plan (turnout/layers/fusion.py): derived from the op table by what the chosen implementations
declare (Impl.pays), passed to the model constructor, and obeyed by each layer as built.

A GPU's op table is built here on a fake GPU platform; its Triton kernels run under the interpreter on CPU
tensors (float32), the rest on the reference. Counting wrappers are put in place of the Triton kernels before
the table resolves them, so a test sees which op each layer called.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

from turnout.layers.attention import AttentionMetadata
from turnout.layers.embedding import LMHead
from turnout.layers.fusion import NO_FUSIONS, FusionPlan, plan_fusions
from turnout.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from turnout.layers.moe.layer import Router
from turnout.layers.moe.router import RoutingConfig
from turnout.models.registry import get_model_class
from turnout.ops import Impl, Policy, build_registry, resolve
from turnout.ops.reference import linear as ref_linear
from turnout.platforms import Platform
from turnout.platforms.detect import detect_platform

FAKE_GPU = Platform(name="cuda", device_type="cuda", dist_backend="nccl", vendor="cuda", triton_backend=True)
FUSED_OPS = ("small_m_linear", "add_rms_norm_linear", "rotary_paged_attention")
needs_triton = pytest.mark.skipif(not detect_platform("cpu").triton_usable()[0], reason="Triton does not run here")


def gpu_table(*triton_ops, registry=None):
    """The table a GPU resolves with Triton for ``triton_ops`` (the reference for every other op)."""
    text = ";".join(["prefer=reference", *(f"{op}=triton.default" for op in triton_ops)])
    return resolve(FAKE_GPU, Policy.parse(text), registry or build_registry(plugins=False))


@pytest.fixture
def counted(monkeypatch):
    """Counting wrappers around the three fused Triton kernels: op name -> list of calls (first args' shapes)."""
    from turnout.ops.triton import attention, linear

    calls = {op: [] for op in FUSED_OPS}
    for module, op in ((linear, "small_m_linear"), (linear, "add_rms_norm_linear"),
                       (attention, "rotary_paged_attention")):
        real = getattr(module, op)
        monkeypatch.setattr(module, op, lambda *a, _real=real, _op=op, **kw: calls[_op].append(a) or _real(*a, **kw))
    return calls


# ---- deriving the plan -------------------------------------------------------------------------------
def test_no_fusions_on_the_host():
    assert plan_fusions(resolve(detect_platform("cpu"))) == NO_FUSIONS


def test_a_gpu_table_with_the_triton_kernels_fuses_all_three():
    from turnout.ops.triton.linear import norm_fusion_pays

    plan = plan_fusions(gpu_table(*FUSED_OPS), rope_attention=True)
    assert plan.one_row_linear and plan.prenorm_linear and plan.rope_attention
    assert plan.prenorm_pays is norm_fusion_pays  # the Triton implementation's declared predicate
    assert plan.fuses_prenorm(5120, 2048) and not plan.fuses_prenorm(24576, 4096)  # measured on the H200
    assert plan_fusions(gpu_table(*FUSED_OPS), rope_attention=False).rope_attention is False


def test_rope_attention_follows_the_environment_by_default(monkeypatch):
    from turnout import envs

    monkeypatch.setenv("TURNOUT_ROPE_ATTENTION", "0")
    envs.reload()
    assert not plan_fusions(gpu_table(*FUSED_OPS)).rope_attention
    monkeypatch.setenv("TURNOUT_ROPE_ATTENTION", "1")
    envs.reload()
    assert plan_fusions(gpu_table(*FUSED_OPS)).rope_attention


def test_reference_choices_fuse_nothing_and_the_prenorm_needs_the_one_row_kernel():
    assert plan_fusions(gpu_table(), rope_attention=True) == NO_FUSIONS
    plan = plan_fusions(gpu_table("add_rms_norm_linear", "rotary_paged_attention"), rope_attention=True)
    assert plan == FusionPlan(rope_attention=True)  # add_rms_norm_linear is the one-row projection's kernel
    with pytest.raises(ValueError, match="prenorm_linear needs one_row_linear"):
        FusionPlan(prenorm_linear=True)


def _registry_with_vendor(pays):
    reg = build_registry(plugins=False)
    reg.add_impl(Impl(op="small_m_linear", id="vendor.fakegpu", target=ref_linear.small_m_linear, platforms=("cuda",),
                      priority=5, pays=pays))
    return reg


def test_the_claim_is_the_implementations_own():
    """A vendor implementation is chosen first on a GPU; whether the one-row path uses it is what it declares."""
    policy = Policy.parse("prefer=vendor,reference")
    for pays, fused in ((None, False), (False, False), (True, True), (lambda *shape: True, True),
                        ("turnout.ops.triton.linear:norm_fusion_pays", True)):
        table = resolve(FAKE_GPU, policy, _registry_with_vendor(pays))
        assert table.chosen("small_m_linear") == "vendor.fakegpu"
        assert plan_fusions(table).one_row_linear is fused, pays


def test_a_claim_that_does_not_resolve_costs_the_fusion_not_the_start(caplog):
    table = resolve(FAKE_GPU, Policy.parse("prefer=vendor,reference"), _registry_with_vendor("no.such.module:pays"))
    assert plan_fusions(table) == NO_FUSIONS
    assert "vendor.fakegpu" in caplog.text and "no.such.module" in caplog.text
    with pytest.raises(ValueError, match="pays"):
        Impl(op="small_m_linear", id="vendor.bad", target=ref_linear.small_m_linear, pays="no_colon")


# ---- layers obey the plan they were built with --------------------------------------------------------
@needs_triton
def test_one_row_projections_go_through_the_op_and_more_rows_through_f_linear(counted):
    ops = gpu_table("small_m_linear")
    plan = plan_fusions(ops)
    assert plan == FusionPlan(one_row_linear=True)
    torch.manual_seed(0)
    qkv = QKVParallelLinear(16, 4, 2, 1, bias=True, ops=ops, plan=plan)
    row = RowParallelLinear(8, 16, bias=True, ops=ops, plan=plan)
    head = LMHead(32, 16, ops=ops, plan=plan)
    router = Router(16, RoutingConfig(num_experts=4, top_k=2), ops=ops, plan=plan)
    plain = [QKVParallelLinear(16, 4, 2, 1, bias=True), RowParallelLinear(8, 16, bias=True), LMHead(32, 16),
             Router(16, RoutingConfig(num_experts=4, top_k=2), ops=ops)]
    for fused, unfused in zip((qkv, row, head, router), plain):
        for p, q in zip(fused.parameters(), unfused.parameters()):
            p.data.normal_()
            q.data.copy_(p.data)
    x16, x8 = torch.randn(1, 16), torch.ones(1, 8)
    got = [qkv(x16), row(x8), head(x16), *router(x16)]
    want = [plain[0](x16), plain[1](x8), plain[2](x16), *plain[3](x16)]
    calls = counted["small_m_linear"]
    assert [(a[0].shape[0], a[2] is not None) for a in calls] == [(1, True), (1, True), (1, False), (1, False)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv(torch.ones(3, 16)), F.linear(torch.ones(3, 16), qkv.weight, qkv.bias))
    assert len(calls) == 4  # three rows: F.linear


def test_projections_decide_at_construction_whether_they_take_the_norm():
    ops = gpu_table("small_m_linear", "add_rms_norm_linear")
    plan = FusionPlan(one_row_linear=True, prenorm_linear=True, prenorm_pays=lambda n, k: n <= 48)
    small, wide = MergedColumnParallelLinear(16, [24, 24], ops=ops, plan=plan), MergedColumnParallelLinear(
        16, [32, 32], ops=ops, plan=plan)
    assert small.takes_norm and not wide.takes_norm
    fp32_router = Router(16, RoutingConfig(num_experts=4, top_k=2), logits_fp32=True, ops=ops, plan=plan)
    assert not fp32_router.takes_norm  # a float32 gate projects the normed row in float32
    assert Router(16, RoutingConfig(num_experts=4, top_k=2), ops=ops, plan=plan).takes_norm
    assert not MergedColumnParallelLinear(16, [24, 24]).takes_norm  # no plan: nothing fused
    with pytest.raises(ValueError, match="op table"):
        RowParallelLinear(8, 16, bias=False, plan=plan)


# ---- a whole model -----------------------------------------------------------------------------------
def _qwen3():
    return transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _meta(num_new, num_cached):
    total = num_new + num_cached
    return AttentionMetadata(slot_mapping=torch.arange(num_cached, total), block_tables=torch.arange(4,
                             dtype=torch.int32)[None], seq_lens=torch.tensor([total], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, num_new], dtype=torch.int32), max_query_len=num_new,
                             max_seq_len=total)


def _prefill_then_decode(model, config):
    kv = [(torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)) for _ in range(config.num_hidden_layers)]
    ids = torch.randint(0, config.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h1 = model(ids[:-1], torch.arange(6), kv, _meta(6, 0))
        h2 = model(ids[-1:], torch.tensor([6]), kv, _meta(1, 6))
        return torch.cat([model.compute_logits(h1), model.compute_logits(h2)])


@needs_triton
def test_a_model_built_with_the_gpu_plan_routes_decode_through_the_fused_ops(counted):
    """Qwen3 (q/k norm) built with a GPU's plan: at the one-token step both pre-norms of each layer run inside
    their projection, q/k norm + RoPE + cache write inside attention, every projection through the one-row
    kernel; the prefill takes none of them; logits equal the same weights built without a plan."""
    config = _qwen3()
    config.architectures = ["Qwen3ForCausalLM"]
    ops = gpu_table(*FUSED_OPS)
    plan = plan_fusions(ops, rope_attention=True)
    cls = get_model_class(config.architectures)
    torch.manual_seed(0)
    fused = cls(config, ops, plan).eval()
    plain = cls(config, ops).eval()
    assert fused.plan is plan and plain.plan is NO_FUSIONS
    gen = torch.Generator().manual_seed(1)
    for p in fused.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5) + (
            1.0 if p.dim() == 1 else 0.0))
    plain.load_state_dict(fused.state_dict())
    got = _prefill_then_decode(fused, config)
    layers = config.num_hidden_layers
    assert len(counted["add_rms_norm_linear"]) == 2 * layers  # qkv and gate_up of each layer, one row each
    assert [a[15] for a in counted["rotary_paged_attention"]] == [1] * layers  # max_query_len: decode only
    # one-row projections: o_proj and down_proj of each layer, then the LM head (qkv / gate_up took the norm)
    assert len(counted["small_m_linear"]) == 2 * layers + 1
    for calls in counted.values():
        calls.clear()
    want = _prefill_then_decode(plain, config)
    assert not any(counted.values())  # the plain model calls none of them
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
