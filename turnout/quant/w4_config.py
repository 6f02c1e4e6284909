"""4-bit weight checkpoints (w4a16): which ``quantization_config`` is read, and what it says.

Three formats, with the fields their producers write:

* ``quant_method: "awq"`` (AutoAWQ, ``version: "gemm"``): ``qweight`` int32 [K, N/8] packed along N in AWQ's
  order (nibble i of a word holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]), ``qzeros`` int32 [K/G, N/8] the same
  way, ``scales`` [K/G, N]; the value is (q - z) s. ``zero_point: true`` only.
* ``quant_method: "gptq"`` (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq" or "gptq_v2"): ``qweight`` int32
  [K/8, N] packed along K (nibble i holds row 8r + i), ``qzeros`` int32 [K/G, N/8] packed along N, ``scales``
  [K/G, N], ``g_idx`` [K] (the group of each input column; with ``desc_act`` in activation order); the value is
  (q - z') s with z' = z + 1 in the "gptq" format (its historical off-by-one) and z in "gptq_v2".
* ``quant_method: "compressed-tensors"`` with ``format: "pack-quantized"`` and 4-bit int weights (llm-compressor's
  W4A16, W4A16_ASYM): ``weight_packed`` int32 [N, K/8] packed along K, values offset by 8; ``weight_scale`` [N, K/G];
  ``weight_zero_point`` int32 [N/8, K/G] packed along N for asymmetric weights; ``weight_g_idx`` [K] with
  ``actorder: "group"``; ``weight_shape`` [2].

Group sizes 32, 64, 128 and 256 (the kernels' layout, turnout/ops/reference/w4a16.py); per-channel weights
(``group_size: -1``), other bit widths and activation quantisation are refused naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnout.ops.w4_layout import GROUP_SIZES

W4_METHODS = ("awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class W4Config:
    """fmt: "awq" | "gptq" | "ct" | "gguf". zero_points: the checkpoint stores integer zero points (else symmetric,
    zero 8 on the unsigned scale). act_order: g_idx may order the input columns (GPTQ desc_act, compressed-
    tensors actorder "group"). zero_offset: added to a stored zero point (GPTQ's "gptq" format: 1)."""

    fmt: str
    group_size: int
    zero_points: bool
    act_order: bool
    zero_offset: int = 0
    source: str = ""

    @property
    def names(self) -> dict[str, str]:
        """role -> the checkpoint's parameter name of a linear layer."""
        if self.fmt == "gguf":  # turnout/loader/gguf_blocks.py: the reader yields the layout's own pieces
            return {"qweight": "qweight", "scales": "scale_zeros"}
        if self.fmt == "ct":
            return {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_zero_point",
                    "g_idx": "weight_g_idx", "shape": "weight_shape"}
        return {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros", "g_idx": "g_idx"}

    def describe(self) -> str:
        # a GGUF file's blocks carry their zero in scale_zeros (Q4_1's minimum), whatever zero_points says
        minimum = self.fmt == "gguf" and "Q4_1" in self.source
        zp = "zero points" if self.zero_points or minimum else "symmetric"
        order = ", activation order" if self.act_order else ""
        return f"w4a16 ({self.source}: 4-bit weights, group {self.group_size}, {zp}{order})"


def _get(qc, key, default=None):
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def _bad(field: str, why: str):
    raise ValueError(f"{field}: {why}")


def _group(value, field: str) -> int:
    if value not in GROUP_SIZES:
        _bad(field, f"group size {value!r} is not supported ({', '.join(map(str, GROUP_SIZES))}; per-channel "
                    "4-bit weights have no kernel here)")
    return int(value)


def _bits(value, field: str) -> None:
    if value != 4:
        _bad(field, f"{value!r}-bit weights are not supported (4)")


def awq_config(qc) -> W4Config:
    _bits(_get(qc, "bits", _get(qc, "w_bit")), "quantization_config.bits")
    version = str(_get(qc, "version", "gemm")).lower()
    if version != "gemm":
        _bad("quantization_config.version", f"AWQ {version!r} packing is not supported (gemm)")
    if not _get(qc, "zero_point", True):
        _bad("quantization_config.zero_point", "AWQ without zero points is not supported")
    group = _group(_get(qc, "group_size", _get(qc, "q_group_size")), "quantization_config.group_size")
    return W4Config("awq", group, True, False, 0, "AWQ checkpoint")


def gptq_config(qc) -> W4Config:
    _bits(_get(qc, "bits"), "quantization_config.bits")
    fmt = _get(qc, "checkpoint_format", "gptq") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        _bad("quantization_config.checkpoint_format", f"{fmt!r} is not supported (gptq, gptq_v2)")
    group = _group(_get(qc, "group_size"), "quantization_config.group_size")
    return W4Config("gptq", group, True, bool(_get(qc, "desc_act", False)), 1 if fmt == "gptq" else 0,
                    "GPTQ checkpoint")


def compressed_tensors_config(qc, where: str, weights) -> W4Config:
    """A compressed-tensors group whose weights are integers (the caller found ``type: "int"``)."""
    fmt = _get(qc, "format")
    if fmt != "pack-quantized":
        _bad("quantization_config.format", f"{fmt!r} with integer weights is not supported (pack-quantized)")
    _bits(_get(weights, "num_bits"), f"{where}.weights.num_bits")
    strategy = _get(weights, "strategy")
    if strategy != "group":
        _bad(f"{where}.weights.strategy", f"{strategy!r} is not supported for 4-bit weights (group)")
    group = _group(_get(weights, "group_size"), f"{where}.weights.group_size")
    actorder = _get(weights, "actorder")
    if actorder not in (None, "group", "weight", "static", False):
        _bad(f"{where}.weights.actorder", f"{actorder!r} is not supported (group, weight)")
    return W4Config("ct", group, not _get(weights, "symmetric", True), actorder == "group", 0,
                    "compressed-tensors checkpoint")
