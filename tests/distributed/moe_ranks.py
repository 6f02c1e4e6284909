"""What each rank of a spawned gloo world runs for tests/distributed/test_moe_parallel.py, and the tiny MoE
checkpoints it runs on (a module of its own: torch.multiprocessing's spawn imports it in the child by name)."""

from __future__ import annotations

import os
import traceback

import torch

import tp_ranks


def _common(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    return base


def config(kind: str):
    """Tiny configs of the four MoE families (the shapes of tests/moe), and a dense one for the dummy weights."""
    import transformers as tf

    if kind == "qwen3_moe":  # layer 1 dense through mlp_only_layers
        return tf.Qwen3MoeConfig(**_common(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True, mlp_only_layers=[1]))
    if kind == "qwen2_moe":  # layers 0 and 2 dense (decoder_sparse_step=2); a sigmoid-gated shared expert
        return tf.Qwen2MoeConfig(**_common(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, norm_topk_prob=False,
                                           decoder_sparse_step=2, num_hidden_layers=4))
    if kind == "mixtral":
        return tf.MixtralConfig(**_common(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48,
                                          num_hidden_layers=2))
    if kind == "glm4_moe":  # sigmoid + correction bias + groups + shared expert + scaling + partial rope + qk norm
        return tf.Glm4MoeConfig(**_common(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                          moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5,
                                          norm_topk_prob=True, first_k_dense_replace=1, partial_rotary_factor=0.5,
                                          use_qk_norm=True, attention_bias=True, head_dim=16))
    if kind == "qwen3":  # dense, vocabulary 251 (the last rank's padding row)
        return tf.Qwen3Config(**_common(vocab_size=251, head_dim=32, num_hidden_layers=2))
    raise AssertionError(kind)


def build_hf(kind: str):
    """A random HF model with decisive routing (weights larger than HF's init, a correction bias that changes
    the choice), as tests/moe builds them."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(kind), attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return model


def expert_shapes(model) -> list:
    """(gate_up_proj shape, down_proj shape, first expert held) of each sparse block: what this rank holds."""
    from turnout.layers.moe.experts import FusedExperts

    return [(tuple(m.gate_up_proj.shape), tuple(m.down_proj.shape), m.expert_start)
            for m in model.modules() if isinstance(m, FusedExperts)]


def run_case(path: str, prompts, steps: int, ops, tp=None, load_format: str = "auto", ep: bool = False,
             fused: bool = False):
    """``fused``: built with every decode fusion of a GPU's plan (tp_ranks.fused_plan)."""
    from turnout.layers.fusion import NO_FUSIONS
    from turnout.loader import load_model

    loaded = load_model(path, device="cpu", ops=ops, tp=tp, load_format=load_format, enable_expert_parallel=ep,
                        plan=tp_ranks.fused_plan() if fused else NO_FUSIONS)
    logits, tokens = tp_ranks.greedy_run(loaded.model, loaded.hf_config, prompts, steps)
    return logits, tokens, expert_shapes(loaded.model)


def rank_main(rank: int, world: int, port: int, cases: list, outdir: str) -> None:
    """One rank: join the gloo world and run every case ``(name, path, prompts, steps, load_format, ep, fused)``."""
    torch.set_num_threads(1)
    try:
        from turnout.distributed import destroy_distributed, init_distributed
        from turnout.ops import resolve
        from turnout.platforms.detect import detect_platform

        platform = detect_platform("cpu")
        tp = init_distributed(platform, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                              timeout_s=120)
        ops = resolve(platform)
        result = {name: run_case(path, prompts, steps, ops, tp, *how) for name, path, prompts, steps, *how in cases}
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        destroy_distributed()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
