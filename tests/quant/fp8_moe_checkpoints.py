"""Test helper: a tiny random Qwen3-MoE written as a block-fp8 checkpoint in the Qwen3-30B-A3B-FP8 layout (per-expert
``mlp.experts.N.{gate,up,down}_proj.weight`` fp8 with ``.weight_scale_inv`` 128 x 128 block scales, the attention and
dense MLP projections alike, the routers and the LM head in float), and the HF model holding the exact dequantised
weights with the same activation quantisation, the reference turnout must equal.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from fp8_checkpoints import FORMATS, LINEAR, fake_quant_activations
from turnout.ops.reference.fp8 import dequantize_act, dequantize_weight, quantize_fp8, quantize_weight

# As Qwen3-30B-A3B-FP8 declares it: block scales, dynamic activations, routers and the head not converted.
MOE_FP8 = {**FORMATS["fp8_block"], "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate",
                                                                "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]}


def tiny_moe_config(**over):
    """Sizes on the 128 grid; layer 1 dense (``mlp_only_layers``), so a dense block-fp8 MLP sits between MoE layers."""
    common = dict(vocab_size=384, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    common.update(over)
    return transformers.Qwen3MoeConfig(**common)


def make_moe_hf(seed: int = 0, **over):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(**over), dtype=torch.float32).eval()
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


def _blocks(w: torch.Tensor):
    q, s = quantize_weight(w, "block")
    return q, s, dequantize_weight(q, s)


def write_fp8_moe_checkpoint(hf, out_dir):
    """Write ``hf`` (Qwen3-MoE) block-quantised to ``out_dir``; return the HF model with the dequantised weights."""
    tensors, deq = {}, {}
    for name, w in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            base = name.rsplit(".", 1)[0]
            parts = [("gate_proj", 0), ("up_proj", 1)] if name.endswith("gate_up_proj") else [("down_proj", None)]
            inter = w.shape[1] // 2
            rows = []
            for e in range(w.shape[0]):
                for part, half in parts:
                    piece = w[e] if half is None else w[e, half * inter:(half + 1) * inter]
                    q, s, d = _blocks(piece)
                    tensors[f"{base}.{e}.{part}.weight"] = q
                    tensors[f"{base}.{e}.{part}.weight_scale_inv"] = s
                    rows.append(d)
            deq[name] = torch.stack([torch.cat(rows[e * len(parts):(e + 1) * len(parts)]) for e in range(w.shape[0])])
        elif LINEAR.search(name):
            q, s, deq[name] = _blocks(w)
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, s
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = MOE_FP8
    (out_dir / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict({**hf.state_dict(), **deq})
    return ref


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    return dequantize_act(*quantize_fp8(x, 128)).to(x.dtype)


def quantize_activations_like_fp8(ref, dense: str = "fp8_block") -> None:
    """Make HF quantise each expert's inputs (hidden rows before gate/up, the SiLU-and-mul output before down) per
    token and 128 group with the reference ``quantize_fp8``, and each decoder projection's input as the format
    ``dense`` does (fp8_checkpoints.FORMATS; quantised at load: "ct_channel_token"), as the fp8 model does: then the
    two differ by float32 rounding (and the rare rounding tie that goes the other way)."""
    fake_quant_activations(ref, dense)
    for module in ref.modules():
        if type(module).__name__ == "Qwen3MoeExperts":
            module.forward = _quantised_experts_forward.__get__(module)


def _quantised_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' Qwen3MoeExperts.forward with the two activation quantisations."""
    out = torch.zeros_like(hidden_states)
    x = _fake_quant(hidden_states)
    for e in range(self.num_experts):
        token_idx, slot = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(_fake_quant(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, token_idx, h * top_k_weights[token_idx, slot, None])
    return out
