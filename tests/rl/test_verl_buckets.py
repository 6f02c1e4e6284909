"""verl's colocated bucket transport, turnout's two ends (turnout/integrations/verl/buckets.py) without verl or
Ray: a trainer in its own process sends a perturbed model in 32 KiB buckets (CUDA IPC on a GPU, a shared-memory
segment on the host); the engine rank receives through ``collective_rpc``; its greedy tokens are then HF's on
the perturbed weights. Needs pyzmq (turnout's ``verl`` extra): skipped without it. tests/rl/test_verl_plugin.py
runs the same transport under verl's own classes and sender."""

import multiprocessing as mp
import time

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (turnout[verl])")

from ipc_trainer import bucket_trainer_main, perturbed  # noqa: E402
from test_rl_rollout import GREEDY, PROMPTS, _dense_config, _hf_greedy, _save  # noqa: E402
from turnout import LLM  # noqa: E402
from turnout.integrations.verl.buckets import receive_buckets_rank  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_buckets_from_another_process_give_hfs_tokens(tmp_path, device):
    _save(_dense_config(), tmp_path, 0)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2 << 20, enforce_eager=True, device=device)
    before = [o.token_ids for o in llm.generate_tokens(PROMPTS, GREEDY)]
    handle = f"ipc://{tmp_path}/weights.sock"
    proc = mp.get_context("spawn").Process(target=bucket_trainer_main,
                                           args=(str(tmp_path), 11, handle, 32 << 10, device), daemon=True)
    proc.start()
    try:
        t0 = time.perf_counter()
        written = llm.collective_rpc(receive_buckets_rank, args=([handle], device == "cpu"))[0]
        print(f"\nverl buckets ({device}): {len(written)} parameters in {time.perf_counter() - t0:.2f}s")
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    llm.engine.reset_prefix_cache()
    hf = perturbed(str(tmp_path), 11)
    after = [o.token_ids for o in llm.generate_tokens(PROMPTS, GREEDY)]
    assert after == [_hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS] and after != before


def test_a_failing_sender_is_an_error_on_the_engine_side_with_nothing_written(tmp_path):
    """The trainer's sender fails (a tensor larger than its bucket): the engine rank is told and raises, instead
    of waiting for buckets that never come; the weights are the old ones."""
    _save(_dense_config(), tmp_path, 0)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2 << 20, enforce_eager=True, device="cpu")
    before = [o.token_ids for o in llm.generate_tokens(PROMPTS, GREEDY)]
    handle = f"ipc://{tmp_path}/weights.sock"
    proc = mp.get_context("spawn").Process(target=bucket_trainer_main,
                                           args=(str(tmp_path), 11, handle, 1 << 10, "cpu"), daemon=True)
    proc.start()
    try:
        with pytest.raises(RuntimeError, match="sender failed: ValueError: weights: model.embed_tokens.weight"):
            llm.collective_rpc(receive_buckets_rank, args=([handle], True))
    finally:
        proc.join(60)
    assert proc.exitcode != 0  # the trainer's own error
    assert [o.token_ids for o in llm.generate_tokens(PROMPTS, GREEDY)] == before
