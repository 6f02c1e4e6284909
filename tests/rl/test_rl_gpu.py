"""The RL control plane on a GPU (skipped elsewhere): sleep really hands the memory back to the device (not only
to torch's cache), the CUDA graphs are re-captured on wake against the new addresses, and outputs are identical
after sleep(1) + wake_up, and after sleep(2) + wake_up + update_weights."""

import os
import time

import pytest
import torch

from turnout import LLM, SamplingParams

pytestmark = pytest.mark.gpu

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


def _prompts(vocab=151936):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 33, 100)]


def _run(llm):
    return [(o.token_ids, o.logprobs) for o in llm.generate_tokens(_prompts(), GREEDY)]


def _used_on_device() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_sleep_returns_memory_to_the_device_and_graphs_come_back():
    llm = LLM(os.path.join(CONFIGS, "qwen3-0.6b"), load_format="dummy", dtype="bfloat16", max_model_len=1024,
              gpu_memory_utilization=0.3, seed=0)
    runner = llm.engine.runner
    assert runner.graphs is not None  # captured at start-up
    before = _run(llm)
    replays = runner.graphs.num_replays
    assert replays > 0
    state = {n: p.detach().to("cpu", copy=True) for n, p in runner.model.named_parameters()}
    used = _used_on_device()
    held = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    slept = time.perf_counter() - t0
    freed = used - _used_on_device()
    print(f"\nsleep(1) {slept:.2f}s: freed {freed / 2**30:.2f} GiB of {held / 2**30:.2f} GiB torch held "
          f"({100 * freed / held:.0f} %), reserved now {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    assert runner.graphs is None
    assert freed >= 0.95 * held  # >= 95 % of what the engine held goes back: the trainer beside it needs it
    assert all(p.is_pinned() for p in (s.host for s in runner.memory._saved.values()))
    t0 = time.perf_counter()
    llm.wake_up()
    print(f"wake_up {time.perf_counter() - t0:.2f}s (graphs re-captured in {runner.graphs.capture_s:.2f}s)")
    assert runner.graphs is not None and runner.graphs.graphs  # re-captured
    assert _run(llm) == before
    assert runner.graphs.num_replays > 0  # the new graphs replayed
    llm.sleep(level=2)
    assert _used_on_device() <= used - 0.95 * held
    llm.wake_up(tags=["weights"])
    llm.update_weights(state.items())
    llm.wake_up(tags=["kv_cache"])
    assert _run(llm) == before


def test_cuda_ipc_buckets_from_another_process(tmp_path):
    """The trainer, in its own process on the same GPU, shares its weights by CUDA IPC handle in 3 buckets."""
    import multiprocessing as mp
    import pickle

    from ipc_trainer import perturbed, trainer_main
    from test_rl_rollout import GREEDY as TINY_GREEDY
    from test_rl_rollout import PROMPTS, _dense_config, _hf_greedy, _save

    _save(_dense_config(), tmp_path, 0)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2 << 20)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=trainer_main, args=(str(tmp_path), 11, 3, theirs, "cuda"), daemon=True)
    proc.start()
    try:
        t0 = time.perf_counter()
        while msg := mine.recv_bytes():
            llm.update_weights_from_ipc(pickle.loads(msg))
            mine.send("done")
        print(f"\nIPC update of the tiny model in 3 buckets: {time.perf_counter() - t0:.3f}s")
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    hf = perturbed(str(tmp_path), 11)
    for prompt, out in zip(PROMPTS, llm.generate_tokens(PROMPTS, TINY_GREEDY)):
        assert out.token_ids == _hf_greedy(hf, prompt, TINY_GREEDY.max_tokens)
