"""Choices made inside an implementation (Impl.choices): the Triton MoE kernel and the decode attention's
split count are shown by `turnout ops`, fixed by `<op>.<choice>=<value>` in the policy (validated: a bad
value names the op and the choice), and left exactly as measured by default. Also: vendor.cuda
moe_experts ranks below Triton, and `turnout ops --where`."""

import functools
import io
import json
from pathlib import Path

import pytest
import torch

from turnout import envs
from turnout.entrypoints import cli
from turnout.ops import Policy, PolicyError, build_registry, doctor, resolve
from turnout.ops.conformance import run_conformance
from turnout.ops.reference.attention import paged_attention as reference_attention
from turnout.ops.reference.moe import moe_experts as reference_moe
from turnout.ops.resolution import resolve_op
from turnout.ops.triton import attention as triton_attention
from turnout.ops.triton import moe as triton_moe
from turnout.platforms import Platform

# A GPU platform's ordering on CPU tensors; Triton runs them in the interpreter here (tests/conftest.py).
GPU = Platform(name="cuda", device_type="cpu", dist_backend="gloo", triton_backend=True)
# These run the kernels on CPU tensors, in the interpreter; on a GPU `turnout ops --check` under such a
# policy covers the same paths.
needs_triton = pytest.mark.skipif(not envs.get().triton_interpret, reason="needs TRITON_INTERPRET=1 (CPU)")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugins=False)


def _validated(text, registry):
    pol = Policy.parse(text, source="TURNOUT_OPS")
    pol.validate(registry)
    return pol


# --- the grammar ---------------------------------------------------------------------------------

def test_choice_clauses_parse_layer_and_describe(registry):
    pol = Policy.from_sources("moe_experts.kernel=decode;paged_attention.num_splits=4",
                              env={"TURNOUT_OPS": "moe_experts.kernel=grouped"})
    pol.validate(registry)
    assert pol.choice("moe_experts", "kernel") == ("grouped", "TURNOUT_OPS")  # the later layer wins
    assert pol.choice("paged_attention", "num_splits") == ("4", "ops_policy")
    assert pol.choice("rms_norm", "kernel") is None
    assert "moe_experts.kernel=grouped" in pol.describe() and "paged_attention.num_splits=4" in pol.describe()


@pytest.mark.parametrize("text,needle", [
    ("moe_experts.kernel=fast", "moe_experts.kernel (triton.default) must be one of auto|grouped|decode, got 'fast'"),
    ("moe_experts.kernal=grouped", "op 'moe_experts' has no choice 'kernal'; its implementations declare: "
                                   "kernel (triton.default)"),
    ("rms_norm.kernel=grouped", "op 'rms_norm' has no choice 'kernel'; its implementations declare: none"),
    ("moe_expert.kernel=grouped", "sets a choice of unknown op 'moe_expert'"),
    ("paged_attention.num_splits=0", "paged_attention.num_splits (triton.default) must be auto or an integer 1..64"),
    ("rotary_paged_attention.num_splits=65", "rotary_paged_attention.num_splits (triton.default) must be auto"),
    ("paged_attention.num_splits=two", "got 'two'"),
    ("moe_experts.kernel=grouped|decode", "must be '<op>.<choice>=<value>' with one value"),
    ("moe_experts.kernel=grouped;moe_experts.kernel=decode", "'moe_experts.kernel' is given twice"),
])
def test_bad_choice_is_an_error_naming_op_and_choice(registry, text, needle):
    with pytest.raises(PolicyError) as e:
        _validated(text, registry)
    assert needle in str(e.value)


def test_engine_config_bad_choice_fails_at_resolution(registry):
    pol = Policy.from_sources("moe_experts.kernel=fastest", env={}, platform=GPU)
    with pytest.raises(ValueError, match=r"policy \(ops_policy\): moe_experts.kernel \(triton.default\) must be"):
        resolve(GPU, pol, registry)


