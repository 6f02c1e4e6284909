"""The whole engine with tensor_parallel_size=2 on CPU over gloo (the mp executor: rank 0 in this process, rank
1 spawned) against the same engine with one rank: greedy tokens and their logprobs, through chunked prefill
and prefix caching; collective_rpc reaches both ranks; shutdown leaves no worker process."""

from __future__ import annotations

import pytest
import torch
import transformers

from turnout import LLM, SamplingParams


def _prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 320, (20,), generator=g).tolist()  # a prefix shared by two prompts
    return [shared + [5, 6, 7], shared + torch.randint(0, 320, (9,), generator=g).tolist(),
            torch.randint(0, 320, (30,), generator=g).tolist(), [42]]


def _run(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                                   for o in outs]


def _logprob(entry):
    return entry if isinstance(entry, float) else entry.logprob


class _KnownByPrompt:
    """A test draft proposer (engine/drafts.py): the next 3 tokens of a known continuation of each prompt,
    the second of them wrong."""

    def __init__(self, cont):
        self.cont = cont

    def propose(self, seqs):
        out = {}
        for seq in seqs:
            d = list(self.cont[tuple(seq.prompt_token_ids)][seq.num_output_tokens:seq.num_output_tokens + 3])
            if len(d) > 1:
                d[1] = (d[1] + 1) % 320  # the vocabulary of tiny_path
            out[seq.seq_id] = d
        return out


KW = dict(device="cpu", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def reference(tiny_path):
    return _run(LLM(tiny_path, **KW))


def test_llm_tp2_matches_tp1(tiny_path, reference):
    ref_tokens, ref_lps = reference
    llm = LLM(tiny_path, tensor_parallel_size=2, **KW)
    executor = llm.engine.executor
    try:
        tokens, lps = _run(llm)
        assert llm.engine.scheduler.num_prefix_cached_tokens > 0
        # multi-token steps: rank 1 computes the drafts' positions too (the flat step message carries them)
        llm.engine.core.proposer = _KnownByPrompt(dict(zip(map(tuple, _prompts()), reference[0])))
        try:
            drafted, _ = _run(llm)
        finally:
            llm.engine.core.proposer = None
        assert llm.engine.get_stats().accepted_draft_tokens_total > 0
        info = executor.collective_rpc("describe")
        assert [i["rank"] for i in info] == [0, 1] and all(i["tp_size"] == 2 for i in info)
        assert [i["embed_rows"] for i in info] == [160, 160] and [i["num_kv_heads"] for i in info] == [1, 1]
        assert executor.collective_rpc(_loaded_rows) == [(0, 160), (1, 160)]
        pids = [p.pid for p in executor._procs]
    finally:
        executor.shutdown()
    assert tokens == ref_tokens and drafted == ref_tokens
    for a, b in zip(lps, ref_lps):
        assert max(abs(_logprob(x) - _logprob(y)) for x, y in zip(a, b)) < 1e-4
    import os

    for pid in pids:  # the worker processes are gone (reaped by join)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _loaded_rows(worker):
    """A callable collective_rpc ships to every rank: its TP rank and its LM head's vocabulary rows."""
    return worker.tp.rank, int(worker.runner.model.lm_head.weight.shape[0])


def test_tensor_parallel_size_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(None, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(None, tensor_parallel_size=2, distributed_executor_backend="uniproc")


def test_lookahead_steps_under_tp(tiny_path, reference):
    """Async scheduling: a lookahead step's inputs are rank 0's sampled tokens, broadcast to rank 1."""
    llm = LLM(tiny_path, tensor_parallel_size=2, async_scheduling=True, **KW)
    try:
        tokens, _ = _run(llm)
        assert llm.engine.num_lookahead_steps > 0
    finally:
        llm.engine.executor.shutdown()
    assert tokens == reference[0]


def test_cli_flag_reaches_the_config():
    from turnout.entrypoints import cli
    from turnout.entrypoints.openai import serve_cmd

    args = cli.build_parser().parse_args(["serve", "-tp", "2"])
    assert serve_cmd.build_config(args).tensor_parallel_size == 2
    for sub in (["generate", "hi"], ["bench", "latency"]):
        assert cli.build_parser().parse_args([*sub, "--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_a_killed_worker_fails_the_engine_naming_its_rank(tiny_path):
    """No hang: rank 1 killed mid-generation ends the step with an error that names it, in seconds."""
    import os
    import signal
    import threading
    import time

    llm = LLM(tiny_path, tensor_parallel_size=2, device="cpu", kv_cache_memory=4 << 20)
    proc = llm.engine.executor._procs[0]
    timer = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+, exit code -9\) died"):
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        timer.cancel()
        llm.engine.executor.shutdown()


def test_a_shape_that_does_not_split_is_a_start_up_error(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"num_(kv_)?heads 3 is not divisible by tensor-parallel size 2"):
        LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", kv_cache_memory=1 << 20)
