"""Tensor-parallel engines one after another in one process (CPU, gloo; RL scripts and notebooks re-create
engines): after ``shutdown()``, a ``with`` block, a dropped and collected LLM, or a plain ``del``, the next
``LLM(..., tensor_parallel_size=2)`` starts and greedily generates the same tokens; each one's worker process is
gone and the process group left."""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

from turnout import LLM, SamplingParams

KW = dict(device="cpu", kv_cache_memory=4 << 20, max_num_seqs=4, tensor_parallel_size=2)
PROMPTS = [[5, 17, 42, 8, 91, 3], [11, 2, 77]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _gone(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_tp_engines_one_after_another(tiny_path):
    with LLM(tiny_path, **KW) as llm:  # 1. a with block: shutdown() on leaving it
        want = _tokens(llm)
        pids = [p.pid for p in llm.engine.executor._procs]
    assert not dist.is_initialized() and _gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        _tokens(llm)
    llm.shutdown()  # idempotent

    got, pids = _generate_and_drop(tiny_path)  # 2. dropped without shutdown(), then collected
    assert got == want
    gc.collect()
    assert not dist.is_initialized() and _gone(pids)

    _, pids = _generate_and_drop(tiny_path)  # 3. dropped, and the next one made at once (not yet collected)
    llm = LLM(tiny_path, **KW)
    try:
        got = _tokens(llm)
        assert _gone(pids) and got == want
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def _generate_and_drop(tiny_path):
    """An LLM used, then dropped with this frame (an engine's parts refer to each other: only the collector frees
    it). Not in the test's frame: pytest's assertion rewriting calls locals(), whose snapshot of the frame would
    keep the engine alive past a `del`."""
    llm = LLM(tiny_path, **KW)
    return _tokens(llm), [p.pid for p in llm.engine.executor._procs]


def test_a_live_tp_engine_is_named_not_a_torch_error(tiny_path):
    """Two alive at once cannot share the process's one default group: a clear error, the first unharmed."""
    with LLM(tiny_path, **KW) as llm:
        with pytest.raises(RuntimeError, match="shutdown"):
            LLM(tiny_path, **KW)
        got = _tokens(llm)
        assert len(got) == len(PROMPTS)
