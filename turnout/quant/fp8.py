"""FP8 linear layers: the parameters a quantised linear layer holds, how checkpoint tensors load into them
(tensor-parallel slices and packed parts included), and its forward through the fp8 ops.

A linear layer built with ``plan.linear_quant`` set to an ``Fp8LinearMethod`` (turnout/layers/linear.py)
calls ``create_weights(layer, ops)`` once, in its constructor, and ``apply(layer, x, bias)`` as its forward.
Its parameters keep the checkpoint's names, so the declarative weight map (q_proj -> qkv_proj shard "q")
loads them unchanged:

* ``weight [N, K]`` float8_e4m3fn (this rank's slice, as for an unquantised layer);
* ``weight_scale [N, 1]`` float32 (per channel; a per-tensor checkpoint scale is broadcast to the rows of its
  tensor, so the packed q, k and v each keep their own), or ``weight_scale_inv [ceil(N/128), ceil(K/128)]``
  (128 x 128 blocks: they shard by block, so a rank's rows / columns and every packed part must start on a
  block; checked when the layer is built);
* ``input_scale [1]`` (static activations): the largest of the packed parts' scales, as one activation
  quantisation feeds them all.

Quantised at load (``checkpoint=False``) the weight's loader quantises each row of the whole float checkpoint
tensor, then loads the fp8 tensor and its row scales as a per-channel checkpoint's (the layer's own slicing), so
a tensor-parallel rank holds exactly its slice of the one-rank model; the row scales are a buffer, not a
checkpoint tensor. With ``--load-format dummy`` the parameters say how to fill themselves
(``dummy_init``): fp8 weights N(0, 1) with scale ``std``, so the value is N(0, std^2) as for float weights.
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.linear import RowParallelLinear
from turnout.layers.weights import check_shape
from turnout.quant.config import Fp8Config

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _param(t: torch.Tensor, loader, dummy) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader, p.dummy_init = loader, dummy
    return p


class Fp8LinearMethod:
    """The fp8 forward and parameters of the linear layers of one model (see the module docstring).

    ``weight_only_rows``: inputs of at most this many rows take the weight-only ``fp8_linear`` op even when
    the checkpoint quantises activations (0: never). Set from the op table when the implementation chosen for
    ``fp8_linear`` declares it pays (a kernel streaming the fp8 weight at decode, where quantising the one
    row would cost a launch and buy nothing); on the host the checkpoint's scheme is followed exactly."""

    def __init__(self, config: Fp8Config, weight_only_rows: int = 0):
        self.config = config
        self.weight_only_rows = weight_only_rows

    def describe(self) -> str:
        return self.config.describe()

    # ---- parameters ------------------------------------------------------------------------------------
    def create_weights(self, layer, ops) -> None:
        if ops is None:
            raise ValueError("an fp8 linear layer needs the op table (ops=...)")
        cfg = self.config
        n, k = layer.weight.shape
        device = layer.weight.device
        layer.quant_ops = ops
        loader = layer.weight_loader if cfg.checkpoint else self._online_loader(layer)
        layer.weight = _param(torch.empty(n, k, dtype=FP8, device=device), self._checked(loader), _dummy_fp8)
        if cfg.weights == "block":
            self._check_blocks(layer)
            scale = torch.empty(_cdiv(n, BLOCK), _cdiv(k, BLOCK), dtype=torch.float32, device=device)
            setattr(layer, cfg.scale_name, _param(scale, self._block_loader(layer), _dummy_fill))
        elif cfg.checkpoint:
            scale = torch.empty(n, 1, dtype=torch.float32, device=device)
            setattr(layer, cfg.scale_name, _param(scale, self._row_loader(layer), _dummy_fill))
        else:  # quantised at load: the scales are made, not read
            layer.register_buffer(cfg.scale_name, torch.full((n, 1), 0.02, dtype=torch.float32, device=device))
        if cfg.activations == "static":
            layer.input_scale = _param(torch.zeros(1, dtype=torch.float32, device=device), _max_loader,
                                       _dummy_one)
        layer.weight_scale_ref = cfg.scale_name

    def _checked(self, loader):
        def load(param, loaded, shard_id=None):
            if self.config.checkpoint and loaded.dtype != FP8:
                raise ValueError(f"expected a float8_e4m3fn weight ({self.config.source}), got "
                                 f"{str(loaded.dtype).replace('torch.', '')}")
            return loader(param, loaded) if shard_id is None else loader(param, loaded, shard_id)
        return load

    @staticmethod
    def _rows(layer, shard_id) -> tuple[int, int, int]:
        """(first local row, local rows, full rows of the checkpoint tensor) that ``shard_id`` loads."""
        if shard_id is not None and hasattr(layer, "shard_offsets"):
            off, size = layer.shard_offsets[shard_id]
            return off, size, layer.shard_sizes[shard_id]
        n = layer.weight.shape[0]
        return 0, n, n if isinstance(layer, RowParallelLinear) else n * layer.tp_size

    def _row_loader(self, layer):
        def load(param, loaded, shard_id=None):
            loaded = loaded.float()
            if loaded.numel() == 1:  # per tensor: one scale for every row of this tensor
                loaded = loaded.reshape(1, 1).expand(self._rows(layer, shard_id)[2], 1)
            loaded = loaded.reshape(-1, 1)
            if isinstance(layer, RowParallelLinear):  # rows are whole on every rank
                check_shape(param, loaded)
                param.data.copy_(loaded)
            else:
                layer.weight_loader(param, loaded, shard_id)
        return load

    @staticmethod
    def _check_blocks(layer) -> None:
        name = type(layer).__name__
        if isinstance(layer, RowParallelLinear):
            if layer.tp_size > 1 and layer.weight.shape[1] % BLOCK:
                raise ValueError(f"quantization: {name} input slice {layer.weight.shape[1]} of a rank is not a "
                                 f"multiple of the fp8 block size {BLOCK}")
            return
        parts = (list(layer.shard_offsets.items()) if hasattr(layer, "shard_offsets")
                 else [(None, (0, layer.weight.shape[0]))])
        n = layer.weight.shape[0]
        for sid, (off, size) in parts:
            start = layer.shard_starts[sid] if sid is not None else layer.tp_rank * size
            tail = off + size == n and layer.tp_size == 1
            if off % BLOCK or start % BLOCK or (size % BLOCK and not tail):
                what = f"part {sid!r}" if sid is not None else "rows"
                raise ValueError(f"quantization: {name} {what} at row {off} ({size} rows) does not start on a "
                                 f"{BLOCK} x {BLOCK} fp8 block; block scales need block-aligned parts and slices")

    def _block_loader(self, layer):
        def load(param, loaded, shard_id=None):
            loaded = loaded.float()
            if isinstance(layer, RowParallelLinear):
                cols = param.shape[1]
                src = loaded.narrow(1, layer.tp_rank * cols, cols) if layer.tp_size > 1 else loaded
                check_shape(param, src)
                param.data.copy_(src)
                return
            off, size, full = self._rows(layer, shard_id)
            start = layer.shard_starts[shard_id] if shard_id is not None else layer.tp_rank * size
            want = (_cdiv(full, BLOCK), param.shape[1])
            if tuple(loaded.shape) != want:
                raise ValueError(f"shape mismatch: checkpoint block scales {tuple(loaded.shape)}, expected {want}")
            rows = _cdiv(size, BLOCK)
            param.data.narrow(0, off // BLOCK, rows).copy_(loaded.narrow(0, start // BLOCK, rows))
        return load

    def _online_loader(self, layer):
        """Quantise the whole float checkpoint tensor, one scale per output row (max |w| over all of K / 448), and
        load the fp8 tensor and its scales as a per-channel checkpoint's: a row-parallel rank's slice of K keeps
        the whole row's scale, so every tensor-parallel size stores the same fp8 weights. (Dynamic activation scales
        of a row-parallel input are still each rank's, over its slice of K, as in vLLM: TP=2's logits differ from
        TP=1's by fp8 rounding where activations are quantised.)"""
        scales = self._row_loader(layer)

        def load(param, loaded, shard_id=None):
            if loaded.dtype == FP8:
                raise ValueError("an fp8 tensor in a checkpoint without quantization_config")
            if loaded.dim() != 2:
                raise ValueError(f"expected a 2-D weight, got {tuple(loaded.shape)}")
            args = () if shard_id is None else (shard_id,)
            if param.is_meta:  # update_weights' check against meta stand-ins: does it fit? Write nothing (the
                layer.weight_loader(param, torch.empty(loaded.shape, dtype=FP8, device="meta"), *args)
                return         # scales are a buffer, not stood in)
            q, s = layer.quant_ops.quantize_fp8(loaded.to(param.device), 0, None)  # per row: the op's per-token form
            layer.weight_loader(param, q, *args)  # the layer's own slicing (packed parts, tensor-parallel rows / K)
            scales(getattr(layer, self.config.scale_name), s, *args)
        return load

    # ---- forward ---------------------------------------------------------------------------------------
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ops, cfg = layer.quant_ops, self.config
        scale = getattr(layer, cfg.scale_name)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if cfg.activations == "none" or x2.shape[0] <= self.weight_only_rows:
            y = ops.fp8_linear(x2, layer.weight, scale, bias)
        else:
            group = BLOCK if cfg.activations == "group" else 0
            xq, xs = ops.quantize_fp8(x2, group, layer.input_scale if cfg.activations == "static" else None)
            mm = ops.block_scaled_mm if cfg.weights == "block" else ops.scaled_mm
            y = mm(xq, xs, layer.weight, scale, bias, x.dtype)
        return y.reshape(*lead, y.shape[-1])


def _max_loader(param, loaded, shard_id=None):
    """Static input scales of packed parts: the largest (one quantisation of x feeds every part)."""
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1).to(param.device)))


def _dummy_fp8(param, generator, std):
    flat = param.data.view(-1, param.shape[-1])  # rows of a weight, or of a stack of experts' weights
    for row in range(0, flat.shape[0], 4096):  # in slices: a float32 copy of the whole weight is 4x its bytes
        part = flat[row:row + 4096]
        tmp = torch.empty(part.shape, dtype=torch.float32, device=param.device).normal_(0.0, 1.0, generator=generator)
        part.copy_(tmp.clamp_(-FP8_MAX, FP8_MAX))


def _dummy_fill(param, generator, std):
    param.data.fill_(std)


def _dummy_one(param, generator, std):
    param.data.fill_(1.0)


def make_method(config: Fp8Config | None, ops) -> Fp8LinearMethod | None:
    """The method for a model run with op table ``ops`` (None: unquantised)."""
    if config is None:
        return None
    rows = 0
    impl = ops.chosen_impl("fp8_linear") if "fp8_linear" in getattr(ops, "resolutions", {}) else None
    if impl is not None and config.activations != "none":
        try:
            pays = impl.pays_predicate()
        except Exception:
            pays = None
        rows = 1 if pays is not None and pays(1) else 0
    return Fp8LinearMethod(config, rows)
