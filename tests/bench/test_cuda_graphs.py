"""The decode CUDA-graph wrapper: bucketing and padding as pure functions, its static-buffer bookkeeping
with an eager stand-in for replay (CPU), the runner's graph path against its eager path on a real tiny
model (CPU), and real capture/replay on a GPU."""

import json

import pytest
import torch

from turnout.layers.attention import AttentionMetadata
from turnout.worker.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets, is_graphable

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 0}


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    b = graph_buckets(256)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256 and all(y - x == 8 for x, y in zip(b[3:], b[4:]))
    assert graph_buckets(4096)[-1] == 1024  # capped (the largest default max_num_seqs)
    b = graph_buckets(1024)  # above 256 in steps of 32: 59 captures
    assert len(b) == 59 and b[34] == 256 and all(y - x == 32 for x, y in zip(b[34:], b[35:]))
    assert graph_buckets(100, max_bucket=32)[-1] == 32


def test_bucket_for():
    b = graph_buckets(40)
    assert [bucket_for(n, b) for n in (1, 2, 3, 5, 8, 9, 17, 39, 40)] == [1, 2, 4, 8, 8, 16, 24, 40, 40]
    assert bucket_for(41, b) is None and bucket_for(0, b) is None


def test_is_graphable():
    b = graph_buckets(16)
    assert is_graphable(4, 4, 4, 1, 3, 8, b)
    assert not is_graphable(5, 4, 4, 2, 3, 8, b)  # a prefill chunk in the batch
    assert not is_graphable(4, 4, 3, 1, 3, 8, b)  # an entry that does not sample
    assert not is_graphable(4, 4, 4, 1, 9, 8, b)  # block table wider than the static one
    assert not is_graphable(17, 17, 17, 1, 3, 8, b)  # larger than every bucket


class _FakeModel:
    """Writes each live token id into a flat 'cache' at its slot; returns (id, pos, seq_len, block 0)."""

    def __call__(self, ids, pos, kv_caches, meta):
        cache = kv_caches[0]
        live = meta.slot_mapping >= 0
        cache[meta.slot_mapping[live]] = ids[live].float()
        assert meta.max_query_len == 1 and meta.query_start_loc.shape[0] == ids.shape[0] + 1
        return torch.stack([ids.float(), pos.float(), meta.seq_lens.float(), meta.block_tables[:, 0].float()], 1)

    def compute_logits(self, h, out=None):
        return h.float() if out is None else out.copy_(h)


class _EagerReplay:
    """Stands in for a captured graph: replay runs the captured function eagerly on the static buffers."""

    def __init__(self, graphs, b, q=1):
        self.graphs, self.b, self.q = graphs, b, q

    def replay(self):
        self.graphs._forward(self.b, self.q)


def _fake_graphs(dg):
    dg.graphs = {b: _EagerReplay(dg, b) for b in dg.buckets}
    dg.multi = {(b, q): _EagerReplay(dg, b, q) for q, sizes in dg.multi_buckets.items() for b in sizes}
    return dg


