"""turnout's FlagGems plugin (plugins/turnout-flaggems): every wrapper's argument mapping, where FlagGems
cannot run. The FlagGems functions are replaced by stand-ins with FlagGems' signatures, checks and addressing
whose arithmetic is turnout's reference (flaggems_standins.py); each wrapper runs every sample case of its op
through the conformance suite's own case runner, and must equal the reference. The call shapes a wrapper
declares FlagGems does not serve must reach the ``fallback`` (the next implementation), and every op must have
cases that reach FlagGems, so no mapping is left untested behind a fallback."""

import functools
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from turnout.ops import build_registry
from turnout.ops.conformance import run_case
from turnout.ops.reference._util import DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "turnout-flaggems"))
from turnout_flaggems import OPS  # noqa: E402

from flaggems_standins import StandIns  # noqa: E402

REGISTRY = build_registry(plugins=False)



def _size(label, name):
    return int(re.search(rf"{name}(\d+)", label).group(1))


# op -> predicate over (dtype, case label) of the sample cases FlagGems must not be given (and only those)
DECLINED = {
    "paged_attention": lambda dtype, label: dtype == "float32" or "sinks" in label or "-W" in label,
    "moe_experts": lambda dtype, label: dtype == "float32",
    "select_experts": lambda dtype, label: ("-after" in label or "-scale" in label
                                            or bool(_size(label, "-k") & (_size(label, "-k") - 1))),
    "moe_experts_fp8": lambda dtype, label: "remote_ids" not in label and (_size(label, "H") % 128 or
                                                                         _size(label, "I") % 128),
    "quantize_fp8": lambda dtype, label: "static" in label or ("_g128" in label and _size(label, "K") % 128),
    "scaled_mm": lambda dtype, label: bool(_size(label, "N") % 16 or _size(label, "K") % 16),
}

# the references of these are slow on the CPU (both sides of each case run one): fewer dtypes cover the mapping
# (float32 attention is a declined case, bfloat16 a served one)
ONE_DTYPE = {"moe_experts_fp8": ("bfloat16",), "moe_experts": ("float32", "bfloat16"), "block_scaled_mm": ("float32",),
             "paged_attention": ("float32", "bfloat16")}


def _wrapper(op, gems, declined):
    module, _, delegates, _ = OPS[op]
    fn = getattr(importlib.import_module(f"turnout_flaggems.{module}"), op)
    if not delegates:
        return functools.partial(fn, gems=gems)
    reference = REGISTRY.ops[op].reference

    def fallback(*args, **kwargs):
        declined.append(op)
        return reference(*args, **kwargs)
    return functools.partial(fn, gems=gems, fallback=fallback)


@pytest.mark.parametrize("op", sorted(OPS))
def test_wrapper_maps_flaggems_to_the_reference(op):
    spec = REGISTRY.ops[op]
    gems, declined = StandIns(), []
    fn = _wrapper(op, gems, declined)
    gen = torch.Generator().manual_seed(0)
    served = 0
    for dtype in ONE_DTYPE.get(op, spec.dtypes):
        for case in spec.sample_inputs("cpu", DTYPES[dtype], gen):
            calls, fell = sum(gems.calls.values()), len(declined)
            ok, err, msg = run_case(spec, fn, case, dtype)
            assert ok, f"{op} {dtype} {case.label}: {msg}"
            reached = sum(gems.calls.values()) > calls
            expect_declined = bool(DECLINED.get(op, lambda *_: False)(dtype, case.label))
            assert reached != expect_declined, f"{op} {dtype} {case.label}: FlagGems {'not ' * (not reached)}called"
            assert (len(declined) > fell) == expect_declined, f"{op} {dtype} {case.label}: fallback"
            served += reached
    assert served > 0


