"""Test helper: tiny random Qwen3-MoE, Qwen2-MoE and Mixtral models written as 4-bit checkpoints the way the released
ones are (Qwen3-30B-A3B-GPTQ-Int4, Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4, Mixtral-8x7B AWQ): every decoder projection and
every expert's gate / up / down (``mlp.experts.N.gate_proj``; Mixtral ``block_sparse_moe.experts.N.w1`` / ``w3`` /
``w2``) packed per expert in the format's layout by tests/quant/w4_checkpoints.py's packers; routers, the shared
expert's gate, norms, embeddings and the LM head in float. Returns the HF model holding the exact dequantised
weights, the reference turnout must equal. GPTQ's activation order: each expert's gate and up share one order (one
input, one Hessian), its down has its own."""

from __future__ import annotations

import json
import re

import torch
import transformers
from safetensors.torch import save_file

from fp8_checkpoints import LINEAR
from w4_checkpoints import FORMATS, pack_linear

# the dense tests' formats; GPTQ desc_act with groups of 32, so that the small experts here (K = 128) hold several
# groups and the activation order really permutes them (one group of 128 would leave g_idx in natural order)
MOE_FORMATS = {**FORMATS, "gptq_desc_act": ({**FORMATS["gptq_desc_act"][0], "group_size": 32}, False, True)}
EXPERTS = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_COMMON = dict(vocab_size=384, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_config(family: str, **over):
    """Small and on the 64 grid: TP=2 slices of every projection and expert are whole 64-row blocks (and whole groups
    of 64); layer 1 of the Qwen families is dense (``mlp_only_layers``), so a dense 4-bit MLP follows the experts."""
    if family == "qwen3_moe":
        cfg = dict(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                   norm_topk_prob=True, mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"])
        cls = transformers.Qwen3MoeConfig
    elif family == "qwen2_moe":
        cfg = dict(intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                   num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                   architectures=["Qwen2MoeForCausalLM"])
        cls = transformers.Qwen2MoeConfig
    else:
        cfg = dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                   architectures=["MixtralForCausalLM"])
        cls = transformers.MixtralConfig
    return cls(**{**_COMMON, **cfg, **over})


def make_hf(family: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **over), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random norms and a decisive router, so that every parameter counts
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(noise * 0.3)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return hf


def _expert_names(family: str, prefix: str) -> tuple[str, dict[str, str]]:
    """(the checkpoint's experts module, {shard: projection name})."""
    if family == "mixtral":
        return f"{prefix}.block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}
    return f"{prefix}.mlp.experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def write_w4_moe_checkpoint(hf, family: str, fmt: str, out_dir, seed: int = 0):
    """Write ``hf`` in ``fmt`` (MOE_FORMATS) to ``out_dir``; return the HF model with the dequantised
    weights."""
    gen = torch.Generator().manual_seed(seed)
    tensors, deq, perms = {}, {}, {}

    def put(base: str, w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        packed, d = pack_linear(fmt, w, gen, perm, MOE_FORMATS)
        tensors.update({f"{base}.{suffix}": t.contiguous() for suffix, t in packed.items()})
        return d

    for name, w in hf.state_dict().items():
        m = EXPERTS.match(name)
        if m:
            module, proj = _expert_names(family, m.group(1))
            inter = w.shape[1] // 2
            stack = []
            for e in range(w.shape[0]):
                perm = torch.randperm(w.shape[2], generator=gen)
                if m.group(2) == "gate_up_proj":  # gate and up read one input: one order
                    stack.append(torch.cat([put(f"{module}.{e}.{proj['gate']}", w[e, :inter], perm),
                                            put(f"{module}.{e}.{proj['up']}", w[e, inter:], perm)]))
                else:
                    stack.append(put(f"{module}.{e}.{proj['down']}", w[e], perm))
            deq[name] = torch.stack(stack)
        elif LINEAR.search(name):  # q / k / v, and a dense or shared gate / up, read one input: one order
            shared_input = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name))
            if shared_input not in perms:
                perms[shared_input] = torch.randperm(w.shape[1], generator=gen)
            deq[name] = put(name[: -len(".weight")], w, perms[shared_input])
        elif family == "mixtral" and name.endswith("mlp.gate.weight"):
            tensors[name.replace("mlp.gate", "block_sparse_moe.gate")] = w.contiguous()
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = MOE_FORMATS[fmt][0]
    (out_dir / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict({**hf.state_dict(), **deq})
    return ref
