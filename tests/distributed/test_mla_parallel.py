"""The latent-attention families split over two gloo ranks: a DeepSeek-V3-shaped tiny model (q_lora, grouped
noaux_tc routing with a correction bias, shared experts, YaRN) under tensor parallelism (heads split, the latent
projections replicated, every rank holding the same latent cache for its own heads) and with the experts split by
id (expert parallelism), each generating greedily through the paged latent cache (the prefill decompressed, each
rank through its own heads of kv_b_proj; decode absorbed): every step's logits within 1e-5 of one process's, tokens
identical; one process equals transformers (tests/models/test_mla_vs_hf.py, tests/models/test_mla_prefill.py)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import moe_ranks  # noqa: E402  (tests/distributed is on sys.path, as pytest puts a test file's directory)
from test_tensor_parallel import _assert_matches  # noqa: E402
from turnout.distributed import free_port
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

transformers = pytest.importorskip("transformers")

STEPS = 18  # past a 16-token block


def _save(path) -> None:
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name else
                    torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    hf.save_pretrained(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_tp")
    _save(root / "v3")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    cases = [(name, str(root / "v3"), prompts, STEPS, "auto", ep, False) for name, ep in (("tp", False), ("ep", True))]
    torch.set_num_threads(1)
    (root / "out").mkdir()
    ctx = mp.spawn(moe_ranks.rank_main, args=(2, free_port(), cases, str(root / "out")), nprocs=2, join=False)
    single = moe_ranks.run_case(str(root / "v3"), prompts, STEPS, resolve(detect_platform("cpu")))
    while not ctx.join(timeout=120):
        pass
    ranks = [torch.load(root / "out" / f"rank{r}.pt") for r in range(2)]
    return single, ranks


@pytest.mark.parametrize("name", ["tp", "ep"])
def test_two_ranks_match_one(world, name):
    single, ranks = world
    _assert_matches(name, single[:2], [{"cases": {name: r[name][:2]}} for r in ranks])
    held = [r[name][2] for r in ranks]  # (gate_up shape, down shape, first expert) of each sparse block
    if name == "ep":
        assert [h[0][2] for h in held] == [0, 8] and held[0][0][0][0] == 8  # 8 whole experts each
    else:
        assert held[0][0][0][0] == 16 and held[0][0][0][1] == 32  # all 16 experts, half the intermediate each
