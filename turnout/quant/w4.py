"""4-bit linear layers (w4a16): the parameters a layer holds, how each checkpoint tensor loads into them, and the
forward through ``w4a16_linear`` (layout: turnout/ops/reference/w4a16.py).

A linear layer built with ``plan.linear_quant`` set to a ``W4LinearMethod`` calls ``create_weights`` in its
constructor and ``apply`` as its forward. The parameters carry the checkpoint's names (turnout/quant/w4_config.py:
``qweight`` / ``scales`` / ``qzeros`` / ``g_idx``, or compressed-tensors' ``weight_packed`` / ``weight_scale`` /
``weight_zero_point`` / ``weight_g_idx`` / ``weight_shape``), so the weight map loads them unchanged:

* the packed weight: uint8 [N, K/2] in the kernels' layout (every format's words are unpacked and repacked as
  they load; this rank's rows / columns only);
* the scales: [K/G, N, 2] in the compute dtype, scale and zero ((8 - z') s, so (q - 8) s + zero = (q - z') s);
* the zero points: uint8 [K/G, N], z' on the unsigned scale, kept so that scales and zero points may arrive in
  either order (each loader recomputes the zeros of the rows it wrote);
* ``g_idx`` (int32 [K]) and the ``act_perm`` buffer: the stored columns sorted by group; the first packed part's
  order is kept and a later part with another one is refused.

Tensor parallelism slices whole 64-row blocks (column layers: each packed part's rows on this rank must be
whole blocks) and whole groups (row layers: this rank's K must be whole groups; with activation order, which
scatters a group over K, only one rank). Both are checked when the layer is built, naming the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.linear import RowParallelLinear
from turnout.ops.w4_layout import ROWS, pack_int4, unpack_int4
from turnout.quant.w4_config import W4Config
from turnout.quant.w4_formats import act_order, unpack_q, unpack_scales, unpack_zeros


def _param(t: torch.Tensor, loader, dummy=None) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader, p.dummy_init = loader, dummy
    return p


class W4LinearMethod:
    """The 4-bit parameters and forward of the linear layers of one model (see the module docstring)."""

    def __init__(self, config: W4Config):
        self.config = config

    def describe(self) -> str:
        return self.config.describe()

    # ---- parameters ------------------------------------------------------------------------------------
    def create_weights(self, layer, ops) -> None:
        if ops is None:
            raise ValueError("a 4-bit linear layer needs the op table (ops=...)")
        cfg, names = self.config, self.config.names
        n, k = layer.weight.shape
        dtype, device = layer.weight.dtype, layer.weight.device
        self._check_layout(layer, n, k)
        groups = k // cfg.group_size
        layer.quant_ops = ops
        del layer.weight  # the float weight is never held: only its 4-bit form
        layer.w4_names = names
        layer.w4_parts = {}  # shard id -> rows loaded / g_idx seen (the loaders' bookkeeping)
        setattr(layer, names["qweight"], _param(torch.empty(n, k // 2, dtype=torch.uint8, device=device),
                                                self._q_loader(layer), _dummy_q))
        sz = torch.zeros(groups, n, 2, dtype=dtype, device=device)
        setattr(layer, names["scales"], _param(sz, self._scale_loader(layer), _dummy_scales))
        z = torch.full((groups, n), 8, dtype=torch.uint8, device=device)
        if cfg.zero_points:
            setattr(layer, names["qzeros"], _param(z, self._zero_loader(layer), _dummy_zeros))
        else:
            layer.register_buffer("w4_zeros", z)
        if cfg.fmt == "gptq" or cfg.act_order:
            setattr(layer, names["g_idx"], _param(torch.zeros(k, dtype=torch.int32, device=device),
                                                  self._g_idx_loader(layer), _dummy_g_idx))
        layer.register_buffer("act_perm", torch.arange(k, device=device) if cfg.act_order else None)
        if "shape" in names:
            setattr(layer, names["shape"], _param(torch.zeros(2, dtype=torch.int64, device=device),
                                                  self._shape_loader(layer), _dummy_shape))
        for p in layer.parameters(recurse=False):
            if hasattr(layer, "shard_offsets"):
                p.shard_ids = tuple(layer.shard_sizes)

    def _check_layout(self, layer, n: int, k: int) -> None:
        name, g = type(layer).__name__, self.config.group_size
        if k % g:
            raise ValueError(f"quantization: {name} input size {k} of a rank is not a multiple of the 4-bit group "
                             f"size {g}")
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and self.config.act_order:
            raise ValueError(f"quantization: {name} with activation order (desc_act / actorder) cannot split its "
                             "input over tensor-parallel ranks: its groups are scattered over K")
        parts = layer.shard_offsets.items() if hasattr(layer, "shard_offsets") else [(None, (0, n))]
        for sid, (off, size) in parts:
            if off % ROWS or size % ROWS:
                what = f"part {sid!r}" if sid is not None else "output"
                raise ValueError(f"quantization: {name} {what} of {size} rows at row {off} (of this rank) is not "
                                 f"whole blocks of {ROWS} rows, which the 4-bit layout needs")

    @staticmethod
    def _rows(layer, shard_id) -> tuple[int, int, int, int]:
        """(first local row, local rows, first row of the checkpoint tensor, its full rows) ``shard_id`` loads."""
        if shard_id is not None and hasattr(layer, "shard_offsets"):
            off, size = layer.shard_offsets[shard_id]
            return off, size, layer.shard_starts[shard_id], layer.shard_sizes[shard_id]
        n = getattr(layer, layer.w4_names["qweight"]).shape[0]
        if isinstance(layer, RowParallelLinear):
            return 0, n, 0, n
        return 0, n, layer.tp_rank * n, n * layer.tp_size

    def _cols(self, layer, k_local: int) -> tuple[int, int]:
        """(first column of the checkpoint tensor, full columns) of this rank's K."""
        if isinstance(layer, RowParallelLinear):
            return layer.tp_rank * k_local, k_local * layer.tp_size
        return 0, k_local

    def _local(self, layer, shard_id, k_local: int):
        off, size, start, full_n = self._rows(layer, shard_id)
        col0, full_k = self._cols(layer, k_local)
        return off, size, start, full_n, col0, full_k

    def _q_loader(self, layer):
        cfg = self.config

        def load(param, loaded, shard_id=None):
            k_local = param.shape[1] * 2
            off, size, start, full_n, col0, full_k = self._local(layer, shard_id, k_local)
            q = unpack_q(cfg.fmt, loaded, full_n, full_k, layer.w4_names["qweight"])
            if param.is_meta:
                return
            q = q[start:start + size, col0:col0 + k_local]
            perm = layer.w4_parts.get("perm")
            if perm is not None:
                q = q[:, perm.to(q.device)]
            param.data[off:off + size] = pack_int4(q.to(param.device))
            layer.w4_parts.setdefault("q", set()).add(shard_id)
        return load

    def _refresh(self, layer, off: int, size: int) -> None:
        """zero = (8 - z') s of rows [off, off + size), from the scales and zero points held now."""
        sz = getattr(layer, layer.w4_names["scales"]).data
        z = getattr(layer, layer.w4_names["qzeros"]) if self.config.zero_points else layer.w4_zeros
        s = sz[:, off:off + size, 0].float()
        sz[:, off:off + size, 1] = ((8.0 - z.data[:, off:off + size].float()) * s).to(sz.dtype)

    def _scale_loader(self, layer):
        cfg = self.config

        def load(param, loaded, shard_id=None):
            groups = param.shape[0]
            off, size, start, full_n, col0, full_k = self._local(layer, shard_id, groups * cfg.group_size)
            g0, full_g = col0 // cfg.group_size, full_k // cfg.group_size
            if cfg.fmt == "gguf":  # scale and zero as the layout holds them, [N, G, 2]
                if tuple(loaded.shape) != (full_n, full_g, 2):
                    raise ValueError(f"scale_zeros {tuple(loaded.shape)} disagrees with the layer's weight: "
                                     f"expected {(full_n, full_g, 2)}")
                if not param.is_meta:
                    part = loaded[start:start + size, g0:g0 + groups].transpose(0, 1)
                    param.data[:, off:off + size] = part.to(param.device, param.dtype)
                return
            s = unpack_scales(cfg.fmt, loaded, full_n, full_g, layer.w4_names["scales"])
            if param.is_meta:
                return
            param.data[:, off:off + size, 0] = s[start:start + size, g0:g0 + groups].T.to(param.dtype)
            self._refresh(layer, off, size)
        return load

    def _zero_loader(self, layer):
        cfg = self.config

        def load(param, loaded, shard_id=None):
            groups = param.shape[0]
            off, size, start, full_n, col0, full_k = self._local(layer, shard_id, groups * cfg.group_size)
            g0, full_g = col0 // cfg.group_size, full_k // cfg.group_size
            z = unpack_zeros(cfg.fmt, loaded, full_n, full_g, cfg.zero_offset, layer.w4_names["qzeros"])
            if param.is_meta:
                return
            param.data[:, off:off + size] = z[start:start + size, g0:g0 + groups].T.to(param.device)
            self._refresh(layer, off, size)
        return load

    def _g_idx_loader(self, layer):
        cfg = self.config

        def load(param, loaded, shard_id=None):
            k_local = param.shape[0]
            col0, full_k = self._cols(layer, k_local)
            name = layer.w4_names["g_idx"]
            if tuple(loaded.shape) != (full_k,):
                raise ValueError(f"{name} {tuple(loaded.shape)} disagrees with the layer's input size {full_k}")
            if param.is_meta:
                return
            g = loaded.narrow(0, col0, k_local).to(torch.int64) - col0 // cfg.group_size
            perm = act_order(g, cfg.group_size, name)
            if perm is not None and not cfg.act_order:
                raise ValueError(f"{name} orders the input columns, but quantization_config.desc_act is false")
            seen = layer.w4_parts.get("g_idx")
            if seen is not None:
                if not torch.equal(seen, g.to(seen.device)):
                    raise ValueError(f"{name} of part {shard_id!r} differs from another packed part's: packed "
                                     "projections must share one activation order")
                return
            layer.w4_parts["g_idx"] = g
            param.data.copy_(loaded.narrow(0, col0, k_local))
            if perm is None:
                return
            layer.w4_parts["perm"] = perm
            layer.act_perm.copy_(perm)
            qweight = getattr(layer, layer.w4_names["qweight"]).data
            for sid in layer.w4_parts.get("q", ()):  # parts loaded before their order was known
                off, size = self._rows(layer, sid)[:2]
                qweight[off:off + size] = pack_int4(unpack_int4(qweight[off:off + size])[:, perm.to(qweight.device)])
        return load

    def _shape_loader(self, layer):
        def load(param, loaded, shard_id=None):
            full_n, k_local = self._rows(layer, shard_id)[3], getattr(layer, layer.w4_names["qweight"]).shape[1] * 2
            want = (full_n, self._cols(layer, k_local)[1])
            got = tuple(int(v) for v in loaded.reshape(-1).tolist()) if not loaded.is_meta else want
            if got != want:
                raise ValueError(f"{layer.w4_names['shape']} {got} disagrees with the layer's weight {want}")
        return load

    # ---- forward ---------------------------------------------------------------------------------------
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        names = layer.w4_names
        lead = x.shape[:-1]
        y = layer.quant_ops.w4a16_linear(x.reshape(-1, x.shape[-1]), getattr(layer, names["qweight"]),
                                         getattr(layer, names["scales"]), self.config.group_size, layer.act_perm,
                                         bias)
        return y.reshape(*lead, y.shape[-1])


def _dummy_q(param, generator, std):
    # drawn where the generator lives (the loader's generator is on the parameter's device)
    param.data.copy_(torch.randint(0, 256, param.shape, generator=generator, dtype=torch.int32,
                                   device=generator.device).to(torch.uint8))


def _dummy_scales(param, generator, std):
    param.data[..., 0] = std / 4.6  # the uniform 0..15 values less 8 have a deviation of 4.6
    param.data[..., 1] = 0.0


def _dummy_zeros(param, generator, std):
    param.data.fill_(8)


def _dummy_g_idx(param, generator, std):
    param.data.zero_()


def _dummy_shape(param, generator, std):
    pass
