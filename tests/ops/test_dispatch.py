"""Resolution: ordering, deny, per-op order, strict, errors, probes that resolve the real callable, and
the frozen table that costs nothing per call."""

import logging
import sys
import textwrap

import pytest
import torch

from turnout.ops import (
    Impl,
    OpSpec,
    OpUnavailableError,
    Policy,
    Registry,
    SampleCase,
    build_registry,
    log_table,
    resolve,
)
from turnout.ops.reference import norm as ref_norm
from turnout.ops.resolution import resolve_op
from turnout.platforms import Platform

CPU = Platform(name="cpu", device_type="cpu", dist_backend="gloo", family_order=("vendor", "reference", "triton"))
# A GPU platform's ordering, exercised on CPU tensors.
FAKE_CUDA = Platform(name="cuda", device_type="cpu", dist_backend="gloo", triton_backend=True)
NONE = Policy()


def scale_ref(x, factor):
    return x * factor


def _samples(device, dtype, gen):
    yield SampleCase("x", (torch.randn(4, generator=gen).to(device, dtype), 2.0))


def _impl(tag):
    def fn(x, factor):
        return x * factor
    fn.tag = tag
    return fn


def _unavailable(platform):
    return False, "no such device here"


def toy_registry(*impls) -> Registry:
    reg = Registry()
    reg.add_op(OpSpec("scale", scale_ref, _samples))
    for i in impls:
        reg.add_impl(i)
    return reg


def three_families():
    return toy_registry(
        Impl("scale", "vendor.cuda", _impl("vc"), platforms=("cuda",)),
        Impl("scale", "vendor.other", _impl("vo"), platforms=("other",)),
        Impl("scale", "triton.default", _impl("td")),
        Impl("scale", "triton.fast", _impl("tf"), priority=5),
    )


def order(res):
    return [c.impl for c in res.candidates]


def test_default_order_gpu():
    res = resolve_op("scale", three_families(), FAKE_CUDA, NONE)
    assert res.chosen == "vendor.cuda"
    # vendor, then triton (higher priority first), then reference; then what does not apply here.
    assert order(res) == ["vendor.cuda", "triton.fast", "triton.default", "reference.torch", "vendor.other"]
    assert "does not serve platform cuda" in res.candidates[-1].reason


def test_default_order_cpu_puts_triton_last():
    res = resolve_op("scale", three_families(), CPU, NONE)
    assert res.chosen == "reference.torch"
    assert order(res)[:3] == ["reference.torch", "triton.fast", "triton.default"]


def test_prefer():
    res = resolve_op("scale", three_families(), FAKE_CUDA, Policy.parse("prefer=reference"))
    assert res.chosen == "reference.torch"
    res = resolve_op("scale", three_families(), FAKE_CUDA, Policy.parse("prefer=triton"))
    assert res.chosen == "triton.fast"


def test_deny_impl_and_family():
    reg = three_families()
    res = resolve_op("scale", reg, FAKE_CUDA, Policy.parse("deny=vendor.cuda,triton.fast", source="env"))
    assert res.chosen == "triton.default"
    denied = {c.impl: c.reason for c in res.candidates if "denied" in c.reason}
    assert set(denied) == {"vendor.cuda", "triton.fast"} and "env" in denied["vendor.cuda"]
    res = resolve_op("scale", reg, FAKE_CUDA, Policy.parse("deny=vendor,triton"))
    assert res.chosen == "reference.torch"


def test_per_op_order():
    reg = three_families()
    res = resolve_op("scale", reg, FAKE_CUDA, Policy.parse("scale=triton.default|reference.torch"))
    assert res.chosen == "triton.default"
    assert order(res)[:2] == ["triton.default", "reference.torch"]
    skipped = {c.impl: c.reason for c in res.candidates[2:]}
    assert all("not in the policy's order for scale" in r for r in skipped.values())
    # a family in a per-op order stands for its members, highest priority first
    res = resolve_op("scale", reg, FAKE_CUDA, Policy.parse("scale=reference|triton"))
    assert order(res)[:3] == ["reference.torch", "triton.fast", "triton.default"]
    # per-op order wins over prefer; deny still applies inside it
    res = resolve_op("scale", reg, FAKE_CUDA,
                     Policy.parse("prefer=reference;scale=triton.fast|triton.default;deny=triton.fast"))
    assert res.chosen == "triton.default"


