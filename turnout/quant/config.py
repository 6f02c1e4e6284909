"""Which quantisation a model runs with: its checkpoint's ``quantization_config``, or ``quantization="fp8"``.

Two checkpoint families are read (the fields as their producers write them):

* ``quant_method: "fp8"`` (transformers' fine-grained FP8, DeepSeek-V3, the Qwen3 FP8 releases, AutoFP8):
  ``weight_block_size: [128, 128]`` means 128 x 128 block scales in ``<linear>.weight_scale_inv`` and
  activations quantised per token and 128-wide group (``activation_scheme: "dynamic"``); without it, one
  scale per tensor in ``<linear>.weight_scale`` and activations per token (``dynamic``) or with the
  checkpoint's per-tensor ``<linear>.input_scale`` (``static``);
* ``quant_method: "compressed-tensors"`` with 8-bit float weights (W8A8-FP8, FP8_DYNAMIC): per-channel
  (``strategy: "channel"``, ``weight_scale [N, 1]``), per-tensor or block weights, and activations dynamic
  per token, static per tensor (``input_scale``), or not quantised (weight-only, W8A16).

``quantization="fp8"`` on an unquantised checkpoint quantises the decoder's linear weights while they load:
one scale per output channel (max |w| / 448 of each row) and activations per token. Per-channel rather than
block 128: it is the more accurate of the two for the same bytes (a scale per row instead of per 128 rows),
and its GEMM is the row-wise scaled one the vendor libraries ship (``torch._scaled_mm``).

Quantised are the decoder's linear layers (qkv, o, gate_up, down, a shared expert's) and the routed MoE experts;
the embedding, the LM head, norms and MoE routers stay in the compute dtype. The experts take 128 x 128 block
scales and activations per token and 128 group (``experts_config``): the block checkpoints (Qwen3-30B-A3B-FP8,
DeepSeek-V3; compressed-tensors' FP8_BLOCK), and ``quantization="fp8"``, which quantises them in blocks (the
layout their kernel takes) while the dense layers get per-channel scales. Partially quantised decoders (a
decoder projection named in ``ignore`` / ``modules_to_not_convert``) and the experts of a checkpoint in another
layout are refused, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf")  # EngineConfig.quantization / --quantization
# (vLLM's spellings: awq, gptq, compressed-tensors name the checkpoint's own method, turnout/quant/w4_config.py;
# gguf keeps a GGUF file's 4-bit blocks, turnout/loader/gguf_blocks.py)
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                    "gate_up_proj")
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Fp8Config:
    """weights: "row" (a scale per output row; per-tensor checkpoint scales are broadcast) or "block"
    (128 x 128). activations: "none" (weight-only), "token" (dynamic per token), "group" (dynamic per token
    and 128 group of K) or "static" (the checkpoint's per-tensor input_scale). checkpoint: the weights
    arrive in fp8 (False: quantised at load). scale_name: the checkpoint's name of the weight scale."""

    weights: str
    activations: str
    checkpoint: bool
    scale_name: str = "weight_scale"
    source: str = ""
    # the field that keeps MoE experts from this layout ("" where the experts can take it: block weights with
    # activations per 128 group, or quantised at load)
    experts_field: str = ""

    def describe(self) -> str:
        acts = {"none": "weight-only", "token": "activations per token", "group": "activations per 128 group",
                "static": "static activation scales"}[self.activations]
        w = "128x128 block" if self.weights == "block" else "per-channel"
        return f"fp8 e4m3 ({self.source}: {w} weight scales, {acts})"


def _get(qc, key, default=None):
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def _as_dict(qc):
    if qc is None or isinstance(qc, dict):
        return qc
    to_dict = getattr(qc, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(vars(qc))


def _bad(field: str, why: str):
    raise ValueError(f"{field}: {why}")


def _check_ignored(names, field: str) -> None:
    for name in names or ():
        if any(part in str(name) for part in _DECODER_LINEARS):
            _bad(field, f"{name!r} keeps a decoder projection unquantised; partially quantised decoders are not "
                        "supported (only the LM head, embeddings and routers stay unquantised)")


def _hf_fp8(qc) -> Fp8Config:
    fmt = _get(qc, "fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        _bad("quantization_config.fmt", f"{fmt!r} is not supported (e4m3)")
    scheme = _get(qc, "activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        _bad("quantization_config.activation_scheme", f"unknown scheme {scheme!r} (dynamic, static)")
    _check_ignored(_get(qc, "modules_to_not_convert"), "quantization_config.modules_to_not_convert")
    block = _get(qc, "weight_block_size")
    if block is not None:
        if list(block) != [128, 128]:
            _bad("quantization_config.weight_block_size", f"{list(block)} is not supported ([128, 128])")
        if scheme != "dynamic":
            _bad("quantization_config.activation_scheme", "block-scaled fp8 takes dynamic activations")
        return Fp8Config("block", "group", True, "weight_scale_inv", "fp8 checkpoint")
    return Fp8Config("row", "token" if scheme == "dynamic" else "static", True, "weight_scale", "fp8 checkpoint",
                     "quantization_config.weight_block_size")


def _compressed_tensors(qc) -> Fp8Config:
    fmt = _get(qc, "format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        _bad("quantization_config.format", f"{fmt!r} is not supported (float-quantized)")
    groups = _get(qc, "config_groups") or {}
    if len(groups) != 1:
        _bad("quantization_config.config_groups", f"exactly one group is supported, got {len(groups)}")
    (name, group), = groups.items()
    where = f"quantization_config.config_groups.{name}"
    targets = list(_get(group, "targets") or [])
    if "Linear" not in targets:
        _bad(f"{where}.targets", f"{targets} does not target Linear layers")
    w = _get(group, "weights") or {}
    if _get(w, "type") != "float" or _get(w, "num_bits") != 8:
        _bad(f"{where}.weights", f"only 8-bit float weights are supported, got {_get(w, 'num_bits')}-bit "
                                 f"{_get(w, 'type')!r}")
    strategy = _get(w, "strategy")
    if strategy in ("channel", "tensor"):
        weights = "row"
    elif strategy == "block" and list(_get(w, "block_structure") or []) == [128, 128]:
        weights = "block"
    else:
        _bad(f"{where}.weights.strategy", f"{strategy!r} is not supported (channel, tensor, block [128, 128])")
    a = _get(group, "input_activations")
    if a is None:
        acts = "none"
    else:
        if _get(a, "type") != "float" or _get(a, "num_bits") != 8:
            _bad(f"{where}.input_activations", "only 8-bit float activations are supported")
        kind = (bool(_get(a, "dynamic")), _get(a, "strategy"))
        acts = {(True, "token"): "token", (False, "tensor"): "static", (True, "group"): "group"}.get(kind)
        if acts == "group" and _get(a, "group_size") != 128:
            acts = None
        if acts is None:
            _bad(f"{where}.input_activations", f"dynamic={kind[0]} strategy={kind[1]!r} is not supported "
                 "(dynamic per token, dynamic per 128 group, static per tensor)")
    _check_ignored(_get(qc, "ignore"), "quantization_config.ignore")
    experts_field = "" if (weights, acts) == ("block", "group") else \
        f"{where}.weights.strategy" if weights != "block" else f"{where}.input_activations"
    return Fp8Config(weights, acts, True, "weight_scale", "compressed-tensors checkpoint", experts_field)


def _int_weights(qc) -> tuple[str, dict] | None:
    """(where, weights) of a compressed-tensors config whose one group has integer weights, else None."""
    groups = _get(qc, "config_groups") or {}
    if len(groups) != 1:
        return None
    (name, group), = groups.items()
    w = _get(group, "weights") or {}
    return (f"quantization_config.config_groups.{name}", w) if _get(w, "type") == "int" else None


def _w4(hf_config, qc, method: str, quantization: str | None):
    """The 4-bit weight config of an AWQ / GPTQ / compressed-tensors int checkpoint (turnout/quant/w4_config.py)."""
    from turnout.quant import w4_config

    if quantization is not None and quantization != method:
        _bad("quantization", f"{quantization!r} does not match the checkpoint's quantization_config.quant_method "
                             f"{method!r}")
    if method == "awq":
        cfg = w4_config.awq_config(qc)
    elif method == "gptq":
        cfg = w4_config.gptq_config(qc)
    else:
        where, weights = _int_weights(qc)
        if _get(_get(qc, "config_groups")[where.rpartition(".")[2]], "input_activations") is not None:
            _bad(f"{where}.input_activations", "integer weights with quantised activations are not supported "
                                               "(4-bit weights take float activations)")
        _check_ignored(_get(qc, "ignore"), "quantization_config.ignore")
        cfg = w4_config.compressed_tensors_config(qc, where, weights)
    _check_ignored(_get(qc, "modules_to_not_convert"), "quantization_config.modules_to_not_convert")
    return cfg


def quant_config(hf_config, quantization: str | None = None):
    """The quantisation a model of ``hf_config`` runs with: an ``Fp8Config``, a ``W4Config``
    (turnout/quant/w4_config.py) or None; ValueError naming the field."""
    if quantization is not None and quantization not in METHODS:
        _bad("quantization", f"unknown method {quantization!r} ({', '.join(METHODS)})")
    qc = _as_dict(getattr(hf_config, "quantization_config", None))
    if qc:
        method = _get(qc, "quant_method")
        if method in ("awq", "gptq") or (method == "compressed-tensors" and _int_weights(qc)):
            return _w4(hf_config, qc, method, quantization)
        if quantization not in (None, "fp8"):
            _bad("quantization", f"{quantization!r} does not match the checkpoint's quantization_config."
                                 f"quant_method {method!r}")
        if method == "fp8":
            cfg = _hf_fp8(qc)
        elif method == "compressed-tensors":
            cfg = _compressed_tensors(qc)
        elif method == "mxfp4" and getattr(hf_config, "model_type", None) == "gpt_oss":
            # GPT-OSS's MXFP4 experts are dequantised while they load (turnout/quant/mxfp4.py), the rest is stored
            # unquantised: an unquantised checkpoint as far as the methods here go
            return quant_config(_without_quantization_config(hf_config), quantization)
        else:
            _bad("quantization_config.quant_method", f"{method!r} is not supported (fp8, awq, gptq, "
                 "compressed-tensors)")
    elif quantization in ("awq", "gptq", "compressed-tensors"):
        _bad("quantization", f"{quantization!r} reads a checkpoint quantised that way, and this one has no "
                             "quantization_config (only fp8 quantises a float checkpoint at load)")
    elif quantization == "gguf":  # the loader reads the file's blocks itself
        return None
    elif quantization == "fp8":
        cfg = Fp8Config("row", "token", False, source="quantised at load")
    else:
        return None
    experts = [f for f in _EXPERT_FIELDS if (getattr(hf_config, f, 0) or 0) > 0]
    if experts and cfg.experts_field:
        family = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
        _bad(cfg.experts_field, f"fp8 MoE experts ({family}, {experts[0]}={getattr(hf_config, experts[0])}) take "
             "128x128 block weight scales with activations per token and 128 group (weight_block_size [128, 128]; "
             f"compressed-tensors block with dynamic group 128 activations); this checkpoint is {cfg.describe()}")
    return cfg


def _without_quantization_config(hf_config):
    import copy

    plain = copy.copy(hf_config)
    plain.quantization_config = None
    return plain


def has_experts(hf_config) -> bool:
    return any((getattr(hf_config, f, 0) or 0) > 0 for f in _EXPERT_FIELDS)


def experts_config(cfg: Fp8Config) -> Fp8Config:
    """The routed experts' layout under the model's quantisation ``cfg`` (accepted by ``quant_config``): a block
    checkpoint's own; quantised at load, 128 x 128 blocks (the dense layers' per-channel scales have no kernel for
    the experts; blocks are the layout the block checkpoints ship)."""
    if cfg.checkpoint:
        return cfg
    return Fp8Config("block", "group", False, "weight_scale_inv", cfg.source)
