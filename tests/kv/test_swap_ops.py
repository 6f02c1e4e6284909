"""The swap ops' fallback chain through the real dispatch layer with fake registries and policies that
deny implementations: a vendor module missing two swap names must disable only those two, and nothing may
hold a None where a callable should be."""

from __future__ import annotations

import pytest
import torch

from turnout.ops import Impl, OpUnavailableError, Policy, build_registry, resolve
from turnout.ops.dispatch import summary_line
from turnout.platforms import detect_platform
from turnout.worker.kv_transfer import choose_strategy

CPU = detect_platform("cpu")


def _fakechip_registry():
    """The built-ins plus a vendor whose module lacks the per-layer swap ops (FastDeploy's Metax case)."""
    reg = build_registry(plugins=False)

    def register(view):
        for op in ("swap_layer_async", "swap_layer"):
            view.add_impl(Impl(op=op, id="vendor.fakechip", platforms=("cpu",),
                               target=f"turnout.ops.reference.swap:{op.replace('swap_layer', 'swap_cache_per_layer')}"))
    reg.run_registration("fakechip", register, source="plugin:fakechip")
    return reg


def test_cpu_default_has_no_use_for_async_copies():
    """No device streams, nothing to overlap: swap_layer_async is not needed on the cpu, said quietly (not
    "skipped", not "unavailable")."""
    table = resolve(CPU, Policy.from_sources(platform=CPU))
    strategy, skipped = choose_strategy(table)
    assert strategy == ("sync per layer", "swap_layer")
    assert skipped == []
    assert "no device streams" in table.resolutions["swap_layer_async"].not_needed
    line = summary_line(table)
    assert "1 not needed here" in line and "unavailable" not in line


def test_missing_vendor_names_fall_back_one_by_one():
    reg = _fakechip_registry()
    pol = Policy.parse("swap_layer_async=vendor.fakechip;swap_layer=vendor.fakechip", source="test")
    table = resolve(CPU, pol, registry=reg)
    strategy, skipped = choose_strategy(table)
    assert strategy == ("whole cache", "swap_blocks")  # the rest of the table is intact
    assert dict(skipped).keys() == {"swap_layer"}  # the cpu has no use for async copies, whoever offers them
    assert table.resolutions["swap_layer_async"].not_needed
    assert "no attribute 'swap_cache_per_layer'" in dict(skipped)["swap_layer"]
    for op in ("swap_layer_async", "swap_layer"):
        assert not table.available(op)
        with pytest.raises(OpUnavailableError, match=op):  # never a None standing in for the callable
            getattr(table, op)
    src, dst = torch.randn(4, 2, 3), torch.zeros(4, 2, 3)
    table.swap_blocks(src, dst, torch.tensor([[0, 3], [2, 1]]))
    assert torch.equal(dst[3], src[0]) and torch.equal(dst[1], src[2])


def test_no_swap_op_at_all_leaves_the_engine_table_whole():
    pol = Policy.parse("swap_layer_async=vendor.cuda;swap_layer=vendor.cuda;swap_blocks=vendor", source="test")
    table = resolve(CPU, pol)  # optional ops: no OpUnavailableError for the whole table
    strategy, skipped = choose_strategy(table)
    assert strategy is None and [op for op, _ in skipped] == ["swap_layer", "swap_blocks"]  # async: not needed here
    assert table.available("paged_attention") and callable(table.paged_attention)
    assert "not in the policy's order for swap_blocks" in dict(skipped)["swap_blocks"]


def test_a_required_op_still_fails_resolution():
    with pytest.raises(OpUnavailableError, match="rms_norm"):
        resolve(CPU, Policy.parse("rms_norm=vendor.cuda", source="test"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_triton_swap_kernel_scattered_blocks(dtype):
    """The Triton swap kernel (under the interpreter here: both sides host memory) moves exactly the mapped blocks
    of k and v, fp8 as bytes, and a lone last tensor of an odd list too; nothing else is written."""
    from turnout.ops.triton.swap import swap_layer

    g = torch.Generator().manual_seed(0)
    src = [torch.randn((10, 16, 2, 8), generator=g).to(dtype) for _ in range(3)]
    dst = [torch.zeros((7, 16, 2, 8), dtype=dtype) for _ in range(3)]
    mapping = torch.tensor([[3, 0], [9, 6], [0, 2]])
    swap_layer(src, dst, mapping)
    for s, d in zip(src, dst):
        for a, b in mapping.tolist():
            assert torch.equal(d[b].view(torch.uint8), s[a].view(torch.uint8))
        for untouched in (1, 3, 4, 5):
            assert not d[untouched].view(torch.uint8).any()
