"""The Triton moe_experts_fp8 paths, each forced (the conformance suite runs the default path on the op's samples):
the decode kernels by slot and by expert, every tile config of the grouped GEMM, the one-token down kernel over
several K tiles, ids of experts held elsewhere; and the ``kernel`` choice through the policy. Compared with the op's
own bound (turnout/ops/reference/moe_fp8.py: accumulation and activation rounding flips). Under the interpreter the
kernels have no bfloat16 dot (fp8 x fp8 only), so bfloat16 activations are checked here too."""

import pytest
import torch

from turnout import envs
from turnout.ops import Policy, build_registry, resolve
from turnout.ops.conformance import run_case
from turnout.ops.reference.moe_fp8 import MOE_EXPERTS_FP8, make_experts
from turnout.ops.spec import SampleCase
from turnout.ops.triton import moe_fp8
from turnout.ops.triton.moe_fp8_decode import Fp8DecodeConfig, moe_experts_fp8_decode
from turnout.platforms import Platform
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("auto")
DEVICE = PLATFORM.device()
DTYPES = ["float32", "bfloat16"]

if not PLATFORM.triton_usable()[0]:
    pytest.skip("Triton does not run here", allow_module_level=True)


def _problem(gen, t, h, inter, e, k, dtype, invalid=True):
    x = (torch.randn(t, h, generator=gen) * 2).to(DEVICE, getattr(torch, dtype))
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
    if invalid:  # experts of another rank: -1, E, far out of range; never placed, contribute nothing
        bad = torch.rand(t, k, generator=gen) < 0.25
        ids = torch.where(bad, torch.tensor([-1, e, e + 7, -1000])[torch.randint(0, 4, (t, k), generator=gen)], ids)
    weights = torch.rand(t, k, generator=gen) * 2 + 0.05
    return (x, *make_experts(e, h, inter, gen, DEVICE), weights.to(DEVICE), ids.to(DEVICE, torch.int32))


def _check(fn, problem, dtype):
    ok, err, msg = run_case(MOE_EXPERTS_FP8, fn, SampleCase("forced", problem), dtype)
    assert ok, msg


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_forced_by_slot_and_by_expert(dtype):
    """Fewer pairs than experts (a program per slot, duplicates exit), then more (a program per expert, several
    BLOCK_M chunks on one expert); H and I off the 128 grid; the per-slot down kernel and the slot sum."""
    gen = torch.Generator().manual_seed(1)
    _check(lambda *a: moe_experts_fp8_decode(*a, one_token=False), _problem(gen, 3, 200, 144, 16, 4, dtype), dtype)
    _check(lambda *a: moe_experts_fp8_decode(*a, one_token=False), _problem(gen, 21, 256, 128, 2, 2, dtype), dtype)


@pytest.mark.parametrize("config", sorted({moe_fp8.gemm_config(n, 8) for n in (64, 256, 640, 2048)}))
def test_grouped_every_tile_config(config):
    """The grouped GEMM with each tile config it chooses on the H200 (BLOCK_M 16 to 128), three activation groups."""
    gen = torch.Generator().manual_seed(2)
    problem = _problem(gen, 37, 256, 384, 4, 2, "float32")
    _check(lambda *a: moe_fp8.moe_experts_fp8_grouped(*a, config=config), problem, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,cfg", [(384, Fp8DecodeConfig(block_k_one=128, block_k_one_up=128)),
                                       (144, Fp8DecodeConfig(block_n_one_up=16, block_n_one=2)),
                                       (384, Fp8DecodeConfig())])
def test_one_token_kernels_over_several_k_tiles(dtype, inter, cfg):
    """One token on the CUDA cores: gate/up streaming H (200, off the grid) in one or two K tiles, the activations
    quantised per group in the down kernel, I over one or three K tiles or off the grid, a slot of another rank."""
    gen = torch.Generator().manual_seed(3)
    x, w13, w13s, w2, w2s, weights, ids = _problem(gen, 1, 200, inter, 8, 4, dtype, invalid=False)
    ids[0, 2] = -1
    _check(lambda *a: moe_experts_fp8_decode(*a, config=cfg), (x, w13, w13s, w2, w2s, weights, ids), dtype)


def test_non_contiguous_hidden_and_bad_arguments():
    gen = torch.Generator().manual_seed(4)
    x, *rest = _problem(gen, 6, 256, 128, 4, 2, "float32")
    wide = torch.zeros(6, 512, device=DEVICE)
    wide[:, ::2] = x  # a strided view: rows of stride 512, elements of stride 2
    _check(moe_fp8.moe_experts_fp8, (wide[:, ::2], *rest), "float32")
    w13, w13s, w2, w2s, weights, ids = rest
    with pytest.raises(ValueError, match="w13_scale"):
        moe_fp8.moe_experts_fp8(x, w13, w13s[:, :1], w2, w2s, weights, ids)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_fp8.moe_experts_fp8(x, w13.float(), w13s, w2, w2s, weights, ids)
    with pytest.raises(ValueError, match="kernel must be"):
        moe_fp8.moe_experts_fp8(x, *rest, kernel="fast")


@pytest.mark.skipif(not envs.get().triton_interpret, reason="a GPU platform's table on CPU tensors (interpreter)")
@pytest.mark.parametrize("kernel,t,want", [("auto", 1, "decode"), ("auto", 70, "grouped"), ("grouped", 1, "grouped"),
                                           ("decode", 70, "decode")])
def test_kernel_choice_runs_that_path(monkeypatch, kernel, t, want):
    calls = []
    real_grouped, real_decode = moe_fp8.moe_experts_fp8_grouped, moe_fp8.moe_experts_fp8_decode
    monkeypatch.setattr(moe_fp8, "moe_experts_fp8_grouped", lambda *a, **kw: calls.append(("grouped", kw))
                        or real_grouped(*a, **kw))
    monkeypatch.setattr(moe_fp8, "moe_experts_fp8_decode", lambda *a, **kw: calls.append(("decode", kw))
                        or real_decode(*a, **kw))
    gpu = Platform(name="cuda", device_type="cpu", dist_backend="gloo", triton_backend=True)
    registry = build_registry(plugins=False)
    policy = Policy.parse(f"moe_experts_fp8.kernel={kernel}", source="TURNOUT_OPS")
    policy.validate(registry)
    table = resolve(gpu, policy, registry, ops=["moe_experts_fp8"])
    assert table.chosen("moe_experts_fp8") == "triton.default"
    gen = torch.Generator().manual_seed(5)
    problem = _problem(gen, t, 128, 128, 4, 2, "float32", invalid=False)  # 140 pairs at T 70: past decode sizes
    _check(table.moe_experts_fp8, problem, "float32")
    assert [c[0] for c in calls] == [want]
    assert calls[0][1] == ({"one_token": False} if kernel == "decode" else {})