def test_fused_add_rms_norm_writes_back_into_strided_views():
    """FlagGems writes into .contiguous() copies of strided arguments: the wrapper copies them back, and the
    columns outside the views stay as they were."""
    gems = StandIns()
    fn = _wrapper("fused_add_rms_norm", gems, [])
    gen = torch.Generator().manual_seed(1)
    xs, rs = torch.randn(5, 80, generator=gen), torch.randn(5, 80, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    x, r = xs[:, 8:72], rs[:, :64]
    want_x, want_r = x.clone(), r.clone()
    REGISTRY.ops["fused_add_rms_norm"].reference(want_x, want_r, w, 1e-6)
    before_x, before_r = xs.clone(), rs.clone()
    fn(x, r, w, 1e-6)
    torch.testing.assert_close(x, want_x)
    torch.testing.assert_close(r, want_r)
    assert torch.equal(xs[:, :8], before_x[:, :8]) and torch.equal(xs[:, 72:], before_x[:, 72:])
    assert torch.equal(rs[:, 64:], before_r[:, 64:])
    assert gems.calls == {"fused_add_rms_norm": 1}


def test_reshape_and_cache_makes_strided_heads_dense_and_leaves_fp8_to_the_next():
    gems, declined = StandIns(), []
    fn = _wrapper("reshape_and_cache", gems, declined)
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(6, 2, 2, 16, generator=gen)  # [T, Hk, k|v, D]: each head's k and v side by side
    key, value = kv[:, :, 0], kv[:, :, 1]
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    slots = torch.tensor([0, 5, -1, 9, 15, 2])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    REGISTRY.ops["reshape_and_cache"].reference(key, value, want_k, want_v, slots)
    fn(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v) and declined == []
    fp8 = torch.float8_e4m3fn
    k8, v8 = torch.zeros(4, 4, 2, 16, dtype=fp8), torch.zeros(4, 4, 2, 16, dtype=fp8)
    scale = torch.tensor([0.05])
    fn(key, value, k8, v8, slots, scale, scale)
    assert declined == ["reshape_and_cache"] and gems.calls == {"reshape_and_cache_flash": 1}


def test_paged_attention_window_maps_to_flashattentions_left_edge(monkeypatch):
    """turnout's window W keeps W keys (p - W < j <= p); FlashAttention's left edge L keeps L + 1: a wrapper
    passing W itself reads one key too many, which the reference with the same W does not. (Windows are declined
    today, SERVE_WINDOWS: FlagGems 5.0.2 wrote NaN there on an H100; the mapping is checked with them served.)"""
    from turnout_flaggems import attention

    monkeypatch.setattr(attention, "SERVE_WINDOWS", True)
    gems = StandIns()
    fn = _wrapper("paged_attention", gems, [])
    gen = torch.Generator().manual_seed(3)
    d, bs = 32, 4
    q = torch.randn(3, 2, d, generator=gen, dtype=torch.bfloat16)
    kc, vc = (torch.randn(6, bs, 1, d, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    args = (q, kc, vc, torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 3, 20, d ** -0.5)
    ref = REGISTRY.ops["paged_attention"].reference
    got = fn(*args, sliding_window=5)
    torch.testing.assert_close(got, ref(*args, sliding_window=5), atol=2e-2, rtol=2e-2)
    assert not torch.allclose(got.float(), ref(*args, sliding_window=6).float(), atol=2e-2, rtol=2e-2)


def test_a_renamed_flaggems_function_disables_only_its_implementation(monkeypatch):
    from turnout_flaggems import library, loaders

    gems = StandIns()
    monkeypatch.setattr(library, "_outcome", {"module": gems})
    assert loaders.rms_norm().keywords["gems"] is gems
    monkeypatch.setattr(StandIns, "topk_softmax", None)
    with pytest.raises(Exception, match="has no topk_softmax"):
        loaders.select_experts()


def test_fp8_experts_decline_flaggems_48_row_tile_on_hopper(monkeypatch):
    """On Hopper FlagGems 5.0.2 picks a 48-row tile for 33-48 routed tokens per expert, which does not compile:
    such calls go to the next implementation there, and nowhere else."""
    from turnout_flaggems import moe

    spec = REGISTRY.ops["moe_experts_fp8"]
    case = next(c for c in spec.sample_inputs("cpu", DTYPES["bfloat16"], torch.Generator().manual_seed(0))
                if c.label.startswith("grouped_T80"))  # 80 tokens x top-2 over 4 experts: 40 a expert
    for hopper, want in ((False, []), (True, ["moe_experts_fp8"])):
        monkeypatch.setattr(moe, "_hopper", lambda device, h=hopper: h)
        gems, declined = StandIns(), []
        ok, _, msg = run_case(spec, _wrapper("moe_experts_fp8", gems, declined), case, "bfloat16")
        assert ok, msg
        assert declined == want and (sum(gems.calls.values()) > 0) == (not hopper)