def test_cli_bad_choice_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("TURNOUT_OPS", "paged_attention.num_splits=-1")
    envs.reload()
    assert cli.main(["ops"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "paged_attention.num_splits" in err[0] and "TURNOUT_OPS" in err[0]


# --- defaults are exactly the implementation's own ----------------------------------------------

def test_default_binds_nothing(registry):
    for op, fn in (("moe_experts", triton_moe.moe_experts), ("paged_attention", triton_attention.paged_attention),
                   ("rotary_paged_attention", triton_attention.rotary_paged_attention)):
        cand = resolve_op(op, registry, GPU, Policy()).candidate("triton.default")
        assert cand.available and cand.fn is fn, op  # the very function: no wrapper, no per-call branch
        assert [(c["name"], c["value"], c["set_by"]) for c in cand.choices][0][1:] == ("auto", "default")


def test_a_set_choice_is_bound_once(registry):
    pol = _validated("moe_experts.kernel=grouped;paged_attention.num_splits=3", registry)
    moe = resolve_op("moe_experts", registry, GPU, pol).candidate("triton.default")
    assert isinstance(moe.fn, functools.partial) and moe.fn.func is triton_moe.moe_experts
    assert moe.fn.keywords == {"kernel": "grouped"}
    attn = resolve_op("paged_attention", registry, GPU, pol).candidate("triton.default")
    assert attn.fn.keywords == {"num_splits": 3}  # parsed to an int
    assert resolve_op("rotary_paged_attention", registry, GPU, pol).candidate("triton.default").fn is \
        triton_attention.rotary_paged_attention  # a choice is per op


# --- a fixed choice runs the path it names, and stays correct -----------------------------------

def _moe_problem(t, e=4, k=2, h=32, inter=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter ** -0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    return x, w13, w2, torch.rand(t, k, generator=gen) + 0.1, ids


@needs_triton
@pytest.mark.parametrize("kernel,t,want", [("auto", 1, "decode"), ("auto", 70, "grouped"), ("grouped", 1, "grouped"),
                                           ("decode", 70, "decode"), ("decode", 1, "decode")])
def test_moe_kernel_choice_runs_that_path(registry, monkeypatch, kernel, t, want):
    calls = []
    real_grouped, real_decode = triton_moe.moe_experts_grouped, triton_moe.moe_experts_decode
    monkeypatch.setattr(triton_moe, "moe_experts_grouped", lambda *a, **kw: calls.append(("grouped", kw))
                        or real_grouped(*a, **kw))
    monkeypatch.setattr(triton_moe, "moe_experts_decode", lambda *a, **kw: calls.append(("decode", kw))
                        or real_decode(*a, **kw))
    table = resolve(GPU, _validated(f"moe_experts.kernel={kernel}", registry), registry, ops=["moe_experts"])
    problem = _moe_problem(t)  # E 4, k 2: 140 pairs at T 70 are past the decode sizes, 2 at T 1
    got = table.moe_experts(*problem)
    torch.testing.assert_close(got, reference_moe(*problem), atol=1e-4, rtol=1e-4)
    assert [c[0] for c in calls] == [want]
    if kernel == "decode":  # forced decode never takes the one-token kernel
        assert calls[0][1]["config"].one_token == 0
    if kernel == "auto":
        assert calls[0][1].get("config") is None  # the default path: the measured tiles, nothing bound


@needs_triton
def test_num_splits_choice_reaches_decode_only(registry, monkeypatch):
    seen = []
    real = triton_attention.paged_attention_impl
    monkeypatch.setattr(triton_attention, "paged_attention_impl",
                        lambda *a, **kw: seen.append(kw.get("num_splits")) or real(*a, **kw))
    table = resolve(GPU, _validated("paged_attention.num_splits=3", registry), registry, ops=["paged_attention"])
    gen = torch.Generator().manual_seed(0)
    nb, bs, hk, hq, d = 8, 16, 2, 4, 32
    k_cache, v_cache = torch.randn(nb, bs, hk, d, generator=gen), torch.randn(nb, bs, hk, d, generator=gen)
    tables = torch.arange(nb, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([50, 37], dtype=torch.int32)
    for q_len in (1, 5):  # decode, then prefill (never split)
        q = torch.randn(2 * q_len, hq, d, generator=gen)
        qsl = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
        args = (q, k_cache, v_cache, tables, seq_lens, qsl, q_len, 50, d ** -0.5)
        torch.testing.assert_close(table.paged_attention(*args), reference_attention(*args), atol=2e-5, rtol=2e-5)
    assert seen == [3, None]


@needs_triton
def test_conformance_runs_the_choice_in_force(registry):
    pol = _validated("moe_experts.kernel=grouped", registry)
    results = [r for r in run_conformance(registry, GPU, ops=["moe_experts"], policy=pol) if r.dtype == "float32"]
    assert results and all(r.ok for r in results if r.impl == "triton.default"), [r.message for r in results]


# --- the report ------------------------------------------------------------------------------------

def test_turnout_ops_shows_choices(registry, monkeypatch):
    monkeypatch.setenv("TURNOUT_OPS", "moe_experts.kernel=decode")
    envs.reload()
    out = io.StringIO()
    assert doctor.main(as_json=True, device="cpu", ops=["moe_experts", "paged_attention"], out=out,
                       registry=registry) == 0
    rows = {r["op"]: r for r in json.loads(out.getvalue())}
    moe = next(c for c in rows["moe_experts"]["candidates"] if c["impl"] == "triton.default")
    (choice,) = moe["choices"]
    assert (choice["name"], choice["value"], choice["set_by"], choice["allowed"]) == \
        ("kernel", "decode", "TURNOUT_OPS", "auto|grouped|decode")
    assert "one-token kernel at T = 1" in choice["doc"]
    attn = next(c for c in rows["paged_attention"]["candidates"] if c["impl"] == "triton.default")
    assert attn["choices"][0]["value"] == "auto" and attn["choices"][0]["set_by"] == "default"
    assert all("choices" not in c for c in rows["paged_attention"]["candidates"] if c["impl"] != "triton.default")
    out = io.StringIO()
    doctor.main(device="cpu", ops=["moe_experts"], out=out, registry=registry)
    assert "choice moe_experts.kernel=decode (set by TURNOUT_OPS; auto|grouped|decode)" in out.getvalue()


def test_tuning_variable_is_named_beside_the_default(registry, monkeypatch):
    monkeypatch.setenv("TURNOUT_ATTN_DECODE", '{"num_splits": 2}')
    envs.reload()
    cand = resolve_op("paged_attention", registry, GPU, Policy()).candidate("triton.default")
    assert cand.choices[0]["note"] == "TURNOUT_ATTN_DECODE sets num_splits=2 at decode"
    # the variable's tiles are bound once, as the table is resolved (never read at launch)
    assert isinstance(cand.fn, functools.partial) and cand.fn.func is triton_attention.paged_attention
    assert cand.fn.keywords == {"decode_tuning": {"num_splits": 2}}


# --- vendor.cuda moe_experts: registered, ranked below Triton -----------------------------------------

def test_vendor_cuda_moe_ranks_below_triton(registry):
    def order(text):
        return [c.impl for c in resolve_op("moe_experts", registry, GPU, Policy.parse(text)).candidates]

    # (then the batch-invariant implementations, last outside batch-invariant mode)
    assert order("")[:3] == ["triton.default", "vendor.cuda", "reference.torch"]
    assert order("prefer=vendor")[:3] == ["triton.default", "vendor.cuda", "reference.torch"]
    assert order("deny=triton")[:2] == ["vendor.cuda", "reference.torch"]  # the next best where Triton is not
    assert order("moe_experts=vendor.cuda|triton")[:3] == ["vendor.cuda", "triton.default", "triton.batch_invariant"]
    assert [c.impl for c in resolve_op("rms_norm", registry, GPU, Policy()).candidates][0] == "vendor.cuda"
    cand = resolve_op("moe_experts", registry, GPU, Policy()).candidate("vendor.cuda")
    if not torch.cuda.is_available():
        assert not cand.available and ("_grouped_mm" in cand.reason or "CUDA" in cand.reason)


# --- turnout ops --where ----------------------------------------------------------------------------

def test_where_lists_spec_implementations_and_tests(registry):
    out = io.StringIO()
    assert doctor.main(where_op="moe_experts", as_json=True, out=out, registry=registry) == 0
    info = json.loads(out.getvalue())
    assert info["spec"]["file"] == "turnout/ops/reference/moe.py" and info["spec"]["line"] > 0
    files = {i["impl"]: i["file"] for i in info["implementations"]}
    assert files == {"reference.torch": "turnout/ops/reference/moe.py", "triton.default": "turnout/ops/triton/moe.py",
                     "vendor.cuda": "turnout/ops/vendors/cuda/moe.py",
                     "reference.batch_invariant": "turnout/ops/reference/batch_invariant.py",
                     "triton.batch_invariant": "turnout/ops/triton/batch_invariant.py"}
    assert {"tests/moe/test_moe_decode.py", "tests/ops/test_conformance.py", "tests/ops/test_choices.py"} <= \
        set(info["tests"])
    for path in [info["spec"]["file"], *files.values(), *info["tests"]]:
        assert (ROOT / path).is_file(), path
    out = io.StringIO()
    doctor.main(where_op="rms_norm", out=out, registry=registry)
    text = out.getvalue()
    assert "fused_add_rms_norm" not in text.split("tests", 1)[0]  # names its own files only
    assert "turnout/ops/triton/norm.py:" in text and "turnout/ops/vendors/cpu/norm.py:" in text


def test_where_unknown_op_exit_2(capsys):
    assert cli.main(["ops", "--where", "rms_nrom"]) == 2
    assert "unknown op 'rms_nrom'" in capsys.readouterr().err
