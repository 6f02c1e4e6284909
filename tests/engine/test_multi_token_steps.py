"""Multi-token steps: a sequence computes its next token and k drafts in one step, and keeps the drafts the
model's own draws confirm plus its next draw (worker/step.py). Checked against the one-token path of the same
engine: the k + 1 positions' distributions equal k + 1 one-token steps' (through the typed step contract,
the rank alone), and generation with right, wrong and partly right drafts gives exactly the tokens,
logprobs, stops and seeded samples it gives without drafts, in fewer steps when the drafts are right."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.worker.step import NewRequest, SampleRequest, SamplingSpec, ScheduledRequest, SchedulerOutput  # noqa: E402

V = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("qwen3_multi_token")
    model.save_pretrained(d, safe_serialization=True)
    return str(d)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, kv_cache_memory=4 << 20, async_scheduling=False)


PROMPT = [5, 17, 33, 2, 71, 40, 8, 8, 61, 19, 44]


class _Rank:
    """Drives the engine's rank directly through the step contract (the engine holds no request meanwhile)."""

    def __init__(self, runner, req_id: int, first_block: int):
        self.runner, self.req_id = runner, req_id
        bs = runner.block_size
        self.blocks = list(range(first_block, first_block + 64 // bs + 1))
        self.num_out = 0

    def step(self, start: int, token_ids: list[int], drafts=(), new=False):
        spec = SamplingSpec(temperature=0.0, logprobs=V)  # every token's logprob: the whole distribution
        step = SchedulerOutput(
            scheduled=[ScheduledRequest(self.req_id, start, len(token_ids), list(token_ids), (self.blocks,), True,
                                        list(drafts))],
            samples=[SampleRequest(self.req_id, 0, self.num_out)],
            new_requests=[NewRequest(self.req_id, f"r{self.req_id}", 0, PROMPT, spec)] if new else [],
            want_logprobs=V)
        got = self.runner.execute(step).output()
        assert got.req_ids == [self.req_id] and not got.faults
        self.num_out += len(got.token_ids[0])
        dists = [torch.tensor([lp for _, lp in sorted(top)]) for top in got.top[0]]  # by token id
        return got.token_ids[0], dists


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_k_known_tokens_in_one_step_give_the_logits_of_k_one_token_steps(llm, k):
    runner = llm.engine.runner
    one = _Rank(runner, 10_000 + k, first_block=1)
    (tok,), _ = one.step(0, PROMPT, new=True)
    tokens, dists = [tok], []
    for i in range(k + 1):  # k + 1 one-token steps: the reference
        (nxt,), (d,) = one.step(len(PROMPT) + i, [tokens[-1]])
        tokens.append(nxt)
        dists.append(d)
    multi = _Rank(runner, 20_000 + k, first_block=20)
    (tok2,), _ = multi.step(0, PROMPT, new=True)
    assert tok2 == tokens[0]
    # the first token and the k after it as drafts, all right: every draw is kept, k + 1 distributions
    got, got_dists = multi.step(len(PROMPT), [tokens[0]], drafts=tokens[1:k + 1])
    assert got == tokens[1:k + 2]
    assert len(got_dists) == k + 1
    for want, have in zip(dists, got_dists):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    # a wrong draft at j: the draws up to j are kept, then the model's own (j + 1 tokens)
    for j in range(k):
        bad = _Rank(runner, 30_000 + 10 * k + j, first_block=40)
        bad.step(0, PROMPT, new=True)
        drafts = list(tokens[1:k + 1])
        drafts[j] = (drafts[j] + 1) % V
        got, got_dists = bad.step(len(PROMPT), [tokens[0]], drafts=drafts)
        assert got == tokens[1:j + 2]
        for want, have in zip(dists, got_dists):
            torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    runner.update_requests(SchedulerOutput(finished_req_ids=list(runner.requests)))
    assert llm.engine.block_manager.reset_prefix_cache()  # the blocks written here hold no cached prefix


class Known:
    """A test proposer: drafts the next ``k`` tokens of a known continuation of each request (shifted by
    ``wrong`` at draft ``wrong_at``: a wrong guess there), and counts the drafts it made."""

    def __init__(self, continuation: dict[str, list[int]], k: int, wrong_at: int | None = None, wrong: int = 1):
        self.cont, self.k, self.wrong_at, self.wrong = continuation, k, wrong_at, wrong
        self.proposed = 0

    def propose(self, seqs):
        out = {}
        for seq in seqs:
            cont = self.cont.get(seq.request_id, [])
            d = list(cont[seq.num_output_tokens:seq.num_output_tokens + self.k])
            if self.wrong_at is not None and self.wrong_at < len(d):
                d[self.wrong_at] = (d[self.wrong_at] + self.wrong) % V
            self.proposed += len(d)
            out[seq.seq_id] = d
        return out


def _generate(llm, prompts, params, proposer=None):
    """(outputs, engine steps) of one generate() call with ``proposer`` on the engine core."""
    eng = llm.engine
    eng.core.proposer = proposer
    steps = 0
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"q{i}", p, sp)
        done = {}
        while eng.has_unfinished_requests():
            steps += 1
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
    finally:
        eng.core.proposer = None
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "every block is free once all requests ended"
    return [done[f"q{i}"] for i in range(len(prompts))], steps


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _same_logprobs(got, want):
    """Logprobs equal up to float rounding: k + 1 positions in one forward are other GEMM shapes than one."""
    for g, w in zip(got, want):
        for cg, cw in zip(g.outputs, w.outputs):
            assert len(cg.logprobs) == len(cw.logprobs)
            for eg, ew in zip(cg.logprobs, cw.logprobs):
                assert list(eg) == list(ew)  # the same tokens, in the same order
                for t in eg:
                    assert abs(eg[t].logprob - ew[t].logprob) < 1e-4 and eg[t].rank == ew[t].rank


PROMPTS = [PROMPT, [3, 9, 27, 81, 50], list(range(40, 77))]


def _continuations(outs):
    return {f"q{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafts_right_wrong_or_partly_right_give_the_same_output(llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=7 + i, max_tokens=24, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    want, plain_steps = _generate(llm, PROMPTS, params)
    cont = _continuations(want)
    right, right_steps = _generate(llm, PROMPTS, params, Known(cont, 4))
    assert _summary(right) == _summary(want)
    _same_logprobs(right, want)
    assert right_steps < plain_steps - 10  # up to 5 tokens a step instead of 1
    stats = llm.engine.get_stats()
    assert stats.accepted_draft_tokens_total > 0
    for wrong_at in (0, 2):
        got, _ = _generate(llm, PROMPTS, params, Known(cont, 4, wrong_at=wrong_at))
        assert _summary(got) == _summary(want)
        _same_logprobs(got, want)


def test_stops_and_max_tokens_inside_an_accepted_list(llm):
    base, _ = _generate(llm, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3)
    cont = _continuations(base)
    stop_tok = cont["q0"][6]  # a token drawn mid-continuation: the step that draws it has drafts after it
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=9, ignore_eos=True,
                             stop_token_ids=[cont["q2"][3], cont["q2"][11]])]
    want, _ = _generate(llm, PROMPTS, params)
    got, _ = _generate(llm, PROMPTS, params, Known(cont, 4))
    assert _summary(got) == _summary(want)
    assert got[0].outputs[0].finish_reason == "stop" and got[1].outputs[0].token_ids == cont["q1"][:7]


