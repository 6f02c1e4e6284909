"""Every available ``moe_experts`` implementation equals the reference, given the same routing.

A backend that recomputed top-k would throw away the learnable per-expert scale. So each backend is
fed routings that a recomputation would change (ids that are not the top-k of the scores, weights scaled
per expert) and must reproduce the reference computed with exactly those ids and weights.
"""

import pytest
import torch

from turnout.layers.moe.layer import SparseMoeBlock
from turnout.layers.moe.router import RoutingConfig, select_experts
from turnout.ops import Policy, build_registry, resolve
from turnout.ops.reference.moe import moe_experts as reference_moe
from turnout.ops.resolution import resolve_op
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("auto")
DEVICE = PLATFORM.device()
REGISTRY = build_registry(plugins=False)
CPU_DTYPES = [torch.float32, torch.float16]  # tl.dot on bf16 is not trustworthy under the interpreter
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 3e-2)}


def available_impls():
    res = resolve_op("moe_experts", REGISTRY, PLATFORM, Policy())
    return [(c.impl, c.fn) for c in res.candidates if c.available]


IMPLS = available_impls()
IMPL_IDS = [i for i, _ in IMPLS]


def test_triton_backend_is_enumerated():
    assert "reference.torch" in IMPL_IDS
    assert "triton.default" in IMPL_IDS, f"moe_experts candidates: {resolve_op('moe_experts', REGISTRY, PLATFORM, Policy()).to_dict()}"


def _weights(gen, e, h, i, dtype):
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(DEVICE, dtype)  # [E, 2I, H]
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(DEVICE, dtype)  # [E, H, I]
    return w13, w2


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("shape", [(5, 48, 32, 16, 8, 2), (19, 64, 16, 32, 16, 4)], ids=["T5", "T19"])
def test_latent_routing_with_per_expert_scale(impl, dtype, shape):
    """Full-size gate, per-expert scale, experts in the latent space, projected back."""
    t, h, latent, inter, e, k = shape
    fn = dict(IMPLS)[impl]
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    gate = torch.randn(e, h, generator=gen).to(DEVICE, dtype)
    scale = (torch.rand(e, generator=gen) * 3 + 0.2).to(DEVICE)  # learnable per-expert scale
    fc1 = (torch.randn(latent, h, generator=gen) * h ** -0.5).to(DEVICE, dtype)
    fc2 = (torch.randn(h, latent, generator=gen) * latent ** -0.5).to(DEVICE, dtype)
    w13, w2 = _weights(gen, e, latent, inter, dtype)
    cfg = RoutingConfig(num_experts=e, top_k=k, renormalize=True, has_per_expert_scale=True)
    weights, ids = select_experts(x @ gate.t(), cfg, per_expert_scale=scale)
    z = x @ fc1.t()  # [T, L]
    got = fn(z, w13, w2, weights, ids) @ fc2.t()
    want = reference_moe(z, w13, w2, weights, ids) @ fc2.t()
    assert got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


def _adversarial_routing(gen, t, e, k):
    """Routing a recomputation would change: ids are the *bottom* k of the raw scores and each expert's
    weight is scaled so that neither the scores nor the weights' order tell which ids were given."""
    logits = torch.randn(t, e, generator=gen)
    scores = torch.softmax(logits, dim=-1)
    given_ids = scores.topk(k, dim=-1, largest=False).indices  # never the recomputed top-k
    scale = torch.linspace(0.1, 5.0, e)[torch.randperm(e, generator=gen)]
    given_w = scores.gather(1, given_ids) * scale[given_ids] * 40
    recomputed_ids = scores.topk(k, dim=-1).indices
    recomputed_w = scores.gather(1, recomputed_ids)
    assert not torch.equal(given_ids.sort(-1).values, recomputed_ids.sort(-1).values)
    return (given_w.to(DEVICE), given_ids.to(DEVICE, torch.int32),
            recomputed_w.to(DEVICE), recomputed_ids.to(DEVICE, torch.int32))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPL_IDS)
