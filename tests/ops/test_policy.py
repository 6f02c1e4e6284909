"""The TURNOUT_OPS / ops_policy grammar, layering, and start-up errors that name the bad thing."""

import pytest

from turnout import envs
from turnout.ops import Policy, PolicyError, build_registry, resolve
from turnout.platforms import Platform

CPU = Platform(name="cpu", device_type="cpu", dist_backend="gloo", family_order=("vendor", "reference", "triton"))
FAKE_CUDA = Platform(name="cuda", device_type="cpu", dist_backend="gloo", triton_backend=True)


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugins=False)


def test_grammar_all_clauses():
    p = Policy.parse(" prefer = triton | reference ; rms_norm=triton.default|reference.torch;"
                     "deny=vendor.cuda, vendor ; strict=1 ;", source="t")
    assert p.prefer == ("triton", "reference")
    assert p.per_op == {"rms_norm": ("triton.default", "reference.torch")}
    assert p.deny == {"vendor.cuda", "vendor"}
    assert p.strict is True
    assert p.source == "t"


def test_empty_and_default():
    assert Policy.parse("").prefer == () and not Policy.parse("  ;  ").per_op
    p = Policy.from_sources(None, env={})
    assert (p.prefer, p.per_op, p.deny, p.strict) == ((), {}, frozenset(), False)
    assert p.describe() == "(platform default)"


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), ("true", True), ("False", False),
                                            ("on", True), ("no", False)])
def test_strict_values(value, expected):
    assert Policy.parse(f"strict={value}").strict is expected


def test_per_op_may_name_families():
    p = Policy.parse("paged_attention=triton|reference")
    assert p.per_op["paged_attention"] == ("triton", "reference")


def test_describe_round_trips():
    p = Policy.parse("prefer=reference;rms_norm=triton.default|reference.torch;deny=vendor.cuda;strict=1")
    q = Policy.parse(p.describe())
    assert (q.prefer, q.per_op, q.deny, q.strict) == (p.prefer, p.per_op, p.deny, p.strict)


def test_env_on_top_of_config():
    cfg = "prefer=triton;rms_norm=triton.default|reference.torch;silu_and_mul=reference.torch;deny=vendor.cuda"
    env = {"TURNOUT_OPS": "prefer=reference;rms_norm=reference.torch;deny=triton.default;strict=1"}
    p = Policy.from_sources(cfg, env=env)
    assert p.prefer == ("reference",)  # replaced
    assert p.per_op == {"rms_norm": ("reference.torch",), "silu_and_mul": ("reference.torch",)}  # per op
    assert p.deny == {"vendor.cuda", "triton.default"}  # deny lists add up
    assert p.strict is True
    assert p.source == "ops_policy+TURNOUT_OPS"


def test_env_alone_and_blank_env(monkeypatch):
    monkeypatch.setenv("TURNOUT_OPS", "prefer=reference")
    envs.reload()
    assert Policy.from_sources().prefer == ("reference",)
    assert Policy.from_sources(env={"TURNOUT_OPS": "   "}).source == "default"


def test_platform_default_is_the_bottom_layer():
    plat = Platform(name="chip", device_type="cpu", dist_backend="gloo", ops_policy="deny=triton;strict=1")
    p = Policy.from_sources("prefer=reference", env={"TURNOUT_OPS": "strict=0"}, platform=plat)
    assert p.deny == {"triton"} and p.prefer == ("reference",) and p.strict is False
    assert p.source == "platform chip default+ops_policy+TURNOUT_OPS"


def test_family_order():
    assert Policy().family_order(FAKE_CUDA) == ("vendor", "triton", "reference")
    assert Policy().family_order(CPU) == ("vendor", "reference", "triton")
    assert Policy.parse("prefer=reference").family_order(FAKE_CUDA) == ("reference", "vendor", "triton")
    assert Policy.parse("prefer=triton|reference").family_order(CPU) == ("triton", "reference", "vendor")


@pytest.mark.parametrize("text,needle", [
    ("prefer", "'prefer' is not 'key=value'"),
    ("=triton", "is not 'key=value'"),
    ("prefer=", "is not 'key=value'"),
    ("strict", "is not 'key=value'"),
    ("prefer=triton||reference", "empty name"),
    ("deny=vendor.cuda,", "empty name"),
    ("strict=2", "strict must be 0 or 1, got '2'"),
    ("strict=maybe", "got 'maybe'"),
    ("prefer=gpu", "unknown family 'gpu'"),
    ("deny=cuda", "unknown family 'cuda'"),
    ("rms_norm=fast.kernel", "unknown family 'fast'"),
    ("rms_norm=triton default", "'triton default'"),
    ("prefer=triton.default", "prefer takes families"),
    ("prefer=triton;prefer=reference", "'prefer' is given twice"),
    ("rms_norm=reference.torch;rms_norm=triton.default", "'rms_norm' is given twice"),
    ("rms_norm=reference.torch|reference.torch", "'reference.torch' is listed twice"),
    ("rms norm=reference.torch", "'rms norm'"),
    ("prefer:triton", "is not 'key=value'"),
])
def test_malformed(text, needle):
    with pytest.raises(PolicyError) as e:
        Policy.parse(text, source="TURNOUT_OPS")
    assert needle in str(e.value)
    assert str(e.value).startswith("TURNOUT_OPS")
    # Malformed env is an error at start-up too, naming the variable.
    with pytest.raises(PolicyError, match="TURNOUT_OPS"):
        Policy.from_sources(env={"TURNOUT_OPS": text})


def test_malformed_config_names_its_source():
    with pytest.raises(PolicyError, match="^ops_policy: "):
        Policy.from_sources("strict=2", env={})


@pytest.mark.parametrize("text,needles", [
    ("nosuch_op=reference.torch", ["unknown op 'nosuch_op'", "rms_norm"]),
    ("rms_norm=vendor.nosuch|reference.torch", ["op 'rms_norm' has no implementation 'vendor.nosuch'",
                                                "reference.torch"]),
    ("deny=triton.nosuch", ["denies unknown implementation 'triton.nosuch'"]),
])
def test_unknown_names_are_startup_errors(registry, text, needles):
    pol = Policy.parse(text, source="TURNOUT_OPS")
    for fn in (lambda: pol.validate(registry), lambda: resolve(CPU, pol, registry)):
        with pytest.raises(PolicyError) as e:
            fn()
        for n in needles:
            assert n in str(e.value)
        assert "TURNOUT_OPS" in str(e.value)


def test_known_names_validate(registry):
    Policy.parse("rms_norm=triton.default|reference.torch;deny=vendor.cuda,triton;prefer=reference").validate(
        registry)


def test_policy_errors_are_value_errors():
    # cli.py turns ValueError/RuntimeError into one line and exit code 2.
    assert issubclass(PolicyError, ValueError)
