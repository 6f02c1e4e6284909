"""The Triton moe_experts paths, each forced and as chosen: the decode path (no sort, per-expert programs)
and the grouped GEMM under every tile config, against the reference with the same routing."""

import pytest
import torch

from turnout.layers.moe.router import RoutingConfig, select_experts
from turnout.ops.conformance import run_case
from turnout.ops.reference.moe import MOE_EXPERTS
from turnout.ops.reference.moe import moe_experts as reference_moe
from turnout.ops.triton import moe as triton_moe
from turnout.ops.triton.moe_decode import moe_experts_decode
from turnout.ops.triton.moe_decode_config import DecodeConfig, use_decode
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("auto")
DEVICE = PLATFORM.device()
CPU_DTYPES = [torch.float32, torch.float16]  # tl.dot on bf16 is not trustworthy under the interpreter
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 3e-2)}

if not PLATFORM.triton_usable():
    pytest.skip("Triton does not run here", allow_module_level=True)


def _problem(gen, t, h, inter, e, k, dtype, invalid=True):
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5).to(DEVICE, dtype)  # [E, 2I, H]
    w2 = (torch.randn(e, h, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)  # [E, H, I]
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
    if invalid:  # experts of another rank: -1, E, far out of range; never placed, contribute nothing
        bad = torch.rand(t, k, generator=gen) < 0.25
        junk = torch.tensor([-1, e, e + 7, -1000])[torch.randint(0, 4, (t, k), generator=gen)]
        ids = torch.where(bad, junk, ids)
    weights = torch.rand(t, k, generator=gen) * 2 + 0.05
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE, torch.int32)


