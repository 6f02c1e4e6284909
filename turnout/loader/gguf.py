"""GGUF files through public APIs only: the ``gguf`` package's reader, transformers' config and tokenizer loaders.

- config: ``AutoConfig.from_pretrained(dir, gguf_file=name)``; tokenizer (vocabulary, merges, special
  tokens, chat template): ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``. Both are transformers'
  documented GGUF entry points.
- tensors: ``gguf.GGUFReader`` (a memory map; tensor data is read when used), dequantised one at a time by
  ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ*) and renamed
  to HF checkpoint names here, from the GGUF tensor table in ``gguf.constants``.

Nothing private of transformers is imported (its GGUF internals differ between releases: 5.17's reader
knows no Q4_1 tensors) and nothing is patched while a load runs.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from turnout.loader.gguf_blocks import DECODER_LINEARS, Q4_TYPES, check_keepable, q4_blocks

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` values whose tensors this module maps (Mistral files say "llama").
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3")
# the layouts whose Q4 blocks --quantization gguf keeps (tests/loader/test_gguf_blocks.py); the others dequantise
KEPT_Q4_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
# llama.cpp's converter permutes Q and K rows of these architectures for its interleaved rotary layout.
PERMUTED_QK = ("llama",)
# llama.cpp's Gemma converters store every RMSNorm weight as 1 + w (ggml's norm multiplies by the weight, Gemma's
# by 1 + w): w is the file's value minus one, as transformers' own GGUF loading does.
NORM_SHIFTED = ("gemma2", "gemma3")
# GGUF tensors with no HF parameter, carrying nothing HF's config does not already say.
HARMLESS_UNMAPPED = ("rope_freqs.weight",)


def _hf_names(arch: str = "llama") -> dict[str, str]:
    """GGUF tensor base name (``blk.{bid}.attn_q``) -> HF checkpoint module name (``{bid}``, ``{e}`` kept)."""
    from gguf import MODEL_TENSOR as T
    from gguf import TENSOR_NAMES

    layer = "model.layers.{bid}."
    table = {
        T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head",
        T.ATTN_NORM: layer + "input_layernorm", T.FFN_NORM: layer + "post_attention_layernorm",
        T.ATTN_Q: layer + "self_attn.q_proj", T.ATTN_K: layer + "self_attn.k_proj",
        T.ATTN_V: layer + "self_attn.v_proj", T.ATTN_OUT: layer + "self_attn.o_proj",
        T.ATTN_Q_NORM: layer + "self_attn.q_norm", T.ATTN_K_NORM: layer + "self_attn.k_norm",
        T.FFN_GATE: layer + "mlp.gate_proj", T.FFN_UP: layer + "mlp.up_proj", T.FFN_DOWN: layer + "mlp.down_proj",
        T.FFN_GATE_INP: layer + "mlp.gate",
        # stacked [E, rows, cols] in GGUF; split into HF's per-expert tensors
        T.FFN_GATE_EXP: layer + "mlp.experts.{e}.gate_proj", T.FFN_UP_EXP: layer + "mlp.experts.{e}.up_proj",
        T.FFN_DOWN_EXP: layer + "mlp.experts.{e}.down_proj",
        T.FFN_GATE_SHEXP: layer + "mlp.shared_expert.gate_proj", T.FFN_UP_SHEXP: layer + "mlp.shared_expert.up_proj",
        T.FFN_DOWN_SHEXP: layer + "mlp.shared_expert.down_proj",
        T.FFN_GATE_INP_SHEXP: layer + "mlp.shared_expert_gate",
    }
    if arch in NORM_SHIFTED:  # sandwich norms: ffn_norm is the norm before the MLP, post_* the ones after
        table.update({T.FFN_PRE_NORM: layer + "pre_feedforward_layernorm",
                      T.ATTN_POST_NORM: layer + "post_attention_layernorm",
                      T.FFN_POST_NORM: layer + "post_feedforward_layernorm"})
    if arch == "phi3":  # fused as in HF's Phi-3 checkpoints: [q; k; v] rows and [gate; up] rows
        table.update({T.ATTN_QKV: layer + "self_attn.qkv_proj", T.FFN_UP: layer + "mlp.gate_up_proj"})
    return {TENSOR_NAMES[kind]: hf for kind, hf in table.items()}


_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def split_path(path: str | Path) -> tuple[str, str]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GGUF file not found: {p}")
    return str(p.parent), p.name


def open_reader(path: str | Path):
    """``gguf.GGUFReader`` over a file that ``checks.check_gguf`` has passed; its errors name the file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def load_config(path: str | Path):
    from transformers import AutoConfig

    d, name = split_path(path)
    return AutoConfig.from_pretrained(d, gguf_file=name)


def has_tokenizer(reader) -> bool:
    return "tokenizer.ggml.tokens" in reader.fields


