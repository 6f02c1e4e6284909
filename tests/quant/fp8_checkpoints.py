"""Test helper: tiny random HF models written as fp8 checkpoints in the formats turnout reads, and the HF
model holding the exact dequantised weights (the reference the fp8 model must equal).

Formats (``FORMATS``): the fp8 method with 128 x 128 block scales (Qwen3-FP8 / DeepSeek-V3), per-tensor scales
with dynamic or static activations (AutoFP8), and compressed-tensors per-channel weights with per-token
activations (W8A8-FP8) or weight-only (W8A16).
"""

from __future__ import annotations

import json
import math
import re

import torch
import transformers
from safetensors.torch import save_file

from turnout.layers.attention import AttentionMetadata
from turnout.ops.reference.fp8 import FP8, FP8_MAX, dequantize_weight, quantize_weight

LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
BLOCK = 16


def _ct(strategy: str, acts: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}}}}


_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
FORMATS = {
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]},
    "fp8_tensor_dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8_tensor_static": {"quant_method": "fp8", "activation_scheme": "static"},
    "ct_channel_token": _ct("channel", _TOKEN),
    "ct_channel_weight_only": _ct("channel", None),
}
WEIGHT_ONLY = {"ct_channel_weight_only"}


def tiny_config(kind: str, **over):
    """Sizes on the 128 grid (block scales need block-aligned q / k / v and TP=2 slices)."""
    common = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    common.update(over)
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[kind]
    return cls(**common)


def make_hf(kind: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **over), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF's init leaves norms at 1: random values make every parameter count
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_((1.0 + 2 * noise) if "norm" in name else 2 * noise)
    return hf


def _input_amax(hf, ids: torch.Tensor) -> dict[str, float]:
    """max |input| of every decoder linear over one calibration run (static activation scales)."""
    amax, hooks = {}, []
    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and LINEAR.search(name + ".weight"):
            hooks.append(mod.register_forward_hook(
                lambda m, args, out, name=name: amax.__setitem__(name, args[0].abs().max().item())))
    with torch.no_grad():
        hf(ids[None])
    for h in hooks:
        h.remove()
    return amax


def write_fp8_checkpoint(hf, fmt: str, out_dir, calibration: torch.Tensor):
    """Write ``hf`` quantised as ``fmt`` to ``out_dir``; return the HF model with the dequantised weights."""
    qc = FORMATS[fmt]
    amax = _input_amax(hf, calibration) if fmt == "fp8_tensor_static" else {}
    tensors, deq = {}, {}
    for name, w in hf.state_dict().items():
        if not LINEAR.search(name):
            tensors[name] = w.contiguous()
            continue
        base = name[: -len(".weight")]
        if fmt == "fp8_block":
            q, s = quantize_weight(w, "block")
            tensors[base + ".weight_scale_inv"] = s
        elif fmt.startswith("fp8_tensor"):
            s = (w.abs().max() / FP8_MAX).reshape(())  # one scale per tensor, a 0-d tensor as AutoFP8 writes it
            q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            tensors[base + ".weight_scale"] = s
            s = s.reshape(1, 1).expand(w.shape[0], 1)
            if base in amax:
                tensors[base + ".input_scale"] = torch.tensor(amax[base] / FP8_MAX)
        else:  # compressed-tensors: per channel, stored in bfloat16 as llm-compressor does
            q, s = quantize_weight(w, "row")
            s = s.to(torch.bfloat16)
            tensors[base + ".weight_scale"] = s
        tensors[name] = q
        deq[name] = dequantize_weight(q, s.float().contiguous())
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict({**hf.state_dict(), **deq})
    return ref


def forward_logits(model, config, ids: torch.Tensor) -> torch.Tensor:
    """turnout's logits [T, V] for one sequence, prefilled through the paged cache."""
    n = len(ids)
    nb = math.ceil(n / BLOCK)
    hk, d = config.num_key_value_heads, config.head_dim
    dtype = next(p for p in model.parameters() if p.dtype.is_floating_point and p.dtype != FP8).dtype
    dev = ids.device
    caches = [(torch.zeros(nb, BLOCK, hk, d, dtype=dtype, device=dev),
               torch.zeros(nb, BLOCK, hk, d, dtype=dtype, device=dev)) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev),
                             block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev), max_query_len=n,
                             max_seq_len=n)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n, device=dev), caches, meta))


def greedy_walk(loaded, ref, prompt: torch.Tensor, steps: int = 6):
    """Greedy decoding by our loaded model and by the HF reference, each from its own tokens: (our tokens, HF's
    tokens, HF's top-2 margin and our max |logit error| at each step)."""
    seq, hf_seq, margins, errors = prompt, prompt, [], []
    for _ in range(steps):
        ours = forward_logits(loaded.model, loaded.hf_config, seq)[-1]
        with torch.no_grad():
            want = ref(hf_seq[None]).logits[0, -1]
        top = want.topk(2).values
        margins.append((top[0] - top[1]).item())
        errors.append((ours - want).abs().max().item())
        seq, hf_seq = torch.cat([seq, ours.argmax()[None]]), torch.cat([hf_seq, want.argmax()[None]])
    return seq, hf_seq, margins, errors


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fake_quant_activations(ref, fmt: str, ckpt_dir=None) -> None:
    """Make ``ref`` (HF, dequantised weights) quantise each decoder linear's input as ``fmt`` says, with the
    reference ``quantize_fp8``: the model turnout's fp8 path must then equal to float32 rounding. Static
    scales are read from the checkpoint in ``ckpt_dir``."""
    from safetensors.torch import load_file

    from turnout.ops.reference.fp8 import dequantize_act, quantize_fp8

    if fmt in WEIGHT_ONLY:
        return
    group = 128 if fmt == "fp8_block" else 0
    static = load_file(str(ckpt_dir / "model.safetensors")) if fmt == "fp8_tensor_static" else {}
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear) and LINEAR.search(name + ".weight"):
            scale = static.get(name + ".input_scale")

            def hook(m, args, scale=scale):
                x = args[0]
                x2 = x.reshape(-1, x.shape[-1])
                return (dequantize_act(*quantize_fp8(x2, group, scale)).to(x.dtype).reshape(x.shape),)
            mod.register_forward_pre_hook(hook)