def test_per_op_order_skips_unavailable():
    reg = toy_registry(Impl("scale", "vendor.cuda", _impl("vc"), check=_unavailable))
    res = resolve_op("scale", reg, FAKE_CUDA, Policy.parse("scale=vendor.cuda|reference.torch"))
    assert res.chosen == "reference.torch"
    assert res.candidates[0].reason == "no such device here"


def test_strict_first_candidate_unavailable_is_an_error():
    reg = toy_registry(Impl("scale", "vendor.cuda", _impl("vc"), check=_unavailable))
    pol = Policy.parse("strict=1", source="TURNOUT_OPS")
    with pytest.raises(OpUnavailableError) as e:
        resolve(FAKE_CUDA, pol, reg)
    msg = str(e.value)
    for n in ("'scale'", "platform cuda", "strict", "TURNOUT_OPS", "vendor.cuda", "no such device here"):
        assert n in msg
    # strict with an explicit first choice that is not for this platform
    reg = toy_registry(Impl("scale", "vendor.cuda", _impl("vc"), platforms=("cuda",)))
    with pytest.raises(OpUnavailableError, match="does not serve platform cpu"):
        resolve(CPU, Policy.parse("scale=vendor.cuda|reference.torch;strict=1"), reg)


def test_strict_is_about_the_first_candidate_that_could_run_here():
    # vendor.cuda does not serve cpu, so on cpu the first candidate is the reference: fine.
    reg = toy_registry(Impl("scale", "vendor.cuda", _impl("vc"), platforms=("cuda",)))
    table = resolve(CPU, Policy.parse("strict=1"), reg)
    assert table.chosen("scale") == "reference.torch"
    table = resolve(FAKE_CUDA, Policy.parse("strict=1"), reg)
    assert table.chosen("scale") == "vendor.cuda"


def test_no_candidate_error_names_op_platform_and_each_candidate():
    reg = toy_registry(Impl("scale", "vendor.cuda", _impl("vc"), check=_unavailable),
                       Impl("scale", "triton.default", "turnout_no_such_module:scale"))
    with pytest.raises(OpUnavailableError) as e:
        resolve(FAKE_CUDA, Policy.parse("deny=reference"), reg)
    msg = str(e.value)
    for n in ("op 'scale'", "platform cuda", "vendor.cuda: no such device here",
              "triton.default: import turnout_no_such_module failed", "reference.torch: denied by policy"):
        assert n in msg, n


def test_unknown_op_requested():
    with pytest.raises(OpUnavailableError, match="unknown op 'nope'"):
        resolve(CPU, NONE, toy_registry(), ops=["nope"])


def test_table_attribute_is_the_function_after_first_call():
    fn = _impl("vc")
    table = resolve(FAKE_CUDA, NONE, toy_registry(Impl("scale", "vendor.cuda", fn)))
    assert table.scale is not fn  # the first-call guard
    assert torch.equal(table.scale(torch.ones(2), 3.0), torch.full((2,), 3.0))
    assert table.scale is fn  # from now on: a plain attribute holding the implementation's function


def test_real_registry_resolves_every_op_on_cpu():
    reg = build_registry(plugins=False)
    table = resolve(CPU, NONE, reg)
    assert set(table.resolutions) == set(reg.ops)
    # cpu order: vendor (vendor.cpu_native where it built, then vendor.cpu: torch's own CPU kernels), reference,
    # then triton (interpreter only)
    from test_doctor import _cpu_default

    assert all(table.chosen(op) == _cpu_default(reg, op) for op in reg.ops if reg.ops[op].requires is None)
    # an optional op needing device streams has no implementation on cpu, and no attribute (never a None)
    assert not table.available("swap_layer_async") and reg.ops["swap_layer_async"].optional
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.testing.assert_close(table.rms_norm(x, w, 1e-6), ref_norm.rms_norm(x, w, 1e-6))
    assert table.rms_norm is table.resolutions["rms_norm"].candidate(table.chosen("rms_norm")).fn