def load_tokenizer(path: str | Path):
    """The tokenizer embedded in the GGUF file (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    d, name = split_path(path)
    return AutoTokenizer.from_pretrained(d, gguf_file=name)


def read_tensors(path: str | Path, reader=None) -> tuple[str, Iterator[tuple[str, int, np.ndarray]]]:
    """(GGUF architecture, lazy iterator of (tensor name, ggml type, raw data)).

    Quantised data comes as bytes shaped [..., row bytes], float types as values shaped as the tensor
    (numpy order: GGUF lists dimensions innermost first, so a [rows, cols] matrix says (cols, rows)).
    """
    reader = reader if reader is not None else open_reader(path)
    arch = field(reader, "general.architecture")
    return arch, ((t.name, int(t.tensor_type), t.data) for t in reader.tensors)


def dequantize(data: np.ndarray, ggml_type: int) -> torch.Tensor:
    """Raw GGUF data (bytes shaped [..., row bytes], or float values) -> float32 [..., cols] tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    arr = np.ascontiguousarray(gguf_dequantize(data, GGMLQuantizationType(ggml_type)), dtype=np.float32)
    if not arr.flags.writeable:  # plain F32 tensors come back as views of the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(arr)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: HF's rows (head, half, i) were written as (head, i, half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str | Path, hf_config, reader=None,
                      keep_q4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, float32 tensor) for every tensor of a GGUF file, dequantised one at a time.
    ``keep_q4``: decoder projections in Q4_0 / Q4_1 come as their 4-bit values and group scales instead
    (``<name>.qweight`` uint8 [N, K], ``<name>.scale_zeros`` [N, K/32, 2]; turnout/loader/gguf_blocks.py)."""
    reader = reader if reader is not None else open_reader(path)
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported by turnout's GGUF loader "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); a safetensors checkpoint of the "
                         f"same model may load")
    if keep_q4 and arch not in KEPT_Q4_ARCHITECTURES:
        raise ValueError(f"{path}: quantization='gguf' (Q4 blocks kept) is built for the "
                         f"{', '.join(KEPT_Q4_ARCHITECTURES)} GGUF layouts, not {arch!r}; load it without "
                         f"--quantization (dequantised at load)")
    if arch == "phi3":
        factors = [t.name for t in reader.tensors if t.name.startswith(("rope_factors_long", "rope_factors_short"))]
        if factors:  # transformers' config from GGUF has no LongRoPE scaling: the model would be silently wrong
            raise ValueError(f"{path}: a Phi-3 GGUF with LongRoPE factors ({', '.join(factors)}) is not supported: "
                             f"the config transformers reads from GGUF carries no rope scaling; load the "
                             f"safetensors checkpoint of the same model")
    names = _hf_names(arch)
    n_head = int(hf_config.num_attention_heads)
    n_kv_head = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    for t in reader.tensors:
        name, ggml_type = t.name, int(t.tensor_type)
        stem, dot, suffix = name.rpartition(".")
        m = _BLOCK.match(stem)
        template = names.get(f"blk.{{bid}}.{m.group(2)}" if m else stem) if suffix in ("weight", "bias") else None
        if template is None:
            if name in HARMLESS_UNMAPPED:
                logger.debug("GGUF tensor %s has no HF counterpart; skipped", name)
                continue
            raise ValueError(f"{path}: unexpected GGUF tensor {name!r} (ggml type {ggml_type}, shape "
                             f"{tuple(t.data.shape)}): no HF parameter maps to it for architecture {arch!r}")
        hf = template.format(bid=m.group(1) if m else "", e="{e}") + dot + suffix
        if keep_q4 and ggml_type in Q4_TYPES and DECODER_LINEARS.match(name):
            q, sz = q4_blocks(t.data, ggml_type)
            if arch in PERMUTED_QK and m.group(2) in ("attn_q", "attn_k"):
                heads = n_head if m.group(2) == "attn_q" else n_kv_head
                q, sz = _unpermute(q, heads), _unpermute(sz, heads)
            base = hf[: -len(".weight")]
            yield base + ".qweight", q
            yield base + ".scale_zeros", sz
            continue
        w = dequantize(t.data, ggml_type)
        if arch in PERMUTED_QK and m and m.group(2) in ("attn_q", "attn_k"):
            w = _unpermute(w, n_head if m.group(2) == "attn_q" else n_kv_head)
        if "{e}" in hf:  # [E, rows, cols] -> one [rows, cols] per expert, as HF checkpoints store them
            for e in range(w.shape[0]):
                yield hf.format(e=e), w[e]
            continue
        if arch in NORM_SHIFTED and suffix == "weight" and "norm" in (m.group(2) if m else stem):
            w = w - 1.0
        if m and m.group(2) == "ffn_gate_inp_shexp" and w.dim() == 1:
            w = w[None]  # HF's shared-expert gate is a Linear(H, 1): [1, H]
        yield hf, w


def tensor_count(reader, keep_q4: bool = False) -> int:
    """How many (HF name, tensor) pairs ``iter_gguf_weights`` yields (a stacked expert tensor: one per expert; a
    kept Q4 projection two)."""
    n = 0
    for t in reader.tensors:
        kept = keep_q4 and int(t.tensor_type) in Q4_TYPES and DECODER_LINEARS.match(t.name)
        n += int(t.data.shape[0]) if "_exps." in t.name else 2 if kept else int(t.name not in HARMLESS_UNMAPPED)
    return n


KEEPS_BY_DEFAULT = ("vendor.cpu_native",)  # w4a16_linear implementations faster than the dequantised float GEMM


def keeps_by_default(reader, ops) -> bool:
    """Whether a GGUF file loaded without ``quantization`` keeps its 4-bit blocks anyway: where the op table serves
    ``w4a16_linear`` with a kernel that reads the blocks faster than a float32 GEMM reads the inflated weight
    (``KEEPS_BY_DEFAULT``: the CPU's native kernel, 4-7x faster at one row, docs/benchmarks.md) and the file can
    keep them (its architecture's layout is built, every projection Q4_0 / Q4_1). The values are the same either way
    (the dequantised weight's, summed in another order); the weights take 4.5 bits instead of 32."""
    if ops is None or not ops.available("w4a16_linear") or ops.chosen("w4a16_linear") not in KEEPS_BY_DEFAULT:
        return False
    if field(reader, "general.architecture") not in KEPT_Q4_ARCHITECTURES:
        return False
    try:
        check_keepable(reader)
    except ValueError:
        return False
    return True