def test_backend_uses_the_given_routing(impl, dtype):
    fn = dict(IMPLS)[impl]
    gen = torch.Generator().manual_seed(7)
    t, h, inter, e, k = 11, 32, 32, 8, 3
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13, w2 = _weights(gen, e, h, inter, dtype)
    given_w, given_ids, re_w, re_ids = _adversarial_routing(gen, t, e, k)
    want = reference_moe(x, w13, w2, given_w, given_ids).float()
    recomputed = reference_moe(x, w13, w2, re_w, re_ids).float()
    assert (want - recomputed).abs().max() > 0.5  # the test can tell the two routings apart
    got = fn(x, w13, w2, given_w, given_ids).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1],
                               msg=lambda m: f"{impl} did not use the given routing: {m}")
    # slot order is not a promise: permuting the k slots must not change anything
    perm = torch.randperm(k, generator=gen).to(DEVICE)
    got_perm = fn(x, w13, w2, given_w[:, perm].contiguous(), given_ids[:, perm].contiguous()).float()
    torch.testing.assert_close(got_perm, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def _ops_pinned(impl: str):
    return resolve(PLATFORM, Policy.parse(f"moe_experts={impl}"), registry=REGISTRY,
                   ops=["moe_experts", "silu_and_mul", "select_experts"])


def _random_block(gen, dtype, **kw):
    h, inter, e = 48, 32, 8
    cfg = RoutingConfig(num_experts=e, top_k=3, renormalize=True, routed_scaling_factor=1.5, has_per_expert_scale=True)
    block = SparseMoeBlock(h, inter, cfg, _ops_pinned("reference.torch"), **kw).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        block.gate.per_expert_scale.copy_(torch.rand(e, generator=gen) * 3 + 0.2)
    return block.to(dtype)


@pytest.mark.parametrize("impl", IMPL_IDS)
def test_layer_with_latent_shared_expert_and_scale(impl):
    """The MoE layer, through an op table pinned to each backend, against the formula written out."""
    gen = torch.Generator().manual_seed(3)
    block = _random_block(gen, torch.float32, latent_size=24, shared_intermediate_size=40, shared_gated=True,
                          shared_name="shared_expert")
    x = torch.randn(9, 48, generator=gen).to(DEVICE)
    for m in block.modules():  # swap the op table the layer calls through
        if hasattr(m, "ops"):
            m.ops = _ops_pinned(impl)
    got = block(x)
    with torch.no_grad():
        g = block.gate
        w, ids = select_experts(x @ g.weight.t(), block.routing, per_expert_scale=g.per_expert_scale)
        assert not torch.allclose(w, select_experts(x @ g.weight.t(), block.routing)[0])  # the scale matters
        z = x @ block.fc1_latent_proj.weight.t()
        routed = reference_moe(z, block.experts.gate_up_proj, block.experts.down_proj, w, ids)
        routed = routed @ block.fc2_latent_proj.weight.t()
        se = block.shared_expert
        gu = x @ se.gate_up_proj.weight.t()
        shared = (torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]) @ se.down_proj.weight.t()
        want = routed + torch.sigmoid(x @ block.shared_expert_gate.weight.t()) * shared
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_align_block_size_invariants():
    from turnout.ops.triton.moe import align_block_size

    gen = torch.Generator().manual_seed(0)
    e, k, bm = 16, 4, 16
    for t in (1, 3, 50):
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(DEVICE, torch.int32)
        ids[0, 0] = -1  # a remote expert: never placed
        sorted_pairs, block_expert = align_block_size(ids, e, bm)
        n = t * k
        assert sorted_pairs.numel() == block_expert.numel() * bm
        sp, be, flat = sorted_pairs.cpu(), block_expert.cpu(), ids.flatten().cpu()
        real = sp[sp < n]
        assert sorted(real.tolist()) == sorted(i for i in range(n) if flat[i] >= 0)
        for b in range(be.numel()):
            rows = sp[b * bm:(b + 1) * bm]
            rows = rows[rows < n]
            if be[b] < 0:
                assert rows.numel() == 0
            else:
                assert (flat[rows.long()] == be[b]).all()
                assert rows.tolist() == sorted(rows.tolist())  # token order within an expert


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("t", [1, 8, 300])
def test_gpu_bf16_large(impl, t):
    fn = dict(IMPLS)[impl]
    gen = torch.Generator().manual_seed(t)
    h, inter, e, k = 1024, 384, 64, 8
    x = torch.randn(t, h, generator=gen).to(DEVICE, torch.bfloat16)
    w13, w2 = _weights(gen, e, h, inter, torch.bfloat16)
    scale = torch.rand(e, generator=gen).to(DEVICE) * 3 + 0.2
    weights, ids = select_experts(torch.randn(t, e, generator=gen).to(DEVICE),
                                  RoutingConfig(num_experts=e, top_k=k, renormalize=True, has_per_expert_scale=True),
                                  per_expert_scale=scale)
    got = fn(x, w13, w2, weights, ids).float()
    want = reference_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got, want, atol=6e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i for i in IMPL_IDS if not i.startswith("reference.")])
