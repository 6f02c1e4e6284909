"""Scheduler driven by a fake model that also simulates the paged KV cache.

The fake "model" writes (token, position) into the slot of every computed token and, before computing,
checks that every earlier position of the sequence reads back its own (token, position) through the block
table: so wrong prefix-cache hits, missed copy-on-writes, blocks shared while written, or blocks given
away too early all show up as wrong reads. The next token is a deterministic function of the tokens and
the sequence's seed, so the outputs must not depend on the batching, the KV budget or preemptions.
"""

import random
import subprocess
import sys

import pytest

from turnout.engine.sampling_params import SamplingParams
from turnout.engine.scheduler import Scheduler
from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.kv.block_manager import BlockManager


def next_token(tokens, seed):
    h = seed * 1_000_003 + len(tokens)
    for t in tokens[-8:]:
        h = (h * 31 + t) % 1_000_000_007
    return h % 997


class FakeEngine:
    def __init__(self, num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
                 prefix_caching=True):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.seqs = {}  # seq_id -> Sequence (all ever seen)
        self.max_tokens = {}
        self.steps = []  # per step: list of (request_id, index, start, num_tokens, sample)
        self.tokens_computed = 0

    def add(self, request_id, prompt, max_tokens=8, n=1, seed=0, arrival=None):
        params = SamplingParams(max_tokens=max_tokens, n=n)
        seq = Sequence(self.sched.new_seq_id(), request_id, prompt, params, seed, n=n,
                       arrival_time=len(self.seqs) if arrival is None else arrival)
        self.sched.add(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def slot(self, seq, pos):
        bs = self.bm.block_size
        return self.kv[seq.block_table[pos // bs]], pos % bs

    def check_invariants(self):
        live = [s for s in self.seqs.values() if not s.status.is_finished]
        refs = {}
        for s in live:
            if s.status == SequenceStatus.WAITING:
                assert not s.block_table and s.num_computed_tokens == 0
            for b in s.block_table:
                refs[b] = refs.get(b, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), block.block_id
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(refs)
        assert len(self.sched.running) <= self.sched.max_num_seqs
        ids = [s.seq_id for s in self.sched.running] + [s.seq_id for s in self.sched.waiting]
        assert len(ids) == len(set(ids)) == len(live)

    def step(self):
        out = self.sched.schedule()
        bs = self.bm.block_size
        assert out.num_batched_tokens == sum(e.num_tokens for e in out.scheduled) <= self.sched.max_num_batched_tokens
        for src, dst in out.copy_on_write:
            self.kv[dst] = list(self.kv[src])
        written = set()
        for i, e in enumerate(out.scheduled):
            # the children forked in this step share the parent's blocks, including those written now
            sharers = 1 + sum(1 for j, _ in out.forks if j == i)
            seq = e.seq
            assert e.start == seq.num_computed_tokens and e.num_tokens >= 1
            assert e.sample == (e.start + e.num_tokens == seq.num_tokens)
            for pos in range(e.start):  # attention reads the cached context
                blk, off = self.slot(seq, pos)
                assert blk[off] == (seq.token_ids[pos], pos), (seq, pos)
            for pos in range(e.start, e.start + e.num_tokens):
                block_id = seq.block_table[pos // bs]
                assert self.bm.blocks[block_id].ref_count == sharers, "writing into a shared block"
                assert (block_id, pos % bs) not in written
                written.add((block_id, pos % bs))
                self.kv[block_id][pos % bs] = (seq.token_ids[pos], pos)
        self.tokens_computed += out.num_batched_tokens
        self.steps.append([(e.seq.request_id, e.seq.index, e.start, e.num_tokens, e.sample) for e in out.scheduled])
        sampled = [(e.seq, next_token(e.seq.token_ids, e.seq.seed)) for e in out.scheduled if e.sample]
        for i, child in out.forks:
            parent = out.scheduled[i].seq
            assert child.token_ids == parent.token_ids and child.request_id == parent.request_id
            self.seqs[child.seq_id] = child
            sampled.append((child, next_token(child.token_ids, child.seed)))
        self.sched.postprocess(out)
        for seq, tok in sampled:
            seq.append_token(tok)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.check_invariants()
        return out

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return self.results()
            self.step()
        raise AssertionError("did not finish")

    def seqs_of(self, request_id):
        return sorted((s for s in self.seqs.values() if s.request_id == request_id), key=lambda s: s.index)

    def results(self):
        return {(s.request_id, s.index): s.output_token_ids for s in self.seqs.values()}


def reference(prompt, max_tokens, seed=0):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, seed))
    return tokens[len(prompt):]


def make_requests(num, seed=0, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(1000) for _ in range(shared_prefix)]
    return [(f"r{i}", prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 20))
            for i in range(num)]


def test_no_torch_import():
    code = ("import sys; import turnout.engine.scheduler, turnout.engine.sequence, turnout.kv.block_manager, "
            "turnout.engine.detokenizer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_request_matches_reference():
    eng = FakeEngine(num_blocks=16)
    eng.add("a", [5, 6, 7, 8, 9], max_tokens=10)
    res = eng.run()
    assert res[("a", 0)] == reference([5, 6, 7, 8, 9], 10)
    assert eng.bm.num_free_blocks == 16


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_tiny_kv_gives_same_outputs(prefix_caching):
    reqs = make_requests(12, seed=1, shared_prefix=6)
    ample = FakeEngine(num_blocks=512, max_num_batched_tokens=64, prefix_caching=prefix_caching)
    tiny = FakeEngine(num_blocks=14, max_num_batched_tokens=64, prefix_caching=prefix_caching)
    for eng in (ample, tiny):
        for rid, prompt, mt in reqs:
            eng.add(rid, prompt, max_tokens=mt)
    a, t = ample.run(), tiny.run()
    assert ample.sched.num_preemptions == 0
    assert tiny.sched.num_preemptions > 0
    assert a == t
    for rid, prompt, mt in reqs:  # nothing lost, nothing duplicated
        assert t[(rid, 0)] == reference(prompt, mt)
    assert tiny.bm.num_free_blocks == 14 and ample.bm.num_free_blocks == 512


def test_preempted_request_goes_to_front_and_keeps_output():
    # 2 requests each growing to 16 tokens = 4 blocks; 6 blocks in all: the newer one must be preempted
    eng = FakeEngine(num_blocks=6, block_size=4)
    old = eng.add("old", [1] * 6, max_tokens=10, arrival=0.0)
    new = eng.add("new", [2] * 6, max_tokens=10, arrival=1.0)
    eng.add("later", [3] * 3, max_tokens=2, arrival=2.0)
    preempted_at = None
    while eng.sched.has_unfinished():
        out = eng.step()
        if out.preempted and preempted_at is None:
            preempted_at = len(eng.steps)
            assert out.preempted == [new]
            assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_table
            assert new.num_output_tokens > 0
            assert eng.sched.waiting[0] is new  # front, before "later"
            assert new not in [e.seq for e in out.scheduled]
    assert preempted_at is not None
    assert old.output_token_ids == reference([1] * 6, 10)
    assert new.output_token_ids == reference([2] * 6, 10)


def test_fcfs_order():
    eng = FakeEngine(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=8)
    for i in range(5):
        eng.add(f"r{i}", [i + 1] * 5, max_tokens=3)
    first_step = {}
    while eng.sched.has_unfinished():
        eng.step()
        for rid, *_ in eng.steps[-1]:
            first_step.setdefault(rid, len(eng.steps))
    order = sorted(first_step, key=lambda r: (first_step[r], r))
    assert order == [f"r{i}" for i in range(5)]
    assert all(len(s) <= 2 for s in eng.steps)


def test_waiting_head_is_not_overtaken():
    eng = FakeEngine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    eng.add("a", [1] * 20, max_tokens=4)  # 5 blocks, later 6
    eng.add("big", [2] * 16, max_tokens=1)  # 4 blocks: does not fit next to "a"
    eng.add("small", [3] * 2, max_tokens=1)  # would fit, must wait behind "big"
    eng.step()
    assert [s[0] for s in eng.steps[0]] == ["a"]
    res = eng.run()
    first = {}
    for i, step in enumerate(eng.steps):
        for rid, *_ in step:
            first.setdefault(rid, i)
    assert first["big"] <= first["small"]
    assert res[("small", 0)] == reference([3] * 2, 1)


def test_chunked_prefill_respects_budget_and_decodes_keep_running():
    eng = FakeEngine(num_blocks=128, block_size=4, max_num_batched_tokens=16)
    for i in range(3):
        eng.add(f"d{i}", [i + 1] * 4, max_tokens=30)
    eng.step()  # the three short prompts: 12 tokens
    assert eng.steps[0] == [(f"d{i}", 0, 0, 4, True) for i in range(3)]
    long_prompt = list(range(100))
    eng.add("long", long_prompt, max_tokens=3)
    chunks = []
    while eng.seqs[3].num_output_tokens == 0:
        eng.step()
        step = eng.steps[-1]
        assert sum(s[3] for s in step) <= 16
        decodes = [s for s in step if s[0].startswith("d")]
        assert len(decodes) == 3 and all(s[3] == 1 and s[4] for s in decodes)  # never starved
        (lng,) = [s for s in step if s[0] == "long"]
        chunks.append(lng[2:])
    starts = [c[0] for c in chunks]
    assert sum(c[1] for c in chunks) == 100 and starts == sorted(starts)
    assert all(c[1] == 13 for c in chunks[:-1]) and chunks[-1][2] and not any(c[2] for c in chunks[:-1])
    res = eng.run()
    assert res[("long", 0)] == reference(long_prompt, 3)
    assert res[("d0", 0)] == reference([1] * 4, 30)


def test_running_partial_prefill_before_waiting():
    eng = FakeEngine(num_blocks=128, block_size=4, max_num_batched_tokens=10)
    eng.add("a", list(range(25)), max_tokens=2)
    eng.add("b", list(range(50, 55)), max_tokens=2)
    eng.step()
    assert eng.steps[0] == [("a", 0, 0, 10, False)]
    eng.step()
    assert eng.steps[1] == [("a", 0, 10, 10, False)]
    eng.step()
    assert eng.steps[2] == [("a", 0, 20, 5, True), ("b", 0, 0, 5, True)]


def test_prefix_cache_hits_reduce_computed_tokens():
    bs = 4
    prefix = list(range(100, 113))  # 13 tokens: 3 full blocks
    p1, p2 = prefix + [1, 2, 3], prefix + [7, 8]

    def run(prefix_caching):
        eng = FakeEngine(num_blocks=64, block_size=bs, prefix_caching=prefix_caching)
        eng.add("a", p1, max_tokens=4)
        eng.step()  # "a" prefilled and registered before "b" arrives
        b = eng.add("b", p2, max_tokens=4)
        res = eng.run()
        return eng, b, res

    on, b_on, res_on = run(True)
    off, b_off, res_off = run(False)
    assert res_on == res_off
    assert b_on.num_cached_tokens == 12 and b_off.num_cached_tokens == 0
    assert on.sched.num_prefix_cached_tokens == 12
    assert on.tokens_computed == off.tokens_computed - 12
    assert on.sched.num_prefill_tokens_computed == off.sched.num_prefill_tokens_computed - 12
    assert on.bm.num_hit_tokens == 12


def test_identical_prompt_computes_at_least_one_token():
    eng = FakeEngine(num_blocks=64, block_size=4)
    eng.add("a", list(range(8)), max_tokens=2)
    eng.run()
    b = eng.add("b", list(range(8)), max_tokens=2)
    eng.step()
    assert b.num_cached_tokens == 4  # block 2 holds the last prompt token: not a hit
    assert eng.steps[-1] == [("b", 0, 4, 4, True)]
    res = eng.run()
    assert res[("b", 0)] == res[("a", 0)]


def test_fork_shares_blocks_and_copies_once():
    bs = 4
    eng = FakeEngine(num_blocks=64, block_size=bs)
    parent = eng.add("a", list(range(10)), max_tokens=5, n=3, seed=11)  # 3 blocks, the last partly full
    out = eng.step()
    assert [i for i, _ in out.forks] == [0, 0]
    children = [c for _, c in out.forks]
    assert [c.index for c in children] == [1, 2] and parent.n == 1
    assert [c.seed for c in children] == [(11 + i * 0x9E3779B97F4A7C15) % 2**63 for i in (1, 2)]
    assert eng.bm.num_free_blocks == 64 - 3
    for c in children:
        assert c.block_table == parent.block_table and c.num_computed_tokens == 10
    assert all(eng.bm.blocks[b].ref_count == 3 for b in parent.block_table)
    original = parent.block_table[2]
    out = eng.step()
    assert len(out.scheduled) == 3 and len(out.copy_on_write) == 2  # n - 1 copies; the last writer keeps it
    assert all(src == original for src, _ in out.copy_on_write)
    assert len({s.block_table[2] for s in [parent] + children}) == 3
    assert [s.block_table[2] for s in [parent] + children].count(original) == 1
    assert eng.bm.blocks[original].ref_count == 1
    assert all(s.block_table[:2] == parent.block_table[:2] for s in children)
    assert all(eng.bm.blocks[b].ref_count == 3 for b in parent.block_table[:2])
    assert eng.bm.num_free_blocks == 64 - 5
    copies = len(out.copy_on_write)
    res = eng.run()
    assert eng.bm.num_copy_on_write == copies == 2
    outs = [res[("a", i)] for i in range(3)]
    assert all(len(o) == 5 for o in outs) and len({tuple(o) for o in outs}) == 3
    for i, seq in enumerate([parent] + children):
        assert outs[i] == reference(list(range(10)), 5, seq.seed)
    assert eng.bm.num_free_blocks == 64


def test_fork_at_block_boundary_needs_no_copy():
    eng = FakeEngine(num_blocks=64, block_size=4)
    eng.add("a", list(range(8)), max_tokens=4, n=2)
    eng.run()
    assert eng.bm.num_copy_on_write == 0


def test_fork_reserves_seats():
    eng = FakeEngine(num_blocks=64, max_num_seqs=4)
    eng.add("a", list(range(5)), max_tokens=3, n=3)
    eng.add("b", list(range(5)), max_tokens=3, n=2)  # 3 + 2 > 4: waits
    out = eng.step()
    assert [e.seq.request_id for e in out.scheduled] == ["a"] and len(out.forks) == 2
    eng.run()
    assert all(len(v) == 3 for v in eng.results().values()) and len(eng.results()) == 5


def test_fork_with_preemption_and_prefix_cache():
    reqs = make_requests(6, seed=3, shared_prefix=5)
    ample, tiny = FakeEngine(num_blocks=512), FakeEngine(num_blocks=12)
    for eng in (ample, tiny):
        for i, (rid, prompt, mt) in enumerate(reqs):
            eng.add(rid, prompt, max_tokens=mt, n=1 + i % 3, seed=i)
    assert ample.run() == tiny.run()
    assert tiny.sched.num_preemptions > 0 and tiny.bm.num_free_blocks == 12


def _abort_and_check(eng, rid):
    seqs = eng.sched.abort(rid)
    assert seqs and all(s.status == SequenceStatus.FINISHED_ABORTED and not s.block_table for s in seqs)
    assert all(s.request_id == rid for s in seqs)
    eng.check_invariants()
    return seqs


@pytest.mark.parametrize("state", ["waiting", "mid_prefill", "decoding", "forked", "preempted", "mid_step"])
def test_abort_frees_every_block(state):
    eng = FakeEngine(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    if state == "waiting":
        eng.add("x", list(range(5)))
        _abort_and_check(eng, "x")
    elif state == "mid_prefill":
        x = eng.add("x", list(range(20)))
        eng.step()
        assert 0 < x.num_computed_tokens < 20
        _abort_and_check(eng, "x")
    elif state == "decoding":
        x = eng.add("x", list(range(5)), max_tokens=20)
        for _ in range(4):
            eng.step()
        assert x.num_output_tokens == 4
        _abort_and_check(eng, "x")
    elif state == "forked":
        eng.add("x", list(range(5)), max_tokens=20, n=4)
        eng.step()
        eng.step()
        assert len(_abort_and_check(eng, "x")) == 4
    elif state == "preempted":
        eng.add("a", list(range(8)), max_tokens=30, arrival=0)
        x = eng.add("x", list(range(8)), max_tokens=30, arrival=1)
        while x.num_preemptions == 0:
            eng.step()
        assert x.status == SequenceStatus.WAITING
        _abort_and_check(eng, "x")
        eng.sched.abort("a")
    elif state == "mid_step":  # aborted between schedule and postprocess
        x = eng.add("x", list(range(5)), max_tokens=20, n=2)
        out = eng.sched.schedule()
        eng.sched.abort("x")
        eng.sched.postprocess(out)
        assert x.num_computed_tokens == 0
    assert eng.bm.num_free_blocks == 16 and eng.bm.usage == 0.0
    assert not eng.sched.has_unfinished()
    # the engine still works afterwards
    eng.add("y", [1, 2, 3], max_tokens=3)
    assert eng.run()[("y", 0)] == reference([1, 2, 3], 3)


def test_add_rejects_impossible_sequences():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ValueError, match=r"need 5 KV blocks.*only 4"):
        sched.add(Sequence(0, "a", list(range(10)), SamplingParams(max_tokens=8), 0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence(1, "b", list(range(65)), SamplingParams(max_tokens=1), 0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add(Sequence(2, "c", [1], SamplingParams(max_tokens=1, n=3), 0, n=3))
    with pytest.raises(ValueError, match="need 16 KV blocks"):  # no max_tokens: up to max_model_len
        sched.add(Sequence(3, "d", [1], None, 0))
    ok = Sequence(4, "e", list(range(10)), SamplingParams(max_tokens=6), 0)
    sched.add(ok)
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Sequence(4, "f", [1], SamplingParams(max_tokens=1), 0))
    assert sched.new_seq_id() == 5


def test_random_stress_with_aborts():
    rng = random.Random(7)
    eng = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    ref = FakeEngine(num_blocks=1024, block_size=4, max_num_seqs=64, max_num_batched_tokens=4096)
    aborted = set()
    for i in range(40):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 25))]  # small vocab: prefix hits happen
        if rng.random() < 0.5:
            prompt = [1, 2, 3, 4, 5, 6, 7, 8] + prompt
        kw = dict(max_tokens=rng.randrange(1, 15), n=rng.choice([1, 1, 2, 3]), seed=i)
        eng.add(f"r{i}", prompt, **kw)
        ref.add(f"r{i}", prompt, **kw)
        for _ in range(rng.randrange(0, 4)):
            if eng.sched.has_unfinished():
                eng.step()
        if rng.random() < 0.15:
            victim = f"r{rng.randrange(i + 1)}"
            if eng.sched.abort(victim):
                aborted.add(victim)
            eng.check_invariants()
    res = eng.run()
    expect = ref.run()
    for key, tokens in expect.items():
        if key[0] not in aborted:
            assert res[key] == tokens, key
    assert eng.sched.num_preemptions > 0 and eng.bm.num_hit_tokens > 0
    assert eng.bm.num_free_blocks == 20


def test_a_sampled_sequence_without_a_new_token_is_an_engine_bug():
    eng = FakeEngine(num_blocks=8)
    eng.add("a", [1, 2, 3])
    out = eng.sched.schedule()
    eng.sched.postprocess(out)  # ... but no append_token, no finish
    with pytest.raises(RuntimeError, match="must append the token or finish"):
        eng.sched.schedule()


# ---- fairness: one request with many samples cannot make everyone else's steps long -----------------

def _per_request(out):
    counts = {}
    for e in out.scheduled:
        counts[e.seq.request_id] = counts.get(e.seq.request_id, 0) + 1
    return counts


def test_a_wide_request_runs_at_most_the_fair_share_while_others_have_work():
    eng = FakeEngine(num_blocks=400, max_num_seqs=64, max_num_batched_tokens=256)
    eng.sched.fair_share_seqs = 4
    eng.add("big", [1, 2, 3, 4, 5], max_tokens=30, n=32)
    eng.step()  # prefill + fork: 32 samples running
    big = [s for s in eng.seqs.values() if s.request_id == "big"]
    assert len(big) == 32
    assert _per_request(eng.step())["big"] == 32, "alone, a request runs at full width"
    eng.add("short", [9, 8, 7], max_tokens=4)
    steps_before = len(eng.steps)
    while not eng.seqs_of("short")[0].status.is_finished:
        out = eng.step()
        counts = _per_request(out)
        assert counts.get("big", 0) <= 4, counts  # cap = max(fair share 4, the short request's 1)
        assert counts.get("short", 0) == 1, "the short request computes every step"
        outs = [s.num_output_tokens for s in big if not s.status.is_finished]
        assert max(outs) - min(outs) <= 2, "the wide request's samples take turns"
    assert len(eng.steps) - steps_before == 4, "prefill + first token, then one token a step"
    res = eng.run()
    for i in range(32):
        s = eng.seqs_of("big")[i]
        assert res[("big", i)] == reference(s.prompt_token_ids, 30, s.seed), "the tokens do not depend on the cap"
    assert res[("short", 0)] == reference([9, 8, 7], 4)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_two_wide_requests_both_run_at_full_width():
    eng = FakeEngine(num_blocks=400, max_num_seqs=64, max_num_batched_tokens=256)
    eng.sched.fair_share_seqs = 4
    eng.add("a", [1, 2, 3], max_tokens=10, n=16)
    eng.add("b", [4, 5, 6], max_tokens=10, n=16)
    eng.step()
    out = eng.step()
    assert _per_request(out) == {"a": 16, "b": 16}  # each capped by the other's 16, not by 4


def test_without_a_fair_share_nothing_is_capped():
    eng = FakeEngine(num_blocks=400, max_num_seqs=64, max_num_batched_tokens=256)
    assert eng.sched.fair_share_seqs is None
    eng.add("big", [1, 2, 3, 4, 5], max_tokens=30, n=32)
    eng.step()
    eng.add("short", [9, 8, 7], max_tokens=4)
    out = eng.step()
    assert _per_request(out) == {"big": 32, "short": 1}


def test_preemption_takes_from_the_request_over_its_share_first():
    eng = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=32, max_num_batched_tokens=64)
    eng.sched.fair_share_seqs = 2
    eng.add("big", [1, 2, 3, 4], max_tokens=20, n=8)
    eng.step()
    eng.add("short", [7, 7, 7, 7, 7, 7, 7], max_tokens=40)  # newest: preempted first without fairness
    eng.step()
    short = eng.seqs_of("short")[0]
    while not short.status.is_finished:
        eng.step()
        assert short.num_preemptions == 0, "the short request kept its blocks"
    assert eng.sched.num_preemptions > 0, "the cache was short while both ran"
    eng.run()
    res = eng.results()
    assert res[("short", 0)] == reference([7] * 7, 40)
    for s in eng.seqs_of("big"):
        assert res[("big", s.index)] == reference(s.prompt_token_ids, 20, s.seed)
