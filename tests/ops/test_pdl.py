"""Programmatic dependent launch (turnout/ops/triton/_pdl.py): when it is on, and that a chain of kernels
launched with it inside a CUDA graph computes exactly what the same chain computes without it."""

import pytest
import torch

from turnout import envs
from turnout.ops.triton import _pdl


def test_off_on_cpu_and_when_the_environment_says_so(monkeypatch):
    assert _pdl.pdl_args(torch.zeros(1)) == {"PDL": 0}
    monkeypatch.setenv("TURNOUT_PDL", "0")
    envs.reload()
    assert not _pdl.pdl_enabled(torch.device("cuda", 0))


def test_the_platform_gives_the_engine_the_kernels_answer(monkeypatch):
    """The engine asks its platform (it imports no kernel module); the platform and the kernels share one test."""
    from turnout.platforms import Platform
    from turnout.platforms.detect import detect_platform

    assert not detect_platform("cpu").pdl_enabled()
    fake_gpu = Platform(name="cuda", device_type="cuda", dist_backend="nccl", triton_backend=True)
    monkeypatch.setenv("TURNOUT_PDL", "0")
    envs.reload()
    assert not fake_gpu.pdl_enabled(torch.device("cuda", 0)) and not _pdl.pdl_enabled(torch.device("cuda", 0))
    if torch.cuda.is_available():
        monkeypatch.setenv("TURNOUT_PDL", "1")
        envs.reload()
        device = torch.device("cuda", 0)
        assert detect_platform("auto").pdl_enabled(device) == _pdl.pdl_enabled(device)


def test_early_launch_names(monkeypatch):
    """TURNOUT_PDL_EARLY names the kernels that let their dependent launch before they wait (PDL=2); an unknown
    name is a ValueError naming the variable and the known names."""
    monkeypatch.setenv(_pdl.EARLY_ENV, "attention_merge, linear")
    envs.reload()
    assert _pdl.early_kernels() == {"attention_merge", "linear"}
    monkeypatch.setenv(_pdl.EARLY_ENV, "")
    envs.reload()
    assert _pdl.early_kernels() == frozenset()
    monkeypatch.setenv(_pdl.EARLY_ENV, "attention,o_proj")
    with pytest.raises(ValueError, match="TURNOUT_PDL_EARLY.*o_proj"):  # at start-up (turnout.envs)
        envs.reload()
    monkeypatch.delenv(_pdl.EARLY_ENV)
    envs.reload()
    assert _pdl.early_kernels() == _pdl.EARLY_DEFAULT <= _pdl.KERNEL_NAMES
    with pytest.raises(ValueError, match="o_proj"):  # a launch site naming a kernel the switch cannot name
        _pdl.pdl_args(torch.zeros(1), "o_proj")


def _chain(x, residual, weights, norm_w, steps):
    """What a decode layer chains: add + norm, one-row projection, SiLU-and-mul, projection."""
    from turnout.ops.triton.activation import silu_and_mul
    from turnout.ops.triton.linear import small_m_linear
    from turnout.ops.triton.norm import fused_add_rms_norm

    for i in range(steps):
        fused_add_rms_norm(x, residual, norm_w, 1e-6)
        up = small_m_linear(x, weights[i % len(weights)][0])
        x = small_m_linear(silu_and_mul(up), weights[i % len(weights)][1])
    return x


@pytest.mark.gpu
def test_gpu_pdl_chain_in_a_graph_equals_the_chain_without(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm90+")
    assert _pdl.pdl_enabled(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    h, inter = 2048, 1536
    weights = [((torch.randn(2 * inter, h, generator=g) * h ** -0.5).cuda().bfloat16(),
                (torch.randn(h, inter, generator=g) * inter ** -0.5).cuda().bfloat16()) for _ in range(8)]
    norm_w = (torch.randn(h, generator=g) * 0.1 + 1).cuda().bfloat16()
    x0 = torch.randn(1, h, generator=g).cuda().bfloat16()
    r0 = torch.randn(1, h, generator=g).cuda().bfloat16()
    results = {}
    for mode, early in (("1", ""), ("0", ""), ("1", "linear")):  # early: each projection launches the next early
        monkeypatch.setenv("TURNOUT_PDL", mode)
        monkeypatch.setenv(_pdl.EARLY_ENV, early)
        envs.reload()
        x, r = x0.clone(), r0.clone()
        _chain(x.clone(), r.clone(), weights, norm_w, 2)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, r, weights, norm_w, 40)
        for _ in range(3):  # replays continue from the state the last one left
            graph.replay()
        torch.cuda.synchronize()
        results[mode, early] = (out.clone(), r.clone())
    for key in (("1", ""), ("1", "linear")):
        assert torch.equal(results[key][0], results["0", ""][0]), key
        assert torch.equal(results[key][1], results["0", ""][1]), key
