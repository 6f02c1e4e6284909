"""The RL control plane with tensor_parallel_size=2 on CPU over gloo (the mp executor: rank 0 here, rank 1
spawned): every operation goes through collective_rpc, each rank loads its shard of the full tensors the
trainer pushes, and sleeps / wakes its own memory."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

# tests/rl is on sys.path, as pytest puts a test file's directory there
from test_rl_rollout import GREEDY, PROMPTS, _check_matches_hf, _dense_config, _in_thread, _save, free_port  # noqa: E402
from turnout import LLM  # noqa: E402
from turnout.worker import rank_memory  # noqa: E402
from turnout.worker.weight_broadcast import broadcast_weights, stateless_group  # noqa: E402


def test_tp2_update_sleep_wake(tmp_path):
    hf = _save(_dense_config(), tmp_path, 3)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, kv_cache_memory=2 << 20, dtype="float32", device="cpu")
    executor = llm.engine.executor
    try:
        _check_matches_hf(llm, hf)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
        llm.update_weights(hf.named_parameters())  # full tensors; each rank takes its shard
        print(f"\nTP=2 after push: logprob mismatch {_check_matches_hf(llm, hf):.2e}")
        # computed from scratch, as after a wake (which forgets the prefix cache): a prefix hit computes the
        # rest of a prompt in other shapes, and a CPU GEMM may round those differently in the last bits
        llm.reset_prefix_cache()
        before = llm.generate_tokens(PROMPTS, GREEDY)
        with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
            llm.update_weights([("model.norm.weight", hf.model.norm.weight * 2),
                                ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 95))])
        held = executor.collective_rpc(rank_memory.resident_bytes_rank)
        assert len(held) == 2 and all(h["weights"] > 0 and h["kv_cache"] > 0 for h in held)
        llm.sleep(level=1)
        asleep = executor.collective_rpc(rank_memory.resident_bytes_rank)
        assert [(a["weights"], a["kv_cache"]) for a in asleep] == [(0, 0), (0, 0)]  # on every rank
        assert [a["host_weights"] for a in asleep] == [h["weights"] for h in held]
        llm.wake_up()
        after = llm.generate_tokens(PROMPTS, GREEDY)
        assert [(o.token_ids, o.logprobs) for o in after] == [(o.token_ids, o.logprobs) for o in before]
        llm.sleep(level=2)
        assert all(a["host_weights"] == 0 for a in executor.collective_rpc(rank_memory.resident_bytes_rank))
        llm.wake_up(["weights"])
        llm.update_weights(hf.named_parameters())
        llm.wake_up(["kv_cache"])
        again = llm.generate_tokens(PROMPTS, GREEDY)
        assert [(o.token_ids, o.logprobs) for o in again] == [(o.token_ids, o.logprobs) for o in before]
        # the broadcast transport: the trainer is rank 0 of a gloo group of 3, the engine's ranks 1 and 2
        port = free_port()
        trainer, tbox = _in_thread(stateless_group, "127.0.0.1", port, 0, 3, "gloo")
        assert llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=3) == [1, 2]
        trainer.join(60)
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(0.97)
        named = list(hf.named_parameters())
        sender, sbox = _in_thread(broadcast_weights, tbox["out"], named)
        llm.update_weights_from_distributed([n for n, _ in named], [t.dtype for _, t in named],
                                            [tuple(t.shape) for _, t in named])
        sender.join(60)
        assert "err" not in sbox, sbox.get("err")
        print(f"TP=2 after a broadcast push: logprob mismatch {_check_matches_hf(llm, hf):.2e}")
    finally:
        executor.shutdown()
