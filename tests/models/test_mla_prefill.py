"""Latent attention's decompressed prefill (turnout/layers/mla_prefill.py) against the absorbed path and transformers,
on the tiny float32 V2-Lite-, V3- and GLM-4-MoE-Lite-shaped checkpoints of test_mla_vs_hf.py:

- a packed step of three whole prompts (scattered block tables), forced absorbed and forced decompressed: logits at
  every position within 1e-4 of transformers';
- chunked prefill over the cached prefix, each chunk forced down one path, with a decode sequence in the same step
  (the plan splits the step): every chunk's logits within 1e-4 of transformers';
- an fp8 latent cache: the decompressed prefill reads the same quantised rows as the absorbed one (logits within
  1e-4 of each other);
- the Triton kernels (interpreter) in the model: within 1e-4 of transformers;
- through the engine with TURNOUT_MLA_PREFILL forced each way: chunked prefill and prefix hits, 12 greedy tokens
  identical to transformers' ``generate`` (test_mla_vs_hf.py's engine tests run the default, auto, choice);
- the FLOPs rule and the plan's split.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_mla_vs_hf import BLOCK, KW, build_hf, decisive_prompts, prompts  # noqa: E402
from turnout import LLM, SamplingParams, envs  # noqa: E402
from turnout.kv.spec import CacheLayout  # noqa: E402
from turnout.layers.attention import AttentionMetadata  # noqa: E402
from turnout.layers.fusion import FusionPlan  # noqa: E402
from turnout.layers.mla_prefill import (  # noqa: E402
    DECOMPRESS_WORKSPACE_BYTES,
    LatentDims,
    decompress_pays,
    plan_latent_prefill,
)  # noqa: E402
from turnout.loader import load_model  # noqa: E402
from turnout.ops import Policy, resolve  # noqa: E402
from turnout.platforms.detect import detect_platform  # noqa: E402
from turnout.worker.kv_sizing import allocate_caches  # noqa: E402

KINDS = ("v2_lite", "v3", "glm4_moe_lite")
MODES = ("absorbed", "decompressed")
STEPS = 12  # greedy tokens through the engine (test_mla_vs_hf.py runs 32 on the default, auto, path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf = build_hf(kind)
        hf.save_pretrained(path)
        out[kind] = (str(path), hf)
    return out


def _model(path, mode, policy=None):
    ops = resolve(detect_platform("cpu"), policy) if policy is not None else resolve(detect_platform("cpu"))
    return load_model(path, dtype=torch.float32, device="cpu", ops=ops, plan=FusionPlan(mla_prefill=mode)).model


class Paged:
    """A scattered paged latent cache for a few sequences, and the metadata of steps over it."""

    def __init__(self, model, lengths, cache_dtype="float32", seed=0):
        self.blocks = [-(-n // BLOCK) for n in lengths]
        nb = sum(self.blocks) + 2
        self.caches = allocate_caches(CacheLayout(tuple(model.kv_specs(cache_dtype))), nb, BLOCK, 1, "cpu")
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
        self.tables = torch.zeros(len(lengths), max(self.blocks), dtype=torch.int32)
        k = 0
        for i, n in enumerate(self.blocks):
            self.tables[i, :n] = perm[k:k + n]
            k += n

    def step(self, spans):
        """spans: (sequence, start, count) of each entry -> (positions, meta)."""
        pos, slots, qsl, lens = [], [], [0], []
        for b, start, count in spans:
            p = list(range(start, start + count))
            pos += p
            slots += [int(self.tables[b, j // BLOCK]) * BLOCK + j % BLOCK for j in p]
            qsl.append(qsl[-1] + count)
            lens.append(start + count)
        rows = [b for b, _, _ in spans]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=self.tables[rows],
                                 seq_lens=torch.tensor(lens, dtype=torch.int32),
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 max_query_len=max(c for _, _, c in spans), max_seq_len=max(lens),
                                 seq_lens_host=tuple(lens), query_start_loc_host=tuple(qsl))
        return torch.tensor(pos), meta


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _close(ours, theirs, what):
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-4 * theirs.abs().max().item(), f"{what}: max |diff| {err:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_packed_prefill_both_paths_equal_transformers(kind, checkpoints):
    path, hf = checkpoints[kind]
    ps = prompts()
    theirs = torch.cat([_hf_logits(hf, p) for p in ps])
    for mode in MODES:
        model = _model(path, mode)
        paged = Paged(model, [len(p) for p in ps])
        pos, meta = paged.step([(b, 0, len(p)) for b, p in enumerate(ps)])
        plan = plan_latent_prefill(meta, mode, model.model.layers[0].self_attn.latent_dims)
        assert (plan is None) == (mode == "absorbed")
        with torch.inference_mode():
            ours = model.compute_logits(model(torch.tensor(sum(ps, [])), pos, paged.caches, meta))
        _close(ours, theirs, f"{kind} {mode}")


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_over_the_cached_prefix_each_path_with_a_decode_alongside(kind, checkpoints):
    """Sequence 0 (39 tokens) prefilled in chunks of 16, 7, 16, the chunks alternating between the two paths (each
    reads the prefix the other cached); sequence 1 decodes one token a step in the same steps."""
    path, hf = checkpoints[kind]
    long, short = prompts(2, seed=11)[0], prompts(1, seed=3)[0][:6]
    long = (long * 3)[:39]
    extra = [5, 9, 17]  # sequence 1's next tokens (any ids: teacher-forced)
    models = {mode: _model(path, mode) for mode in MODES}
    a = models["absorbed"]
    paged = Paged(a, [len(long), len(short) + len(extra)], seed=3)
    with torch.inference_mode():  # sequence 1's prompt first, whole (weights shared: both models are the same)
        pos, meta = paged.step([(1, 0, len(short))])
        a(torch.tensor(short), pos, paged.caches, meta)
    want_long, want_short = _hf_logits(hf, long), _hf_logits(hf, short + extra)
    start, seq1 = 0, len(short)
    for i, count in enumerate((16, 7, 16)):
        mode = MODES[(i + 1) % 2]  # decompressed, absorbed, decompressed
        pos, meta = paged.step([(1, seq1, 1), (0, start, count)])  # the decode entry first: the plan splits
        plan = plan_latent_prefill(meta, mode, a.model.layers[0].self_attn.latent_dims)
        if mode == "decompressed":
            assert plan.tokens.tolist() == list(range(1, count + 1)) and plan.absorbed_tokens.tolist() == [0]
        ids = torch.tensor([extra[i]] + long[start:start + count])
        with torch.inference_mode():
            ours = models[mode].compute_logits(models[mode](ids, pos, paged.caches, meta))
        _close(ours[1:], want_long[start:start + count], f"{kind} chunk {i} {mode}")
        _close(ours[0], want_short[seq1], f"{kind} decode beside chunk {i}")
        start, seq1 = start + count, seq1 + 1


def test_fp8_latent_cache_decompressed_reads_what_absorbed_reads(checkpoints):
    path, _ = checkpoints["v3"]
    ps = prompts(3, seed=2)
    fp8 = Policy.parse("kv_cache=fp8", source="test")
    logits = {}
    for mode in MODES:
        model = _model(path, mode, fp8)
        paged = Paged(model, [len(p) for p in ps], cache_dtype="float8_e4m3fn")
        assert paged.caches[0][0].dtype == torch.float8_e4m3fn
        for layer in model.model.layers:  # a scale other than 1: the decompressed path must apply it too
            layer.self_attn.kv_scale.data.fill_(0.05)
        pos, meta = paged.step([(b, 0, len(p)) for b, p in enumerate(ps)])
        with torch.inference_mode():
            logits[mode] = model.compute_logits(model(torch.tensor(sum(ps, [])), pos, paged.caches, meta))
    _close(logits["decompressed"], logits["absorbed"], "fp8 latent cache")


def test_through_the_triton_kernels(checkpoints):
    """The gather and the attention on their Triton kernels (the interpreter here) in the V3-shaped model: a
    prefill, then a chunk over it, within 1e-4 of transformers."""
    path, hf = checkpoints["v3"]
    policy = Policy.parse("mla_gather_cache=triton.default;varlen_attention=triton.default", source="test")
    model = _model(path, "decompressed", policy)
    assert model.ops.chosen("varlen_attention") == "triton.default"
    ids = (prompts(1, seed=9)[0] * 2)[:30]
    paged = Paged(model, [len(ids)])
    want = _hf_logits(hf, ids)
    with torch.inference_mode():
        for start, count in ((0, 18), (18, 12)):
            pos, meta = paged.step([(0, start, count)])
            ours = model.compute_logits(model(torch.tensor(ids[start:start + count]), pos, paged.caches, meta))
            _close(ours, want[start:start + count], f"triton chunk at {start}")


@pytest.fixture(scope="module")
def engine_case(checkpoints):
    """Prompts (one of 35 tokens twice: the second run hits two cached blocks; one other) and transformers'
    greedy tokens for them."""
    _, hf = checkpoints["v3"]
    shared = prompts(1, seed=6)[0][:5] * 7
    ps = [shared, prompts(1, seed=8)[0]]
    want = []
    for p in ps:
        with torch.no_grad():
            want.append(hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
                                    pad_token_id=0, eos_token_id=None)[0, len(p):].tolist())
    return ps, want


@pytest.mark.parametrize("mode", MODES)
def test_engine_chunked_prefill_and_prefix_hits_greedy_equal_transformers(mode, checkpoints, engine_case,
                                                                          monkeypatch):
    monkeypatch.setenv("TURNOUT_MLA_PREFILL", mode)
    envs.reload()
    path, _ = checkpoints["v3"]
    ps, want = engine_case
    llm = LLM(path, max_num_batched_tokens=16, **KW)  # prompts up to 40 tokens: chunks of 16
    assert llm.engine.runner.model.mla_prefill == mode
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    first = llm.generate(ps[:1], params, use_tqdm=False)[0]
    again, other = llm.generate(ps, params, use_tqdm=False)  # the shared prompt again, with another beside it
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert [list(o.outputs[0].token_ids) for o in (first, again, other)] == [want[0], want[0], want[1]]


def test_the_flops_rule_and_the_plan():
    v3 = LatentDims(kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)
    assert decompress_pays(2, 2, v3) and decompress_pays(8192, 8192, v3)  # a fresh prompt: nothing to repeat
    assert not decompress_pays(1, 4096, v3)  # a decode step
    # a chunk over a cached prefix: the absorbed FLOPs weigh ABSORBED_FLOP_COST each (measured on an H100)
    assert not decompress_pays(16, 10000, v3) and decompress_pays(64, 10000, v3)  # crossover near 33 tokens
    tables = torch.zeros(3, 4, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.arange(14), block_tables=tables,
                             seq_lens=torch.tensor([40, 9, 12], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1, 3, 14], dtype=torch.int32), max_query_len=11,
                             max_seq_len=40, seq_lens_host=(40, 9, 12), query_start_loc_host=(0, 1, 3, 14))
    plan = plan_latent_prefill(meta, "decompressed", v3)
    assert plan.tokens.tolist() == list(range(1, 14)) and plan.key_start_loc.tolist() == [0, 9, 21]
    assert plan.query_start_loc.tolist() == [0, 2, 13] and plan.total_keys == 21
    assert plan.absorbed_tokens.tolist() == [0] and plan.absorbed_meta.seq_lens.tolist() == [40]
    assert plan_latent_prefill(meta, "absorbed", v3) is None
    # without host copies of the lengths (a CUDA graph's capture) nothing is planned: absorbed, no device sync
    no_host = AttentionMetadata(slot_mapping=meta.slot_mapping, block_tables=tables, seq_lens=meta.seq_lens,
                                query_start_loc=meta.query_start_loc, max_query_len=11, max_seq_len=40)
    assert plan_latent_prefill(no_host, "decompressed", v3) is None
    with pytest.raises(ValueError, match="mla_prefill"):
        FusionPlan(mla_prefill="mha")
    # the decompressed keys and values of a step are bounded in bytes (16 heads of DeepSeek's shape in bf16: 34k
    # keys); a sequence past the bound runs absorbed
    per_key = 2 * (576 + 16 * (2 * 128 + 64 + 128))
    assert LatentDims(512, 64, 128, 128, num_heads=16, elem_bytes=2).max_keys == DECOMPRESS_WORKSPACE_BYTES // per_key
    narrow = LatentDims(512, 64, 128, 128, num_heads=20000)
    assert narrow.max_keys == DECOMPRESS_WORKSPACE_BYTES // (2 * (576 + 20000 * 448)) == 29
    two = AttentionMetadata(slot_mapping=torch.arange(35), block_tables=tables[:2],
                            seq_lens=torch.tensor([20, 15], dtype=torch.int32),
                            query_start_loc=torch.tensor([0, 20, 35], dtype=torch.int32), max_query_len=20,
                            max_seq_len=20, seq_lens_host=(20, 15), query_start_loc_host=(0, 20, 35))
    plan = plan_latent_prefill(two, "decompressed", narrow)
    assert plan.total_keys == 20 and plan.absorbed_tokens.tolist() == list(range(20, 35))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bf16_both_paths_near_transformers(kind, checkpoints):
    """On the GPU's op table (Triton gather and varlen attention) in bfloat16: three packed prompts down each path,
    last-position logits near transformers' bf16 and near each other."""
    import copy

    path, hf = checkpoints[kind]
    ps = decisive_prompts(hf)  # bf16 against bf16: prompts whose routing no rounding step flips
    peer = copy.deepcopy(hf).to("cuda", torch.bfloat16)
    with torch.no_grad():
        theirs = torch.stack([peer(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu() for p in ps])
    del peer
    got = {}
    for mode in MODES:
        model = load_model(path, dtype=torch.bfloat16, device="cuda", ops=resolve(detect_platform("cuda")),
                           plan=FusionPlan(mla_prefill=mode)).model
        assert model.ops.chosen("varlen_attention") == "triton.default"
        lens = [len(p) for p in ps]
        nb = [-(-n // BLOCK) for n in lens]
        caches = allocate_caches(CacheLayout(tuple(model.kv_specs("bfloat16"))), sum(nb), BLOCK, 1, "cuda")
        tables = torch.zeros(len(ps), max(nb), dtype=torch.int32)
        starts = [0]
        for i, n in enumerate(nb):
            tables[i, :n] = torch.arange(starts[-1], starts[-1] + n)
            starts.append(starts[-1] + n)
        slots = [int(tables[b, j // BLOCK]) * BLOCK + j % BLOCK for b, n in enumerate(lens) for j in range(n)]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device="cuda"), block_tables=tables.cuda(),
                                 seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
                                 max_query_len=max(lens), max_seq_len=max(lens), seq_lens_host=tuple(lens),
                                 query_start_loc_host=tuple(qsl))
        pos = torch.tensor([j for n in lens for j in range(n)], device="cuda")
        with torch.inference_mode():
            out = model.compute_logits(model(torch.tensor(sum(ps, []), device="cuda"), pos, caches, meta))
        got[mode] = out[torch.tensor(qsl[1:]) - 1].float().cpu()
    for mode, ours in got.items():
        assert (ours - theirs).abs().max() <= 3e-2 * theirs.abs().max(), mode
    assert (got["absorbed"] - got["decompressed"]).abs().max() <= 3e-2 * theirs.abs().max()
