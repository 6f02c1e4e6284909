"""Tile overrides are resolved once, with the op table, and bound into the Triton implementations: a kernel
launched through the table uses the tiles given to the resolution, and changing the environment afterwards
changes nothing (no process global is read at launch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnout import envs
from turnout.ops import Policy, resolve
from turnout.ops.reference.moe import moe_experts as reference_moe
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("cpu")
TRITON_FIRST = Policy.parse("small_m_linear=triton,reference;moe_experts=triton,reference", source="test")


@pytest.fixture(autouse=True)
def _triton_runs_here():
    if not PLATFORM.triton_usable()[0]:
        pytest.skip("Triton does not run here (TRITON_INTERPRET=1 runs the interpreter)")


def test_small_m_tiles_given_to_the_resolution_are_the_kernels(monkeypatch):
    from turnout.ops.triton import linear

    used = []
    real = linear.pick_config
    monkeypatch.setattr(linear, "pick_config", lambda *a: used.append(real(*a)) or used[-1])
    tuning = envs.load({"TURNOUT_SMALL_M_TILES": '{"40,200": [2, 64, 1, 1]}'})
    table = resolve(PLATFORM, TRITON_FIRST, ops=["small_m_linear"], tuning=tuning)
    assert table.resolutions["small_m_linear"].chosen == "triton.default"
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 200, generator=gen), torch.randn(40, 200, generator=gen) * 200 ** -0.5
    torch.testing.assert_close(table.small_m_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    override = linear.SmallMConfig(block_n=2, block_k=64, num_warps=1, num_stages=1)
    assert used == [override]
    # the environment changes after the table was resolved: the table's kernels do not see it
    monkeypatch.setenv("TURNOUT_SMALL_M_TILES", '{"40,200": [8, 128, 4, 2]}')
    envs.reload()
    table.small_m_linear(x, w)
    assert used[-1] == override
    # and a table resolved without overrides launches the built-in tiles, whatever the environment says
    plain = resolve(PLATFORM, TRITON_FIRST, ops=["small_m_linear"], tuning=envs.load({}))
    plain.small_m_linear(x, w)
    assert used[-1] == real(1, 40, 200) != override


def test_moe_decode_config_given_to_the_resolution_is_the_kernels(monkeypatch):
    from turnout.ops.triton import moe, moe_decode_config

    used = []
    real = moe.moe_experts_decode
    monkeypatch.setattr(moe, "moe_experts_decode",
                        lambda *a, config=None: used.append(config) or real(*a, config=config))
    tuning = envs.load({"TURNOUT_MOE_DECODE_CONFIG": '{"block_n1": 16, "block_k1": 16, "one_token": 0}'})
    table = resolve(PLATFORM, TRITON_FIRST, ops=["moe_experts"], tuning=tuning)
    gen = torch.Generator().manual_seed(6)
    hidden, w13 = torch.randn(1, 32, generator=gen), torch.randn(4, 2 * 48, 32, generator=gen) * 0.2
    w2 = torch.randn(4, 32, 48, generator=gen) * 0.2
    weights, ids = torch.tensor([[0.7, 0.3]]), torch.tensor([[2, 0]], dtype=torch.int32)
    want = reference_moe(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(table.moe_experts(hidden, w13, w2, weights, ids), want, atol=1e-4, rtol=1e-4)
    bound = moe_decode_config.decode_config(tuning.moe_decode_config)
    assert used == [bound] and bound.one_token == 0 and bound != moe_decode_config.DEFAULT_CONFIG
    monkeypatch.setenv("TURNOUT_MOE_DECODE_CONFIG", '{"block_n1": 32}')
    envs.reload()
    table.moe_experts(hidden, w13, w2, weights, ids)
    assert used[-1] == bound


def test_a_bad_override_fails_the_resolution_naming_the_variable():
    tuning = envs.load({"TURNOUT_MOE_DECODE_CONFIG": '{"block_n9": 16}'})
    with pytest.raises(ValueError, match="TURNOUT_MOE_DECODE_CONFIG"):
        resolve(PLATFORM, TRITON_FIRST, ops=["moe_experts"], tuning=tuning)