def _check(got, x, w13, w2, weights, ids, dtype):
    want = reference_moe(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_decode_forced_small_batches(dtype):
    """T = 1..8 with k in 1, 2, 4, 6: fewer pairs than experts (one program per slot, duplicates exit)."""
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 9):
        k = (1, 2, 4, 6)[t % 4]
        problem = _problem(gen, t, 32, 16 if t % 2 else 48, 64, k, dtype)  # I 48: not a tile multiple
        _check(moe_experts_decode(*problem), *problem, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_decode_forced_many_pairs_per_expert(dtype):
    """More pairs than experts (one program per expert), > BLOCK_M pairs on one expert (several row chunks),
    more pairs than one scan of the ids, H and I not multiples of the tiles."""
    gen = torch.Generator().manual_seed(2)
    x, w13, w2, weights, ids = _problem(gen, 37, 48, 40, 4, 4, dtype)  # 148 pairs, ~28 valid per expert
    cfg = DecodeConfig(block_k1=32, block_k2=32, block_k2_many=32)  # H 48, I 40: ragged K tiles
    _check(moe_experts_decode(x, w13, w2, weights, ids, config=cfg), x, w13, w2, weights, ids, dtype)


def test_decode_config_overrides():
    """TURNOUT_MOE_DECODE_CONFIG replaces DecodeConfig fields (in-step tuning; the op table binds the result:
    tests/ops/test_tuning_binding.py); unknown fields and bad JSON are ValueErrors naming the variable."""
    from turnout import envs
    from turnout.ops.triton import moe_decode_config

    def config(text):
        return moe_decode_config.decode_config(envs.load({"TURNOUT_MOE_DECODE_CONFIG": text}).moe_decode_config)

    cfg = config('{"block_n2": 16, "block_k2": 16, "num_stages2": 1}')
    assert (cfg.block_n2, cfg.block_k2, cfg.num_stages2, cfg.block_n1) == (16, 16, 1, moe_decode_config.DEFAULT_CONFIG.block_n1)
    gen = torch.Generator().manual_seed(12)
    problem = _problem(gen, 2, 32, 48, 16, 2, torch.float32)
    _check(moe_experts_decode(*problem, config=cfg), *problem, torch.float32)
    assert config('{"one_token": 0}').one_token == 0
    for bad in ('{"block_n3": 16}', "not json", "[16]", '{"block_n2": "64"}', '{"block_k1": 0}', '{"one_token": 2}',
                '{"one_token": true}', '{"one_token_gate_up": 1}'):
        with pytest.raises(ValueError, match="TURNOUT_MOE_DECODE_CONFIG"):  # at start-up, or its names when bound
            config(bad)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_one_token_down_kernel_sums_the_slots(dtype):
    """One token: the down kernel that sums the slots in registers, on ragged tiles (H 40, I 48 against
    tiles of 16 x 32), with duplicate and out-of-range ids, equals the reference and the per-slot kernels."""
    gen = torch.Generator().manual_seed(13)
    x, w13, w2, weights, _ = _problem(gen, 1, 40, 48, 8, 6, dtype)
    for row in ([2, 2, 5, -1, 8, 0], [7, 6, 5, 4, 3, 2], [-1, -1, -1, 9, 8, 100]):
        ids = torch.tensor([row], dtype=torch.int32, device=DEVICE)
        for cfg in (DecodeConfig(one_token=1, block_n_one=16, block_k_one=32), DecodeConfig(one_token=1)):
            got = moe_experts_decode(x, w13, w2, weights, ids, config=cfg)
            _check(got, x, w13, w2, weights, ids, dtype)
            two_kernels = moe_experts_decode(x, w13, w2, weights, ids, config=DecodeConfig(one_token=0))
            torch.testing.assert_close(got, two_kernels, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_decode_duplicate_ids_in_a_token_both_count():
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, weights, _ = _problem(gen, 3, 32, 16, 8, 3, torch.float32)
    ids = torch.tensor([[2, 2, 5], [5, -1, 5], [7, 7, 7]], dtype=torch.int32, device=DEVICE)
    _check(moe_experts_decode(x, w13, w2, weights, ids), x, w13, w2, weights, ids, torch.float32)
    ids64 = torch.tensor([[2, 2, 5], [5, 2 ** 32 + 5, 5], [7, 7, 7]], device=DEVICE)  # int64, never narrowed
    _check(moe_experts_decode(x, w13, w2, weights, ids64), x, w13, w2, weights, ids64, torch.float32)


def test_all_ids_invalid_gives_zeros():
    gen = torch.Generator().manual_seed(4)
    x, w13, w2, weights, ids = _problem(gen, 2, 32, 16, 8, 2, torch.float32)
    ids.fill_(-1)
    with torch.no_grad():
        got = moe_experts_decode(x, w13, w2, weights, ids)
    assert torch.equal(got, torch.zeros_like(x))


def test_decode_chosen_from_host_ints(monkeypatch):
    assert use_decode(1, 8, 128) and use_decode(8, 8, 128) and use_decode(64, 8, 128)
    assert not use_decode(512, 8, 128) and not use_decode(4096, 8, 128)
    assert use_decode(16, 8, 8)  # 128 pairs: always decode
    calls = []
    real_decode, real_grouped = triton_moe.moe_experts_decode, triton_moe.moe_experts_grouped
    monkeypatch.setattr(triton_moe, "moe_experts_decode", lambda *a, **kw: calls.append("decode") or real_decode(*a, **kw))
    monkeypatch.setattr(triton_moe, "moe_experts_grouped", lambda *a: calls.append("grouped") or real_grouped(*a))
    gen = torch.Generator().manual_seed(5)
    for t, e, k in ((3, 16, 4), (70, 2, 2)):  # 12 pairs; 140 pairs on 2 experts
        problem = _problem(gen, t, 32, 16, e, k, torch.float32)
        _check(triton_moe.moe_experts(*problem), *problem, torch.float32)
    assert calls == ["decode", "grouped"]


@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_each_path_on_the_op_samples(path, dtype):
    """The conformance cases (poisoned allocations), each path forced: tiny shapes all pick decode."""
    fn = moe_experts_decode if path == "decode" else triton_moe.moe_experts_grouped
    gen = torch.Generator().manual_seed(6)
    name = str(dtype).replace("torch.", "")
    for case in MOE_EXPERTS.sample_inputs(DEVICE, dtype, gen):
        ok, _, msg = run_case(MOE_EXPERTS, fn, case, name)
        assert ok, f"{path} {case.label} {name}: {msg}"


def test_grouped_every_tile_config():
    """Each gemm_config branch (BLOCK_M 16 .. 128) on a ragged problem, forced."""
    gen = torch.Generator().manual_seed(7)
    x, w13, w2, weights, ids = _problem(gen, 24, 48, 40, 4, 2, torch.float32)
    for pairs in (16, 128, 256, 1024):
        cfg = triton_moe.gemm_config(pairs, 4)
        got = triton_moe.moe_experts_grouped(x, w13, w2, weights, ids, config=cfg)
        _check(got, x, w13, w2, weights, ids, torch.float32)
    assert [triton_moe.gemm_config(p, 128).block_m for p in (64, 4096, 12288, 32768)] == [16, 32, 64, 128]


# ---- GPU: Qwen3-30B-A3B expert shapes ------------------------------------------------------------

_H, _I, _E, _K = 2048, 768, 128, 8


@pytest.fixture(scope="module")
def qwen3_experts():
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(_E, 2 * _I, _H, generator=gen) * _H ** -0.5).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(_E, _H, _I, generator=gen) * _I ** -0.5).to(DEVICE, torch.bfloat16)
    return w13, w2


def _qwen3_routing(t, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, _H, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = select_experts(torch.randn(t, _E, generator=gen).to(DEVICE),
                                  RoutingConfig(num_experts=_E, top_k=_K, renormalize=True))
    return x, weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "decode", "grouped"])
@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_gpu_bf16_qwen3_shapes(qwen3_experts, t, path):
    w13, w2 = qwen3_experts
    x, weights, ids = _qwen3_routing(t, t)
    ids[0, 0] = -1  # a remote expert
    fn = {"auto": triton_moe.moe_experts, "decode": moe_experts_decode,
          "grouped": triton_moe.moe_experts_grouped}[path]
    got = fn(x, w13, w2, weights, ids).float()
    want = reference_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got, want, atol=6e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_decode_graph_capture_without_host_sync(qwen3_experts, t):
    w13, w2 = qwen3_experts
    assert use_decode(t, _K, _E)
    x, weights, ids = _qwen3_routing(t, 100 + t)
    want = triton_moe.moe_experts(x, w13, w2, weights, ids)  # warm-up (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_moe.moe_experts(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.moe_experts(x, w13, w2, weights, ids)
    x2, w2nd, ids2 = _qwen3_routing(t, 200 + t)  # a different routing replayed through the same graph
    x.copy_(x2)
    weights.copy_(w2nd)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), triton_moe.moe_experts(x2, w13, w2, w2nd, ids2).float(),
                               atol=1e-2, rtol=1e-2)
    assert not torch.allclose(out.float(), want.float(), atol=1e-2)