def _host_batch(ids, lens, tables):
    n = len(ids)
    slots = [t[(L - 1) // 4] * 4 + (L - 1) % 4 for t, L in zip(tables, lens)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32), max_query_len=1,
                             max_seq_len=max(lens))
    return torch.tensor(ids), torch.tensor([L - 1 for L in lens]), meta, slots


def test_run_pads_and_repads():
    cache = torch.full((1000,), -5.0)
    dg = _fake_graphs(DecodeGraphs(_FakeModel(), [cache], max_num_seqs=16, max_model_len=64, block_size=4,
                                   device="cpu"))
    assert dg.max_blocks == 16 and dg.buckets == [1, 2, 4, 8, 16]
    with torch.inference_mode():
        dg._forward(16)  # what capture's warm-up does first: makes the shared logits buffer
    assert (cache == -5).all()  # padding lanes write nowhere
    ids, pos, meta, slots = _host_batch([11, 12, 13, 14, 15], [5, 9, 2, 13, 4],
                                        [[3, 7, 0, 0], [4, 8, 9, 0], [5, 0, 0, 0], [6, 10, 11, 12], [2, 0, 0, 0]])
    assert dg.can_run(5, meta)
    out = dg.run(ids, pos, meta)
    assert out.shape == (5, 4)
    assert out[:, 0].tolist() == [11, 12, 13, 14, 15] and out[:, 2].tolist() == [5, 9, 2, 13, 4]
    assert out[:, 3].tolist() == [3, 4, 5, 6, 2] and out[:, 1].tolist() == [4, 8, 1, 12, 3]
    assert sorted(torch.nonzero(cache != -5)[:, 0].tolist()) == sorted(slots)  # exactly the live slots
    assert (dg.slot_mapping[5:] == -1).all() and (dg.seq_lens[5:] == 1).all()
    # Shrink to 2 lanes: rows 2..4 must be padding again (no stale slot may write into another's block).
    cache.fill_(-5)
    ids, pos, meta, slots = _host_batch([21, 22], [6, 10], [[3, 7, 0], [4, 8, 9]])
    out = dg.run(ids, pos, meta)
    assert out.shape == (2, 4) and out[:, 0].tolist() == [21, 22]
    assert (dg.slot_mapping[2:] == -1).all() and (dg.seq_lens[2:] == 1).all()
    assert sorted(torch.nonzero(cache != -5)[:, 0].tolist()) == sorted(slots)
    # Three lanes: the inputs go up from the pinned buffer of the 5-lane step, whose rows 3..4 must be re-padded.
    cache.fill_(-5)
    ids, pos, meta, slots = _host_batch([31, 32, 33], [7, 3, 11], [[5, 6, 0], [7, 0, 0], [8, 9, 10]])
    out = dg.run(ids, pos, meta)
    assert out[:, 0].tolist() == [31, 32, 33] and out[:, 3].tolist() == [5, 7, 8]
    assert (dg.slot_mapping[3:] == -1).all() and (dg.seq_lens[3:] == 1).all()
    assert sorted(torch.nonzero(cache != -5)[:, 0].tolist()) == sorted(slots)
    assert dg.num_replays == 3
    # Not graphable: a prefill step, a batch wider than the last bucket, a block table too wide.
    _, _, m2, _ = _host_batch([1] * 17, [3] * 17, [[1]] * 17)
    assert not dg.can_run(17, m2)
    _, _, m3, _ = _host_batch([1], [3], [[1] * 17])
    assert not dg.can_run(1, m3)
    m4 = AttentionMetadata(meta.slot_mapping.repeat(2), meta.block_tables, meta.seq_lens, meta.query_start_loc, 2, 10)
    assert not dg.can_run(2, m4)


def test_disabled_wrapper_is_not_used():
    dg = DecodeGraphs(_FakeModel(), [torch.zeros(10)], 4, 16, 4, "cpu")
    _, _, meta, _ = _host_batch([1], [3], [[1]])
    assert not dg.enabled and not dg.can_run(1, meta)
    dg.disabled_reason = "RuntimeError: capture failed"
    st = dg.stats()
    assert st == {"enabled": False, "buckets": [], "capture_s": 0.0, "replays": 0,
                  "disabled_reason": "RuntimeError: capture failed"}
    json.dumps(st)


def _llm(path, **kw):
    from turnout.engine.llm import LLM
    from turnout.entrypoints.bench_models import NullTokenizer

    return LLM(path, tokenizer=NullTokenizer(), **kw)


def _tiny_dir(tmp_path, **over):
    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY, **over}))
    return str(d)


