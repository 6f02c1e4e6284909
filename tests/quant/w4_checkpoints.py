"""Test helper: tiny random HF models written as 4-bit checkpoints (AWQ GEMM, GPTQ with and without desc_act,
compressed-tensors pack-quantized W4A16 symmetric / asymmetric / actorder), and the HF model holding the exact
dequantised weights, the reference the 4-bit model must equal.

The packers follow each format's published layout, written out here independently of turnout's unpackers:
AutoAWQ's ``pack`` (int32 words along the output dim, nibble i = column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), AutoGPTQ's
(words along the input dim, nibble i = row 8r + i; zero points along the output dim, stored less one), and
compressed-tensors' ``pack_to_int32`` (signed values + 8, along the last dim; zero points along the output dim).
``tests/quant/test_w4.py`` checks them on hand-built words and, where compressed-tensors is installed, against it.
"""

from __future__ import annotations

import json
import re

import torch
import transformers
from safetensors.torch import save_file

from fp8_checkpoints import LINEAR

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in 0..2^32-1 -> the int32 words with those bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_words(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[..., 8 W] values 0..15 -> int32 [..., W]; nibble i of word c = v[..., 8 c + order[i]]."""
    v = v.to(torch.int64).reshape(*v.shape[:-1], -1, 8)
    words = sum(v[..., order[i]] << (4 * i) for i in range(8))
    return _int32(words)


def quantize(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None = None):
    """w [N, K] -> (q [N, K] 0..15, s [N, G] float16-exact, z [N, G] 0..15, g_idx [K]): groups of ``group`` columns
    in the order ``perm`` (activation order; None: natural)."""
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    wg = w[:, order].reshape(n, k // group, group)
    if sym:
        s = (wg.abs().amax(dim=2) / 7.5).clamp(min=1e-6).half().float()
        z = torch.full_like(s, 8)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        z = (-lo / s).round().clamp(0, 15)
    qg = (wg / s[..., None]).round() + z[..., None]
    q_sorted = qg.clamp(0, 15).reshape(n, k)
    q = torch.empty_like(q_sorted)
    q[:, order] = q_sorted
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return q.to(torch.int64), s, z.to(torch.int64), g_idx


def dequantize(q, s, z, g_idx) -> torch.Tensor:
    """The published meaning of every format here: (q - z) s of each column's group."""
    g = g_idx.long()
    return (q - z[:, g]).float() * s[:, g]


def ct_pack(signed: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 for 4 bits: upstream's when installed, else the same layout here."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        v = (signed.to(torch.int64) + 8)
        v = v if packed_dim == 1 else v.T
        rows, cols = v.shape
        v = torch.nn.functional.pad(v, (0, -cols % 8))
        out = pack_words(v)
        return (out if packed_dim == 1 else out.T).contiguous()
    return pack_to_int32(signed.to(torch.int8), 4, packed_dim)


def _ct_config(group, sym, actorder):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group,
                "actorder": "group" if actorder else None, "dynamic": False, "observer": "minmax"}}}}


# name -> (quantization_config, symmetric, activation order)
FORMATS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, False, False),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, True, False),
    "gptq_desc_act": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
                       "checkpoint_format": "gptq"}, False, True),
    "ct_w4a16": (_ct_config(128, True, False), True, False),
    "ct_w4a16_asym_actorder": (_ct_config(32, False, True), False, True),
}


def pack_linear(fmt: str, w: torch.Tensor, gen: torch.Generator, perm: torch.Tensor | None = None, formats=None):
    """One linear weight [N, K] in ``fmt``: ({suffix: tensor}, dequantised float32 weight). ``perm``: the activation
    order (GPTQ orders the columns of projections reading the same input alike: one Hessian). ``formats``: a table
    like FORMATS (default) where ``fmt`` is looked up."""
    qc, sym, act = (formats or FORMATS)[fmt]
    group = qc.get("group_size") or qc["config_groups"]["group_0"]["weights"]["group_size"]
    n, k = w.shape
    perm = (perm if perm is not None else torch.randperm(k, generator=gen)) if act else None
    q, s, z, g_idx = quantize(w.float(), group, sym, perm)
    deq = dequantize(q, s, z, g_idx)
    if fmt == "awq":
        return {"qweight": pack_words(q.T, AWQ_ORDER), "qzeros": pack_words(z.T, AWQ_ORDER),
                "scales": s.T.half().contiguous()}, deq
    if fmt.startswith("gptq"):
        return {"qweight": pack_words(q.T.reshape(k // 8, 8, n).permute(0, 2, 1)).squeeze(-1),
                "qzeros": pack_words(z.T - 1), "scales": s.T.half().contiguous(), "g_idx": g_idx}, deq
    out = {"weight_packed": ct_pack(q - 8), "weight_scale": s.to(torch.bfloat16) if sym else s.half(),
           "weight_shape": torch.tensor([n, k])}
    if sym:  # stored in bfloat16 as llm-compressor does: the reference takes the stored value
        deq = dequantize(q, s.to(torch.bfloat16).float(), z, g_idx)
    else:
        out["weight_zero_point"] = ct_pack(z - 8, packed_dim=0)
    if act:
        out["weight_g_idx"] = g_idx
    return out, deq


def write_w4_checkpoint(hf, fmt: str, out_dir, seed: int = 0):
    """Write ``hf``'s decoder linears in ``fmt`` to ``out_dir``; return the HF model with the dequantised weights."""
    gen = torch.Generator().manual_seed(seed)
    tensors, deq, perms = {}, {}, {}
    for name, w in hf.state_dict().items():
        if not LINEAR.search(name):
            tensors[name] = w.contiguous()
            continue
        base = name[: -len(".weight")]
        shared_input = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name))
        if shared_input not in perms:
            perms[shared_input] = torch.randperm(w.shape[1], generator=gen)
        packed, deq[name] = pack_linear(fmt, w, gen, perms[shared_input])
        tensors.update({f"{base}.{suffix}": t.contiguous() for suffix, t in packed.items()})
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = FORMATS[fmt][0]
    (out_dir / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict({**hf.state_dict(), **deq})
    return ref
