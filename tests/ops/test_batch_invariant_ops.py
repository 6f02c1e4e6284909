"""Every implementation tagged ``batch_invariant`` (turnout/ops/batch_invariant.py) that runs here: a row
computed alone equals, bit for bit, the same row inside batches of 1, 3, 17 and 64 rows at several
positions; attention rows are also the same whether the sequence's queries come as one prefill, in chunks
over the cache, or one decode step at a time. Conformance against the reference (tolerance) is the generic
suite's (tests/ops/test_conformance.py runs every implementation, these included). Triton kernels run under
TRITON_INTERPRET=1 in float32 / float16 (the interpreter's bfloat16 tl.dot is wrong); on a GPU in bfloat16.
The untagged implementations chosen by default are printed for contrast, not asserted."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from turnout.ops.batch_invariant import INVARIANT_OPS
from turnout.ops.policy import Policy
from turnout.ops.reference.rotary import make_cos_sin_cache
from turnout.ops.registry import default_registry
from turnout.ops.resolution import resolve_op
from turnout.platforms import detect_platform

PLATFORM = detect_platform("auto")
DEV = PLATFORM.device()
REG = default_registry()
SIZES = (1, 3, 17, 64)
N = 64  # rows in the pool a batch is drawn from; row 0 is the one followed
_ATTENTION = ("paged_attention", "rotary_paged_attention")  # sequences, not rows: their own test below


def _impls():
    """(op, impl id, callable) of every tagged implementation available here."""
    out = []
    for op in INVARIANT_OPS:
        for impl in REG.impls[op]:
            if not impl.batch_invariant:
                continue
            ok, _, fn = impl.probe(PLATFORM)
            if ok:
                out.append(pytest.param(op, impl.id, fn, id=f"{op}-{impl.id}"))
    return out


def _dtypes(impl_id):
    if PLATFORM.is_gpu:
        return ("float32", "bfloat16")
    return ("float32", "float16") if impl_id.startswith("triton") else ("float32", "bfloat16")


def _rand(*shape, dtype=torch.float32, scale=1.0, gen):
    return (torch.randn(shape, generator=gen) * scale).to(DEV, dtype)


def _row_case(op, dtype, gen):
    """(full args for N rows, fn(args subset) -> list of per-row outputs, how to take a subset of rows)."""
    d = dict(dtype=dtype, gen=gen)
    if op in ("linear", "small_m_linear"):
        args = [_rand(N, 72, **d), _rand(40, 72, scale=72 ** -0.5, **d), _rand(40, **d)]
        return args, (0,), lambda fn, a: [fn(*a)]
    if op == "add_rms_norm_linear":
        args = [_rand(N, 72, **d), _rand(N, 72, **d), _rand(72, scale=0.3, **d) + 1, 1e-6,
                _rand(40, 72, scale=72 ** -0.5, **d), None]
        return args, (0, 1), lambda fn, a: list(fn(*a))
    if op == "rms_norm":
        return [_rand(N, 96, **d), _rand(96, scale=0.3, **d) + 1, 1e-6], (0,), lambda fn, a: [fn(*a)]
    if op == "fused_add_rms_norm":
        args = [_rand(N, 96, **d), _rand(N, 96, **d), _rand(96, scale=0.3, **d) + 1, 1e-6]
        return args, (0, 1), lambda fn, a: (fn(*a), [a[0], a[1]])[1]
    if op == "silu_and_mul":
        return [_rand(N, 2 * 48, **d)], (0,), lambda fn, a: [fn(*a)]
    if op in ("rotary_embedding", "qk_norm_rotary", "qk_norm_rotary_cache"):
        pos = torch.randint(0, 512, (N,), generator=gen).to(DEV)
        q, k, v = _rand(N, 4, 32, **d), _rand(N, 2, 32, **d), _rand(N, 2, 32, **d)
        cache = make_cos_sin_cache(32, 512).to(DEV)
        if op == "rotary_embedding":
            return [pos, q, k, cache, True], (0, 1, 2), lambda fn, a: (fn(*a), [a[1], a[2]])[1]
        qw, kw = _rand(32, scale=0.3, **d) + 1, _rand(32, scale=0.3, **d) + 1
        if op == "qk_norm_rotary":
            return ([pos, q, k, qw, kw, 1e-6, cache, True], (0, 1, 2), lambda fn, a: (fn(*a), [a[1], a[2]])[1])
        kc, vc = torch.zeros(N, 1, 2, 32, dtype=dtype, device=DEV), torch.zeros(N, 1, 2, 32, dtype=dtype, device=DEV)
        slots = torch.arange(N, device=DEV)

        def run(fn, a):
            a[9].zero_(), a[10].zero_()
            fn(*a)
            return [a[1], a[2], a[9].view(N, 2, 32)[a[11]], a[10].view(N, 2, 32)[a[11]]]
        return [pos, q, k, v, qw, kw, 1e-6, cache, True, kc, vc, slots], (0, 1, 2, 3, 11), run
    if op == "sample":
        args = [_rand(N, 120, scale=3.0, gen=gen), torch.rand(N, generator=gen).to(DEV) * 1.5,
                torch.randint(0, 40, (N,), generator=gen).to(DEV, torch.int32), torch.rand(N, generator=gen).to(DEV),
                torch.rand(N, generator=gen).to(DEV) * 0.1, torch.randint(0, 2 ** 62, (N,), generator=gen).to(DEV),
                torch.randint(0, 1000, (N,), generator=gen).to(DEV)]
        args[1][::4] = 0.0  # some greedy rows
        return args, (0, 1, 2, 3, 4, 5, 6), lambda fn, a: [fn(*a)]
    if op == "select_experts":
        args = [_rand(N, 16, scale=2.0, **d), 4, "softmax", False, 1, 1, True, 1.0, None, None]
        return args, (0,), lambda fn, a: list(fn(*a))
    if op == "moe_experts":
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(N)]).to(DEV, torch.int32)
        args = [_rand(N, 32, **d), _rand(8, 96, 32, scale=32 ** -0.5, **d), _rand(8, 32, 48, scale=48 ** -0.5, **d),
                torch.rand(N, 2, generator=gen).to(DEV) + 0.1, ids]
        return args, (0, 3, 4), lambda fn, a: [fn(*a)]
    return None


def _subset(args, rows, idx):
    return [a[idx].clone() if i in rows else (a.clone() if isinstance(a, torch.Tensor) else a)
            for i, a in enumerate(args)]


def _batches(op, few=False):
    """(n, where, rows): batches of n rows with the followed row at ``where`` (front, middle, end; only the
    middle with ``few``: the Triton interpreter is slow)."""
    sizes = [s for s in SIZES if s <= 16] + [16] if op in ("small_m_linear", "add_rms_norm_linear") else SIZES
    if few and op == "sample":  # ~3 s per interpreted 64-row call; a GPU runs the 64
        sizes = sizes[:-1]
    g = torch.Generator().manual_seed(7)
    for n in sizes:
        for where in ([n // 2] if few else sorted({0, n // 2, n - 1})):
            others = (torch.randperm(N - 1, generator=g)[: n - 1] + 1).tolist()
            yield n, where, others[:where] + [0] + others[where:]


@pytest.mark.parametrize("op,impl_id,fn", [p for p in _impls() if p.values[0] not in _ATTENTION])
def test_a_row_alone_equals_the_row_in_any_batch(op, impl_id, fn):
    for dtype in _dtypes(impl_id):
        dt = getattr(torch, dtype)
        if op == "sample" and dtype != "float32":
            continue
        args, rows, run = _row_case(op, dt, torch.Generator().manual_seed(0))
        alone = [t[0].clone() for t in run(fn, _subset(args, rows, torch.tensor([0], device=DEV)))]
        for n, where, idx in _batches(op, few=impl_id.startswith("triton") and not PLATFORM.is_gpu):
            got = run(fn, _subset(args, rows, torch.tensor(idx, device=DEV)))
            for j, (a, g) in enumerate(zip(alone, got)):
                assert torch.equal(a, g[where]), (f"{op} {impl_id} {dtype}: output {j} of the row at {where} in a "
                                                  f"batch of {n} differs from the row alone by "
                                                  f"{(a.float() - g[where].float()).abs().max().item():.3g}")


# --------------------------------------------------------------------------------------------- attention

HQ, HK, D, BS = 4, 2, 32, 8


class _Paged:
    """Sequences with their keys/values already in a paged cache and fixed queries per position, from which
    a batch is any list of (sequence, first new position, end): exactly what the engine would pass."""

    def __init__(self, lens, dtype, gen):
        self.lens = lens
        nb = sum(math.ceil(n / BS) for n in lens) + 3
        self.k_cache = _rand(nb, BS, HK, D, dtype=dtype, gen=gen)
        self.v_cache = _rand(nb, BS, HK, D, dtype=dtype, gen=gen)
        perm = torch.randperm(nb, generator=gen).tolist()
        self.tables, at = [], 0
        for n in lens:
            self.tables.append(perm[at: at + math.ceil(n / BS)])
            at += math.ceil(n / BS)
        self.q = [_rand(n, HQ, D, dtype=dtype, gen=gen) for n in lens]

    def run(self, fn, parts):
        """parts: [(seq, start, end)]: queries of positions start..end-1 over keys 0..end-1."""
        width = max(len(self.tables[s]) for s, _, _ in parts)
        tables = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s, _, _ in parts],
                              dtype=torch.int32, device=DEV)
        q = torch.cat([self.q[s][a:b] for s, a, b in parts])
        qlens = [b - a for _, a, b in parts]
        qsl = torch.tensor([0] + qlens, device=DEV).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([b for _, _, b in parts], dtype=torch.int32, device=DEV)
        out = fn(q, self.k_cache, self.v_cache, tables, seq_lens, qsl, max(qlens), int(seq_lens.max()), D ** -0.5)
        starts = qsl.tolist()
        return [out[starts[i]: starts[i + 1]] for i in range(len(parts))]


def _attention_fn(op, fn, paged):
    if op == "paged_attention":
        return fn
    from turnout.ops.reference.batch_invariant import rotary_embedding

    # rotary_paged_attention takes the new tokens' raw keys and writes them rotated: the cache holds every
    # key rotated (by the batch-invariant rotary, so a rewrite writes the same bits), raw keys come from raw
    cache = make_cos_sin_cache(D, 256).to(DEV)
    raw = paged.k_cache.view(-1, HK, D)
    pos_of = torch.zeros(raw.shape[0], dtype=torch.long)
    for s, n in enumerate(paged.lens):
        for p in range(n):
            pos_of[paged.tables[s][p // BS] * BS + p % BS] = p
    rotated = raw.clone()
    rotary_embedding(pos_of.to(DEV), torch.zeros(raw.shape[0], 1, D, dtype=raw.dtype, device=DEV), rotated, cache, True)

    def through_rotary(q, k_cache, v_cache, tables, seq_lens, qsl, mq, ms, scale):
        lens, starts = seq_lens.tolist(), qsl.tolist()
        pos = torch.cat([torch.arange(lens[i] - (starts[i + 1] - starts[i]), lens[i]) for i in range(len(lens))]).to(DEV)
        slots = torch.cat([tables[i, (pos[starts[i]:starts[i + 1]] // BS).long()].long() * BS
                           + pos[starts[i]:starts[i + 1]] % BS for i in range(len(lens))])
        return fn(pos, q, raw[slots].clone(), v_cache.view(-1, HK, D)[slots].clone(), None, None, 1e-6, cache, True,
                  rotated.view_as(k_cache).clone(), v_cache.clone(), slots, tables, seq_lens, qsl, mq, ms, scale)
    return through_rotary


# the attention variants (turnout/ops/reference/attention_variants.py): a window shorter than a chunk and not a
# multiple of the 32-key blocks, and a soft-cap with per-head sinks
_VARIANTS = {"plain": {}, "window": {"sliding_window": 13},
             "softcap-sinks": {"logit_softcap": 4.0, "sinks": torch.linspace(-2.0, 3.0, HQ)}}


@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("op,impl_id,fn", [p for p in _impls() if p.values[0] in _ATTENTION])
def test_attention_rows_are_the_same_in_any_batch_and_chunking(op, impl_id, fn, variant):
    kw = dict(_VARIANTS[variant])
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].to(DEV)
    for dtype in _dtypes(impl_id):
        gen = torch.Generator().manual_seed(1)
        paged = _Paged([45, 9, 70, 33, 20, 51], getattr(torch, dtype), gen)
        attn = _attention_fn(op, functools.partial(fn, **kw) if kw else fn, paged)
        whole = paged.run(attn, [(0, 0, 45)])[0]  # the followed sequence: one prefill, alone
        ways = {
            "chunks 16+13+16": [paged.run(attn, [(0, a, b)])[0] for a, b in ((0, 16), (16, 29), (29, 45))],
            "prefix hit, 5 new": [whole[:40], paged.run(attn, [(0, 40, 45)])[0]],
            "decode steps": [whole[:41]] + [paged.run(attn, [(0, p, p + 1)])[0] for p in range(41, 45)],
            "batch of 3 rows": [whole[:43], paged.run(attn, [(1, 8, 9), (0, 43, 45)])[1]],
            "batch of 17 rows": [whole[:30], paged.run(attn, [(2, 69, 70), (0, 30, 45), (3, 32, 33)])[1]],
            "batch of 64 rows": [whole[:20], paged.run(attn, [(4, 0, 20), (0, 20, 45), (5, 32, 51)])[1]],
            "prefill among decodes": [paged.run(attn, [(1, 8, 9), (2, 69, 70), (0, 0, 45), (3, 32, 33)])[2]],
        }
        for name, pieces in ways.items():
            got = torch.cat(pieces)
            assert torch.equal(got, whole), (f"{op} {impl_id} {dtype} {name}: differs from the whole prefill by "
                                             f"{(got.float() - whole.float()).abs().max().item():.3g}")


def test_default_implementations_for_contrast():
    """Prints where the untagged implementations the default policy picks give a row different bits."""
    for op in ("linear", "paged_attention", "rms_norm"):
        res = resolve_op(op, REG, PLATFORM, Policy.from_sources(platform=PLATFORM, env={}))
        fn = res.candidate(res.chosen).fn
        if op == "paged_attention":
            gen = torch.Generator().manual_seed(1)
            paged = _Paged([45, 9, 70], torch.float32, gen)
            whole = paged.run(fn, [(0, 0, 45)])[0]
            got = torch.cat([paged.run(fn, [(0, a, b)])[0] for a, b in ((0, 16), (16, 29), (29, 45))])
            print(f"default {op} ({res.chosen}): chunked prefill vs whole, max |diff| "
                  f"{(got - whole).abs().max().item():.3g}")
            continue
        args, rows, run = _row_case(op, torch.float32, torch.Generator().manual_seed(0))
        alone = run(fn, _subset(args, rows, torch.tensor([0], device=DEV)))[0][0]
        diffs = {n: (run(fn, _subset(args, rows, torch.tensor(idx, device=DEV)))[0][where] - alone).abs().max().item()
                 for n, where, idx in _batches(op) if where == 0}
        print(f"default {op} ({res.chosen}): row alone vs row 0 of a batch of n, max |diff| by n: {diffs}")


def test_invariant_policy_clause():
    from turnout.ops import OpUnavailableError, PolicyError, resolve

    pol = Policy.parse("invariant=linear,rms_norm")
    assert pol.invariant == {"linear", "rms_norm"} and not pol.batch_invariant
    assert Policy.parse("invariant=all").batch_invariant and "invariant=all" in Policy.parse("invariant=all").describe()
    table = resolve(PLATFORM, Policy.parse("invariant=linear"), ops=["linear", "rms_norm"])
    assert REG.get_impl("linear", table.chosen("linear")).batch_invariant
    with pytest.raises(PolicyError, match="op names"):
        Policy.parse("invariant=reference.torch")
    with pytest.raises(PolicyError, match="unknown op 'nosuch'"):
        resolve(PLATFORM, Policy.parse("invariant=nosuch"), ops=["linear"])
    with pytest.raises(OpUnavailableError, match=r"op 'rms_norm' on platform .*not batch-invariant"):
        resolve(PLATFORM, Policy.parse("invariant=rms_norm;rms_norm=reference.torch"), ops=["rms_norm"])