def test_table_is_frozen_and_names_missing_ops():
    table = resolve(CPU, NONE, toy_registry())
    with pytest.raises(AttributeError, match="frozen"):
        table.scale = scale_ref
    with pytest.raises(AttributeError, match="no op 'rms_nrom'; it has: scale"):
        _ = table.rms_nrom


def test_log_table_is_one_record_with_reasons(caplog):
    reg = three_families()
    reg.plugins.append(__import__("turnout.ops.registry", fromlist=["PluginReport"]).PluginReport(
        "brokenchip", False, "ImportError: libbroken.so"))
    table = resolve(FAKE_CUDA, Policy.parse("deny=triton.fast"), reg)
    with caplog.at_level(logging.DEBUG, logger="turnout.ops"):
        log_table(table)
    recs = [r for r in caplog.records if r.name.startswith("turnout.ops")]
    assert [r.levelno for r in recs] == [logging.INFO, logging.DEBUG]  # the whole table only at DEBUG
    text = recs[1].getMessage()
    assert "scale" in text and "vendor.cuda" in text
    assert "triton.fast: denied by policy" in text
    assert "triton.default: available; ranked below vendor.cuda" in text
    assert "vendor.other: does not serve platform cuda" in text
    assert "plugin brokenchip not loaded: ImportError: libbroken.so" in text


def _rows_registry():
    """Three ops on a fake GPU: two lose their vendor kernel to the same missing library, one has none."""
    reg = Registry()
    for name in ("scale_a", "scale_b", "scale_c"):
        reg.add_op(OpSpec(name, scale_ref, _samples))
        reg.add_impl(Impl(name, "triton.default", _impl("td")))
    for name in ("scale_a", "scale_b"):
        reg.add_impl(Impl(name, "vendor.cuda", "turnout_no_such_vendor_lib:scale", platforms=("cuda",)))
    return reg


def test_info_log_is_one_line_naming_each_missing_library_once(caplog):
    table = resolve(FAKE_CUDA, Policy.parse("scale_c=reference"), _rows_registry())
    with caplog.at_level(logging.INFO, logger="turnout.ops"):
        log_table(table)
    recs = [r for r in caplog.records if r.name.startswith("turnout.ops")]
    assert len(recs) == 1 and recs[0].levelno == logging.INFO
    line = recs[0].getMessage()
    assert "\n" not in line
    assert line.startswith("op dispatch on cuda (policy scale_c=reference): 3 ops, 2 triton, 1 reference; ")
    assert "2 fell back: scale_a, scale_b past vendor.cuda (import turnout_no_such_vendor_lib failed: " in line
    assert line.count("ModuleNotFoundError") == 1  # once, not once per op
    assert "turnout ops" in line


def test_info_log_says_when_nothing_fell_back(caplog):
    table = resolve(CPU, NONE, toy_registry())
    with caplog.at_level(logging.INFO, logger="turnout.ops"):
        log_table(table)
    (rec,) = [r for r in caplog.records if r.name.startswith("turnout.ops")]
    assert "1 op, 1 reference; none fell back" in rec.getMessage()


# --- probes resolve the real callable -------------------------------------------------------------

def test_lazy_namespace_probe_is_real_seed_003():
    assert hasattr(torch.ops, "_turnout_no_such_lib")  # why hasattr proves nothing
    reg = toy_registry(Impl("scale", "vendor.cuda", "torch.ops:_turnout_no_such_lib.scale"))
    res = resolve_op("scale", reg, FAKE_CUDA, NONE)
    assert res.chosen == "reference.torch"
    assert "has no attribute 'scale'" in res.candidates[0].reason
    # A real op in a lazy namespace resolves.
    ok, reason, fn = Impl("scale", "vendor.aten", "torch.ops:aten.mul").probe(FAKE_CUDA)
    assert ok and fn is torch.ops.aten.mul