def test_stop_strings_inside_an_accepted_list():
    llm = LLM(async_scheduling=False)  # the embedded SmolLM2: real text
    prompt = llm.engine.encode("The capital of France is")
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base, _ = _generate(llm, [prompt], [sp])
    text = base[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle of the text
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])]
    want, _ = _generate(llm, [prompt], params)
    got, _ = _generate(llm, [prompt], params, Known(_continuations(base), 4))
    assert _summary(got) == _summary(want)
    assert got[0].outputs[0].finish_reason == "stop" and stop not in got[0].outputs[0].text


def test_scheduler_reserves_caps_and_trims_draft_slots():
    """The scheduler's half, no model: drafts get slots within the step's budget, max_tokens and
    max_model_len; a cache without room runs the step without them (no preemption for a guess); kept drafts
    count as computed and the blocks reserved only for rejected ones go back."""
    from turnout.engine.scheduler import Scheduler
    from turnout.engine.sequence import Sequence
    from turnout.kv.block_manager import BlockManager

    def decoding(sched, prompt_lens, max_tokens):
        seqs = [Sequence(i, f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), seed=0)
                for i, n in enumerate(prompt_lens)]
        for seq in seqs:
            sched.add(seq)
        sched.postprocess(sched.schedule())
        for seq in seqs:
            seq.append_token(7)  # its first draw: now decoding
        return seqs

    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20)
    (seq,) = decoding(sched, [6], max_tokens=10)  # 7 tokens, 6 computed, 2 blocks
    out = sched.schedule({0: [11, 12, 13, 14]})
    (entry,) = out.scheduled
    assert (entry.start, entry.num_tokens, entry.draft_token_ids) == (6, 1, [11, 12, 13, 14])
    assert out.num_batched_tokens == 5 and len(seq.block_table) == 3  # slots up to position 10
    sched.postprocess(out)
    assert seq.num_computed_tokens == 7
    for tok in (11, 99):  # the rank kept draft 11 and drew 99 after it
        seq.append_token(tok)
    sched.accept_drafts(entry, 1)
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == bm.blocks_for(seq.num_tokens) == 3
    assert bm.num_free_blocks == 8 - 3
    # capped by max_tokens: 3 output tokens of 10, so 6 drafts at most (the draw after them is the 10th)
    out = sched.schedule({0: list(range(20, 30))})
    assert out.scheduled[0].draft_token_ids == list(range(20, 26)) and len(seq.block_table) == 4
    sched.postprocess(out)
    seq.append_token(5)
    sched.accept_drafts(out.scheduled[0], 0)  # every draft rejected: back to the blocks its tokens need
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == bm.blocks_for(10) == 3
    # capped by max_model_len (20) and the step's budget (8 tokens)
    sched2 = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20)
    decoding(sched2, [16, 3], max_tokens=None)
    sched2.max_num_batched_tokens = 8
    out = sched2.schedule({0: list(range(10)), 1: list(range(10))})
    by_id = {e.seq.seq_id: e for e in out.scheduled}
    assert len(by_id[0].draft_token_ids) == 20 - 17 - 1 and len(by_id[1].draft_token_ids) == 8 - 3 - 1
    assert out.num_batched_tokens == 8
    # a cache without room for the drafts: the step runs its one token, and preempts no one for a guess
    sched3 = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    decoding(sched3, [7, 7], max_tokens=None)  # 2 blocks each: the cache is full
    out = sched3.schedule({0: [1, 2, 3], 1: [1]})
    assert [e.draft_token_ids for e in out.scheduled] == [[], []] and not out.preempted
    assert [e.num_tokens for e in out.scheduled] == [1, 1]