def _spread_weights(model, seed=0):
    """Weights with a wide spread (greedy choices far from ties), in place."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def _generate(llm, prompts, max_tokens):
    from turnout.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1], list(range(10, 30))]
MAX_TOKENS = [6, 10, 14]  # lanes finish at different steps: the batch shrinks 3 -> 2 -> 1


def test_runner_graph_path_matches_eager_cpu(tmp_path):
    """The runner's hook with the wrapper on (replay = eager on the static buffers) gives the same greedy
    tokens as the plain eager path of the same engine: padding, slots and block tables are right."""
    llm = _llm(_tiny_dir(tmp_path), load_format="dummy", dtype="float32", device="cpu", max_model_len=64,
              max_num_seqs=8, kv_cache_memory=1 << 22, block_size=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: eager
    _spread_weights(runner.model)
    eager = _generate(llm, PROMPTS, MAX_TOKENS)
    dg = _fake_graphs(DecodeGraphs(runner.model, runner.kv_caches, 8, runner.max_model_len, runner.block_size,
                                   runner.device))
    runner.graphs = dg
    graphed = _generate(llm, PROMPTS, MAX_TOKENS)
    assert dg.num_replays >= max(MAX_TOKENS) - 1 - 1
    assert graphed == eager


class _Known:
    """A test draft proposer (engine/drafts.py): the next ``k`` tokens of a known continuation per request,
    the one at ``wrong_at`` made wrong."""

    def __init__(self, cont, k, wrong_at=None):
        self.cont, self.k, self.wrong_at = cont, k, wrong_at

    def propose(self, seqs):
        out = {}
        for seq in seqs:
            d = list(self.cont[seq.request_id][seq.num_output_tokens:seq.num_output_tokens + self.k])
            if self.wrong_at is not None and self.wrong_at < len(d):
                d[self.wrong_at] = (d[self.wrong_at] + 1) % TINY["vocab_size"]
            out[seq.seq_id] = d
        return out


def _generate_drafted(engine, proposer, logprobs=None):
    """Greedy tokens (and top logprobs) of PROMPTS with ``proposer`` on the engine core."""
    from turnout.engine.sampling_params import SamplingParams

    engine.core.proposer = proposer
    try:
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            engine.add_request(f"d{i}", p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                          logprobs=logprobs))
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    finally:
        engine.core.proposer = None
    return [done[f"d{i}"] for i in range(len(PROMPTS))]


def _check_drafted_against(engine, want, atol):
    """Right, partly right and wrong drafts of 1..4 tokens give ``want`` (outputs of the eager one-token path)."""
    cont = {f"d{i}": c.token_ids for i, c in enumerate(want)}
    for k in (1, 2, 3, 4):
        for wrong_at in (None, 0):
            got = _generate_drafted(engine, _Known(cont, k, wrong_at), logprobs=3)
            assert [c.token_ids for c in got] == [c.token_ids for c in want], (k, wrong_at)
            for cg, cw in zip(got, want):  # every position's distribution: the one-token steps'
                for eg, ew in zip(cg.logprobs, cw.logprobs):
                    assert list(eg) == list(ew)
                    assert all(abs(eg[t].logprob - ew[t].logprob) <= atol for t in eg)


def test_runner_multi_token_graph_path_matches_eager_cpu(tmp_path):
    """The (batch, query length) graphs with the wrapper on (replay = eager on the static buffers): drafts of
    1..4 tokens, right or wrong, give the eager one-token path's tokens and logprobs: token rows, sequence
    rows, padding sequences of q tokens and the per-q query starts are right."""
    llm = _llm(_tiny_dir(tmp_path), load_format="dummy", dtype="float32", device="cpu", max_model_len=64,
              max_num_seqs=32, kv_cache_memory=1 << 22, block_size=4, enable_prefix_caching=False,
              async_scheduling=False)
    runner, engine = llm.engine.runner, llm.engine
    _spread_weights(runner.model)
    want = _generate_drafted(engine, None, logprobs=3)
    dg = _fake_graphs(DecodeGraphs(runner.model, runner.kv_caches, 32, runner.max_model_len, runner.block_size,
                                   runner.device, max_query_len=5))
    assert sorted(dg.multi_buckets) == [2, 3, 4, 5] and dg.multi_buckets[5] == [1, 2, 4]
    with torch.inference_mode():
        dg._forward(32)  # what capture's warm-up does first: makes the shared logits buffer
    runner.graphs = dg
    _check_drafted_against(engine, want, atol=1e-5)
    assert dg.num_multi_token_replays > 20


@pytest.mark.gpu
def test_cuda_graphs_multi_token_decode_matches_eager(tmp_path):
    """Captured (batch, query length) graphs for 1..1 + 4 tokens: drafts of 1..4 tokens, right or wrong, give
    the tokens of the eager one-token path and its logprobs within float rounding."""
    from turnout.config import EngineConfig
    from turnout.engine.llm_engine import LLMEngine
    from turnout.entrypoints.bench_models import NullTokenizer

    engine = LLMEngine(EngineConfig(model=_tiny_dir(tmp_path), tokenizer=NullTokenizer(), load_format="dummy",
                                    dtype="float32", device="auto", max_model_len=64, max_num_seqs=32,
                                    kv_cache_memory=1 << 24, block_size=16, enable_prefix_caching=False,
                                    num_speculative_tokens=4))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.enabled, getattr(graphs, "disabled_reason", None)
    assert {q for _, q in graphs.multi} == {2, 3, 4, 5}, "multi-token capture failed (see the log)"
    _spread_weights(engine.runner.model)
    engine.runner.graphs = None
    want = _generate_drafted(engine, None, logprobs=3)  # eager, one token a step
    engine.runner.graphs = graphs
    _check_drafted_against(engine, want, atol=1e-4)
    assert graphs.num_multi_token_replays > 20


@pytest.mark.gpu
def test_cuda_graphs_capture_and_match_eager(tmp_path):
    llm = _llm(_tiny_dir(tmp_path), load_format="dummy", dtype="float32", device="auto", max_model_len=64,
              max_num_seqs=8, kv_cache_memory=1 << 24, block_size=16, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.graphs is not None, "graphs were not set up on a GPU"
    assert runner.graphs.enabled, f"capture failed: {runner.graphs.disabled_reason}"
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
    _spread_weights(runner.model)  # in place: the graphs read the same storage
    graphed = _generate(llm, PROMPTS, MAX_TOKENS)
    assert runner.graphs.num_replays > 0
    runner.graphs, saved = None, runner.graphs
    eager = _generate(llm, PROMPTS, MAX_TOKENS)
    runner.graphs = saved
    assert graphed == eager


@pytest.mark.gpu
def test_cuda_graphs_capture_failure_falls_back_to_eager(tmp_path, caplog):
    """The reference paged_attention reads lengths with .tolist() (a host sync): capture must fail, say
    why once, and leave an engine that decodes eagerly with the same tokens as --enforce-eager. (Decode
    attention goes through rotary_paged_attention when a kernel serves it: the reference is chosen for it
    too, so the step reaches the reference paged_attention.)"""
    import logging

    kw = dict(load_format="dummy", dtype="float32", device="auto", max_model_len=64, max_num_seqs=4,
              kv_cache_memory=1 << 24, enable_prefix_caching=False,
              ops_policy="paged_attention=reference.torch;rotary_paged_attention=reference.torch")
    with caplog.at_level(logging.WARNING, logger="turnout.worker.cuda_graphs"):
        llm = _llm(_tiny_dir(tmp_path), **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not graphs.enabled and graphs.disabled_reason
    assert sum("CUDA graphs disabled" in r.message for r in caplog.records) == 1
    _spread_weights(llm.engine.runner.model)
    got = _generate(llm, PROMPTS[:2], MAX_TOKENS[:2])
    assert graphs.num_replays == 0
    eager = _llm(_tiny_dir(tmp_path), enforce_eager=True, **kw)
    _spread_weights(eager.engine.runner.model)
    assert _generate(eager, PROMPTS[:2], MAX_TOKENS[:2]) == got