def test_gpu_no_host_sync_and_graph_capture(impl):
    """The experts op must not sync with the host: it is captured in CUDA graphs. The references
    (reference.torch, reference.batch_invariant) are host-synchronous by design: a loop over experts whose
    row counts the host must know (``nonzero``); a model on them fails graph capture once and runs eagerly
    (turnout/worker/cuda_graphs.py), and on a GPU the Triton kernels rank above them in both modes."""
    fn = dict(IMPLS)[impl]
    gen = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 16, 256, 128, 32, 4
    x = torch.randn(t, h, generator=gen).to(DEVICE, torch.bfloat16)
    w13, w2 = _weights(gen, e, h, inter, torch.bfloat16)
    weights, ids = select_experts(torch.randn(t, e, generator=gen).to(DEVICE), RoutingConfig(num_experts=e, top_k=k))
    want = fn(x, w13, w2, weights, ids)  # warm-up (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w13, w2, weights, ids)
    x.copy_(x.flip(0))
    ids.copy_(ids.flip(0))
    weights.copy_(weights.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want.flip(0).float(), atol=2e-2, rtol=2e-2)


# ---- vendor.cuda (torch._grouped_mm): registered by the vendor table once it wins on the GPU ----------

def _grouped_mm_runs_here() -> bool:
    try:
        dt = torch.bfloat16 if PLATFORM.is_gpu else torch.float32  # bf16: the sm90 CUTLASS path
        torch._grouped_mm(torch.zeros(16, 8, device=DEVICE, dtype=dt), torch.zeros(2, 8, 8, device=DEVICE, dtype=dt),
                          offs=torch.tensor([8, 16], dtype=torch.int32, device=DEVICE))
        return True
    except Exception:
        return False


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm") or not _grouped_mm_runs_here(),
                    reason="torch._grouped_mm does not run on this device")
@pytest.mark.parametrize("dtype", CPU_DTYPES + ([torch.bfloat16] if PLATFORM.is_gpu else []), ids=str)
def test_grouped_mm_backend_matches_reference(dtype):
    """Called directly (its probe only accepts sm90+), on the op's own sample inputs."""
    from turnout.ops.conformance import run_case
    from turnout.ops.reference.moe import MOE_EXPERTS
    from turnout.ops.vendors.cuda.moe import moe_experts as grouped

    gen = torch.Generator().manual_seed(0)
    name = str(dtype).replace("torch.", "")
    for case in MOE_EXPERTS.sample_inputs(DEVICE, dtype, gen):
        ok, err, msg = run_case(MOE_EXPERTS, grouped, case, name)
        assert ok, f"{case.label} {name}: {msg}"
    given_w, given_ids, _, _ = _adversarial_routing(gen, 11, 8, 3)
    x = torch.randn(11, 32, generator=gen).to(DEVICE, dtype)
    w13, w2 = _weights(gen, 8, 32, 32, dtype)
    torch.testing.assert_close(grouped(x, w13, w2, given_w, given_ids).float(),
                               reference_moe(x, w13, w2, given_w, given_ids).float(),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_grouped_mm_probe_degrades_with_a_reason(monkeypatch):
    from turnout.ops import Registry
    from turnout.ops.reference.moe import MOE_EXPERTS
    from turnout.ops.spec import ImplUnavailable
    from turnout.ops.vendors.cuda import moe as vendor_moe
    from turnout.ops.vendors.cuda import register as register_cuda

    reg = Registry()
    reg.add_op(MOE_EXPERTS)
    register_cuda(reg)  # the package's registration declares the grouped-GEMM moe_experts
    res = resolve_op("moe_experts", reg, PLATFORM, Policy())
    cand = next(c for c in res.candidates if c.impl == "vendor.cuda")
    if PLATFORM.name != "cuda":
        assert not cand.available and "cuda" in cand.reason
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)  # a torch that renamed it: unavailable, not a crash
    with pytest.raises(ImplUnavailable, match="_grouped_mm"):
        vendor_moe.load()
