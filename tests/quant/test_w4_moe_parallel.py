"""The 4-bit Qwen3-MoE of test_w4_moe.py over real torch.distributed (gloo, 2 processes on 127.0.0.1, one thread
each), GPTQ with groups of 64: tensor parallel (each rank 64 rows of every expert's gate and up, one 64-row block, and
one group of its down's input) and expert parallel (two whole experts each), the ranks' partial sums through the all-reduce,
equal to one process: the same float32 numbers added in another order (no activation is quantised, so no rounding
tie can move a row as in the fp8 test)."""

from __future__ import annotations

import copy
import os
import traceback

import torch
import torch.multiprocessing as mp

from fp8_checkpoints import forward_logits
from turnout.distributed import free_port
from turnout.loader import load_model
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform
from w4_moe_checkpoints import make_hf, write_w4_moe_checkpoint

WORLD = 2


def _logits(path: str, ids: torch.Tensor, ops, tp=None, ep: bool = False) -> torch.Tensor:
    loaded = load_model(path, device="cpu", ops=ops, tp=tp, enable_expert_parallel=ep)
    config = copy.copy(loaded.hf_config)
    config.num_key_value_heads //= tp.size if tp is not None else 1  # this rank's KV heads, its cache's
    return forward_logits(loaded.model, config, ids)


def rank_main(rank: int, world: int, port: int, path: str, ids: torch.Tensor, outdir: str) -> None:
    torch.set_num_threads(1)
    try:
        from turnout.distributed import destroy_distributed, init_distributed

        platform = detect_platform("cpu")
        tp = init_distributed(platform, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                              timeout_s=120)
        ops = resolve(platform)
        result = {"tp": _logits(path, ids, ops, tp), "ep": _logits(path, ids, ops, tp, ep=True)}
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        destroy_distributed()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_tensor_and_expert_parallel_equal_one_process(tmp_path):
    write_w4_moe_checkpoint(make_hf("qwen3_moe"), "qwen3_moe", "gptq", tmp_path)
    ids = torch.randint(0, 384, (12,), generator=torch.Generator().manual_seed(4))
    (tmp_path / "out").mkdir()
    torch.set_num_threads(1)
    ctx = mp.spawn(rank_main, args=(WORLD, free_port(), str(tmp_path), ids, str(tmp_path / "out")), nprocs=WORLD,
                   join=False)
    single = _logits(str(tmp_path), ids, resolve(detect_platform("cpu")))
    while not ctx.join(timeout=120):
        pass
    for rank in range(WORLD):
        result = torch.load(tmp_path / "out" / f"rank{rank}.pt")
        for how in ("tp", "ep"):
            err = ((result[how] - single).abs().max() / single.abs().max()).item()
            print(f"rank {rank} {how}: max |logit - one process| / range {err:.2e}")
            assert err < 1e-5, (rank, how, err)
            assert torch.equal(result[how].argmax(-1), single.argmax(-1)), (rank, how)