def test_vendor_cuda_without_vllm_is_unavailable_with_reason():
    reg = build_registry(plugins=False)
    res = resolve_op("rms_norm", reg, FAKE_CUDA, Policy.parse("prefer=vendor"))
    cand = next(c for c in res.candidates if c.impl == "vendor.cuda")
    assert not cand.available and ("vllm" in cand.reason or "torch.ops._C" in cand.reason)
    assert res.chosen is not None


def test_factory_targets():
    def good():
        return _impl("made")

    def bad():
        from turnout.ops import ImplUnavailable
        raise ImplUnavailable("libchip.so has no kernel rms_norm")

    assert Impl("scale", "vendor.a", good, factory=True).probe(CPU)[0]
    ok, reason, _ = Impl("scale", "vendor.b", bad, factory=True).probe(CPU)
    assert not ok and reason == "libchip.so has no kernel rms_norm"
    ok, reason, _ = Impl("scale", "vendor.c", lambda: None, factory=True).probe(CPU)
    assert not ok and "not a callable" in reason


def test_broken_vendor_module_disables_only_its_impls_seed_000(tmp_path, monkeypatch):
    (tmp_path / "chip_kernels_broken.py").write_text(textwrap.dedent("""
        from libchip_turnout_test import swap_cache_per_layer, rms_norm  # one missing symbol breaks all
    """))
    (tmp_path / "chip_kernels_ok.py").write_text("def scale(x, factor):\n    return x * factor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("chip_kernels_broken", "chip_kernels_ok"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    reg = Registry()
    reg.add_op(OpSpec("scale", scale_ref, _samples))
    reg.add_op(OpSpec("scale2", scale_ref, _samples))
    reg.add_impl(Impl("scale", "vendor.chip", "chip_kernels_broken:scale"))
    reg.add_impl(Impl("scale2", "vendor.chip", "chip_kernels_ok:scale"))
    table = resolve(FAKE_CUDA, NONE, reg)
    assert table.chosen("scale") == "reference.torch"
    assert table.chosen("scale2") == "vendor.chip"
    reason = table.resolutions["scale"].candidates[0].reason
    assert "import chip_kernels_broken failed" in reason and "libchip_turnout_test" in reason


def test_broken_vendor_registration_module_is_reported_not_fatal(monkeypatch):
    import turnout.ops.vendors as vendors

    monkeypatch.setattr(vendors, "VENDOR_PACKAGES", ("turnout.ops.vendors.nosuchchip",) + vendors.VENDOR_PACKAGES)
    reg = build_registry(plugins=False)
    bad = [p for p in reg.plugins if p.name == "builtin:turnout.ops.vendors.nosuchchip"]
    assert bad and not bad[0].loaded and "No module named" in bad[0].reason
    assert "vendor.cuda" in reg.impl_ids("rms_norm")  # the other vendors still registered
    assert resolve(CPU, NONE, reg).chosen("rms_norm") == "vendor.cpu"  # resolution goes on


@pytest.mark.parametrize("impl_id,needle", [("nodot", "must be '<family>.<name>'"),
                                            ("fast.kernel", "unknown family 'fast'"),
                                            ("vendor.a|b", "must be '<family>.<name>'"),
                                            ("vendor.", "must be '<family>.<name>'")])
def test_impl_id_validation(impl_id, needle):
    with pytest.raises(ValueError, match=needle.replace("|", r"\|").replace(".", r"\.")):
        Impl("scale", impl_id, scale_ref)


def test_registry_rejects_duplicates_and_unknown_ops():
    reg = toy_registry()
    with pytest.raises(ValueError, match="already has an implementation 'reference.torch'"):
        reg.add_impl(Impl("scale", "reference.torch", scale_ref))
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        reg.add_impl(Impl("nope", "vendor.x", scale_ref))
