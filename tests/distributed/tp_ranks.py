"""What each rank of a spawned gloo world runs for tests/distributed (a module of its own: torch.multiprocessing's
spawn imports it in the child by name)."""

from __future__ import annotations

import math
import os
import traceback

import torch

BLOCK = 16


def kv_caches(model, config, num_blocks: int):
    """This rank's paged KV cache: its own kv heads (``model.kv_heads_per_rank``) of every layer, or what a model
    that lists its specs declares (``kv_specs``: the latent-attention families)."""
    if callable(getattr(model, "kv_specs", None)):
        from turnout.kv.spec import CacheLayout
        from turnout.worker.kv_sizing import allocate_caches

        return allocate_caches(CacheLayout(tuple(model.kv_specs("float32"))), num_blocks, BLOCK, 1, "cpu")
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hk = model.kv_heads_per_rank
    return [(torch.zeros(num_blocks, BLOCK, hk, d), torch.zeros(num_blocks, BLOCK, hk, d))
            for _ in range(config.num_hidden_layers)]


def greedy_run(model, config, prompts: list[list[int]], steps: int):
    """A batched prefill of ``prompts`` and ``steps`` greedy decode steps through the paged cache, with the
    metadata built as the model runner builds it. Returns (logits of every step [rows, V], tokens [B, steps+1])."""
    from turnout.layers.attention import AttentionMetadata

    lens = [len(p) for p in prompts]
    mb = max(math.ceil((n + steps + 1) / BLOCK) for n in lens)
    block_tables = torch.arange(len(lens) * mb, dtype=torch.int32).view(len(lens), mb)
    caches = kv_caches(model, config, len(lens) * mb)

    def slot(b, pos):
        return block_tables[b, pos // BLOCK].item() * BLOCK + pos % BLOCK

    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot(b, i) for b, n in enumerate(lens) for i in range(n)]),
        block_tables=block_tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), max_query_len=max(lens), max_seq_len=max(lens),
        seq_lens_host=tuple(lens), query_start_loc_host=tuple(qsl))  # latent attention: its prefill decompressed
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    all_logits, tokens = [], []
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, caches, meta))  # [sum(lens), V]
        all_logits.append(logits)
        nxt = logits[torch.tensor(qsl[1:]) - 1].argmax(-1)  # [B]
        tokens.append(nxt)
        cur = list(lens)
        for _ in range(steps):
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([slot(b, n) for b, n in enumerate(cur)]), block_tables=block_tables,
                seq_lens=torch.tensor([n + 1 for n in cur], dtype=torch.int32),
                query_start_loc=torch.arange(len(cur) + 1, dtype=torch.int32), max_query_len=1,
                max_seq_len=max(cur) + 1, seq_lens_host=tuple(n + 1 for n in cur),
                query_start_loc_host=tuple(range(len(cur) + 1)))
            logits = model.compute_logits(model(nxt, torch.tensor(cur), caches, meta))  # [B, V]
            all_logits.append(logits)
            nxt = logits.argmax(-1)
            tokens.append(nxt)
            cur = [n + 1 for n in cur]
    return torch.cat(all_logits), torch.stack(tokens, 1)


def fused_plan():
    """Every decode fusion of a GPU's plan, served here by the reference implementations of the fused ops."""
    from turnout.layers.fusion import FusionPlan

    return FusionPlan(one_row_linear=True, prenorm_linear=True, rope_attention=True)


def run_case(path: str, prompts, steps: int, ops, tp=None, fused: bool = False):
    from turnout.layers.fusion import NO_FUSIONS
    from turnout.loader import load_model

    loaded = load_model(path, device="cpu", ops=ops, plan=fused_plan() if fused else NO_FUSIONS, tp=tp)
    return greedy_run(loaded.model, loaded.hf_config, prompts, steps)


def check_collectives(ops, tp) -> dict:
    """Each collective op over the world against the same arithmetic done here on every rank's input."""
    world, rank = tp.size, tp.rank
    inputs = [torch.randn(4 * world, 2 * world, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    mine = inputs[rank]
    out = {}
    x = mine.clone()
    out["all_reduce"] = ops.all_reduce(x, tp.group) is x and torch.allclose(x, sum(inputs), atol=1e-6)
    out["all_gather_dim0"] = torch.equal(ops.all_gather(mine, 0, tp.group), torch.cat(inputs, 0))
    out["all_gather_dim1"] = torch.equal(ops.all_gather(mine, -1, tp.group), torch.cat(inputs, 1))
    rows = mine.shape[0] // world
    out["reduce_scatter_dim0"] = torch.allclose(ops.reduce_scatter(mine, 0, tp.group),
                                                sum(inputs)[rank * rows:(rank + 1) * rows], atol=1e-6)
    cols = mine.shape[1] // world
    out["reduce_scatter_dim1"] = torch.allclose(ops.reduce_scatter(mine, 1, tp.group),
                                                sum(inputs)[:, rank * cols:(rank + 1) * cols], atol=1e-6)
    out["all_to_all"] = torch.equal(ops.all_to_all(mine, tp.group),
                                    torch.cat([x[rank * rows:(rank + 1) * rows] for x in inputs]))
    # uneven splits: rank r sends s + 1 rows to rank s
    send = [s + 1 for s in range(world)]
    src = torch.cat([torch.full((s + 1, 2), float(10 * rank + s)) for s in range(world)])
    got = ops.all_to_all(src, tp.group, [rank + 1] * world, send)
    want = torch.cat([torch.full((rank + 1, 2), float(10 * r + rank)) for r in range(world)])
    out["all_to_all_splits"] = torch.equal(got, want)
    return out


def rank_main(rank: int, world: int, port: int, cases: list, outdir: str) -> None:
    """One rank: join the gloo world, check the collectives, run every case as this rank's shard."""
    torch.set_num_threads(1)
    try:
        from turnout.distributed import destroy_distributed, init_distributed
        from turnout.ops import resolve
        from turnout.platforms.detect import detect_platform

        platform = detect_platform("cpu")
        tp = init_distributed(platform, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                              timeout_s=120)
        ops = resolve(platform)
        result = {"collectives": check_collectives(ops, tp), "cases": {}}
        for name, path, prompts, steps, fused in cases:
            result["cases"][name] = run_case(path, prompts, steps, ops, tp=tp, fused=fused)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        destroy_distributed()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
