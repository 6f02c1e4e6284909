"""4-bit routed experts (AWQ, GPTQ, compressed-tensors W4A16): the parameters of a quantised ``FusedExperts``
(turnout/layers/moe/experts.py), how each per-expert checkpoint tensor loads into them, and the forward through the
``moe_experts_w4a16`` op (layout: turnout/ops/reference/moe_w4a16.py).

Built with ``plan.experts_quant`` set to a ``W4MoeMethod``, the experts layer calls ``create_weights(experts, ops)``
and runs ``apply`` as its forward. Per stack (``gate_up_proj``: each expert's gate rows then its up rows;
``down_proj``) it holds, under names the model's ``expert_weight_rules`` map the checkpoint's per-expert tensors to
(``experts.N.gate_proj.qweight`` -> ``experts.gate_up_proj_qweight``, shard (N, "gate")):

* the packed weight ``{stack}_qweight`` (compressed-tensors: ``_weight_packed``) uint8 [E_local, N, K/2]: gate/up
  N = 2 I_local, K = H; down N = H, K = I_local; each format's words unpacked, sliced and repacked as they load;
* the scales ``{stack}_scales`` (compressed-tensors: ``_scale_inv``, where its ``weight_scale`` maps) [E_local, K/G,
  N, 2] in the compute dtype, scale and zero ((8 - z') s, recomputed by each loader of the rows it wrote);
* the zero points ``{stack}_qzeros`` (``_weight_zero_point``) uint8 [E_local, K/G, N] (symmetric: a buffer of 8s);
* ``{stack}_g_idx`` (``_weight_g_idx``) int32 [E_local, K] and the ``{stack}_perm`` buffer (activation order: each
  expert's stored columns sorted by group; its gate and up must share one order, checked); ``_weight_shape``
  (compressed-tensors) checked against the expert's shape.

Tensor parallelism splits the intermediate dim as the float experts do: a rank's I_local must be whole 64-row blocks
(gate, up) and whole groups (down's K); activation order scatters down's groups over I, so it takes one rank or
expert parallelism, which keeps experts whole. Both are checked when the layer is built, naming the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnout.ops.w4_layout import ROWS, pack_int4, unpack_int4
from turnout.quant.moe_fp8 import _unpack
from turnout.quant.w4 import _dummy_g_idx, _dummy_q, _dummy_scales, _dummy_shape, _dummy_zeros, _param
from turnout.quant.w4_config import W4Config
from turnout.quant.w4_formats import act_order, unpack_q, unpack_scales, unpack_zeros

STACKS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


@dataclass(frozen=True)
class _Part:
    """Where one expert's checkpoint tensor of shard ``gate`` / ``up`` / ``down`` goes: its full [n, k], this rank's
    rows [start, start + rows) and columns [col0, col0 + cols) of it, at local rows [off, off + rows) of the stack."""

    n: int
    k: int
    start: int
    rows: int
    col0: int
    cols: int
    off: int


def stack_names(fmt: str, stack: str) -> dict[str, str]:
    """role -> parameter name of one stack (what expert_weight_rules maps each checkpoint suffix to)."""
    if fmt == "ct":
        return {"qweight": f"{stack}_weight_packed", "scales": f"{stack}_scale_inv",
                "qzeros": f"{stack}_weight_zero_point", "g_idx": f"{stack}_weight_g_idx",
                "shape": f"{stack}_weight_shape"}
    return {role: f"{stack}_{role}" for role in ("qweight", "scales", "qzeros", "g_idx")}


class W4MoeMethod:
    """The 4-bit parameters and forward of the routed experts of one model (see the module docstring)."""

    def __init__(self, config: W4Config):
        if config.fmt == "gguf":
            raise ValueError("quantization: GGUF MoE experts are not kept in 4-bit blocks")
        self.config = config

    def describe(self) -> str:
        return self.config.describe()

    # ---- parameters ------------------------------------------------------------------------------------
    def create_weights(self, experts, ops) -> None:
        if ops is None:
            raise ValueError("4-bit MoE experts need the op table (ops=...)")
        cfg, g = self.config, self.config.group_size
        el, il, h = experts.num_local_experts, experts.local_intermediate, experts.hidden_size
        if h % ROWS or h % g:
            raise ValueError(f"quantization: hidden_size {h} of the 4-bit MoE experts must be whole blocks of {ROWS} "
                             f"rows and whole groups of {g}")
        split = experts.tp.size > 1 and not experts.expert_parallel
        what = (f"moe_intermediate_size {experts.intermediate_size} / tensor_parallel_size {experts.tp.size} = {il}"
                if split else f"moe_intermediate_size {il}")
        if il % ROWS or il % g:
            raise ValueError(f"quantization: a rank's slice of the 4-bit MoE experts ({what}) must be whole blocks of "
                             f"{ROWS} rows and whole groups of {g}" + (" (or enable_expert_parallel, which keeps "
                                                                         "experts whole)" if split else ""))
        if split and cfg.act_order:
            raise ValueError("quantization: 4-bit MoE experts with activation order (desc_act / actorder) cannot split "
                             "their intermediate dim over tensor-parallel ranks: down's groups are scattered over it "
                             "(use enable_expert_parallel)")
        experts.quant_ops = ops
        experts.w4_parts = {}  # (local expert, stack) -> shards loaded, g_idx seen, order (the loaders' bookkeeping)
        dtype = torch.get_default_dtype()
        for stack, (n, k) in (("gate_up_proj", (2 * il, h)), ("down_proj", (h, il))):
            names = stack_names(cfg.fmt, stack)
            shard_ids = experts.shard_ids(STACKS[stack])
            made = [(names["qweight"], _param(torch.empty(el, n, k // 2, dtype=torch.uint8),
                                              self._q_loader(experts, stack), _dummy_q)),
                    (names["scales"], _param(torch.zeros(el, k // g, n, 2, dtype=dtype),
                                             self._scale_loader(experts, stack), _dummy_scales))]
            zeros = torch.full((el, k // g, n), 8, dtype=torch.uint8)
            if cfg.zero_points:
                made.append((names["qzeros"], _param(zeros, self._zero_loader(experts, stack), _dummy_zeros)))
            else:
                experts.register_buffer(f"{stack}_w4_zeros", zeros)
            if cfg.fmt == "gptq" or cfg.act_order:
                made.append((names["g_idx"], _param(torch.zeros(el, k, dtype=torch.int32),
                                                    self._g_idx_loader(experts, stack), _dummy_g_idx)))
            if "shape" in names:
                made.append((names["shape"], _param(torch.zeros(el, 2, dtype=torch.int64),
                                                    self._shape_loader(experts), _dummy_shape)))
            for name, p in made:
                p.shard_ids = shard_ids
                setattr(experts, name, p)
            experts.register_buffer(f"{stack}_perm", torch.arange(k).repeat(el, 1) if cfg.act_order else None)

    @staticmethod
    def _part(experts, shard: str) -> _Part:
        i, h, i0, il = experts.intermediate_size, experts.hidden_size, experts.inter_start, experts.local_intermediate
        if shard == "down":
            return _Part(h, i, 0, h, i0, il, 0)
        return _Part(i, h, i0, il, 0, h, 0 if shard == "gate" else il)

    @staticmethod
    def _local(experts, stack: str, expert_id, shard) -> int | None:
        """This rank's index of the expert, None for another rank's; ValueError for a shard or id out of place."""
        if expert_id is None:
            raise ValueError("4-bit MoE experts load expert by expert (experts.N.gate_proj...), not as a stack")
        if shard not in STACKS[stack]:
            raise ValueError(f"shard {shard!r} does not belong in the {stack} stack")
        e = int(expert_id)
        if not 0 <= e < experts.num_experts:
            raise ValueError(f"expert id {expert_id} out of range [0, {experts.num_experts})")
        e -= experts.expert_start
        return e if 0 <= e < experts.num_local_experts else None

    def _q_loader(self, experts, stack: str):
        fmt, name = self.config.fmt, stack_names(self.config.fmt, stack)["qweight"]

        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            e = self._local(experts, stack, expert_id, shard)
            p = self._part(experts, shard)
            q = unpack_q(fmt, loaded, p.n, p.k, name)
            if e is None or param.is_meta:
                return
            q = q[p.start:p.start + p.rows, p.col0:p.col0 + p.cols]
            parts = experts.w4_parts.setdefault((e, stack), {})
            if parts.get("perm") is not None:
                q = q[:, parts["perm"]]
            param.data[e, p.off:p.off + p.rows] = pack_int4(q.to(param.device))
            parts.setdefault("q", set()).add(shard)
        return load

    def _refresh(self, experts, stack: str, e: int, off: int, rows: int) -> None:
        """zero = (8 - z') s of the expert's rows [off, off + rows), from the scales and zero points held now."""
        names = stack_names(self.config.fmt, stack)
        sz = getattr(experts, names["scales"]).data[e]
        z = getattr(experts, names["qzeros"] if self.config.zero_points else f"{stack}_w4_zeros").data[e]
        s = sz[:, off:off + rows, 0].float()
        sz[:, off:off + rows, 1] = ((8.0 - z[:, off:off + rows].float()) * s).to(sz.dtype)

    def _scale_loader(self, experts, stack: str):
        cfg, name = self.config, stack_names(self.config.fmt, stack)["scales"]

        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            e = self._local(experts, stack, expert_id, shard)
            p = self._part(experts, shard)
            s = unpack_scales(cfg.fmt, loaded, p.n, p.k // cfg.group_size, name)
            if e is None or param.is_meta:
                return
            g0, groups = p.col0 // cfg.group_size, p.cols // cfg.group_size
            param.data[e, :, p.off:p.off + p.rows, 0] = s[p.start:p.start + p.rows, g0:g0 + groups].T.to(param.dtype)
            self._refresh(experts, stack, e, p.off, p.rows)
        return load

    def _zero_loader(self, experts, stack: str):
        cfg, name = self.config, stack_names(self.config.fmt, stack)["qzeros"]

        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            e = self._local(experts, stack, expert_id, shard)
            p = self._part(experts, shard)
            z = unpack_zeros(cfg.fmt, loaded, p.n, p.k // cfg.group_size, cfg.zero_offset, name)
            if e is None or param.is_meta:
                return
            g0, groups = p.col0 // cfg.group_size, p.cols // cfg.group_size
            param.data[e, :, p.off:p.off + p.rows] = z[p.start:p.start + p.rows, g0:g0 + groups].T.to(param.device)
            self._refresh(experts, stack, e, p.off, p.rows)
        return load

    def _g_idx_loader(self, experts, stack: str):
        cfg, name = self.config, stack_names(self.config.fmt, stack)["g_idx"]

        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            e = self._local(experts, stack, expert_id, shard)
            p = self._part(experts, shard)
            if tuple(loaded.shape) != (p.k,):
                raise ValueError(f"{name} {tuple(loaded.shape)} disagrees with the expert's input size {p.k}")
            if e is None or param.is_meta:
                return
            g = loaded.narrow(0, p.col0, p.cols).to(torch.int64) - p.col0 // cfg.group_size
            perm = act_order(g, cfg.group_size, name)
            if perm is not None and not cfg.act_order:
                raise ValueError(f"{name} orders the input columns, but quantization_config.desc_act is false")
            parts = experts.w4_parts.setdefault((e, stack), {})
            if "g_idx" in parts:  # the expert's gate and up read one input: one order
                if not torch.equal(parts["g_idx"], g):
                    raise ValueError(f"{name} of expert {expert_id} {shard} differs from its other part's: an "
                                     "expert's gate and up must share one activation order")
                return
            parts["g_idx"] = g
            param.data[e] = loaded.narrow(0, p.col0, p.cols).to(param.dtype)
            if perm is None:
                return
            parts["perm"] = perm
            getattr(experts, f"{stack}_perm")[e] = perm
            qweight = getattr(experts, stack_names(cfg.fmt, stack)["qweight"]).data[e]
            for done in parts.get("q", ()):  # parts loaded before their order was known
                off, rows = self._part(experts, done).off, self._part(experts, done).rows
                qweight[off:off + rows] = pack_int4(unpack_int4(qweight[off:off + rows])[:, perm.to(qweight.device)])
        return load

    def _shape_loader(self, experts):
        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            p = self._part(experts, shard)
            got = tuple(int(v) for v in loaded.reshape(-1).tolist()) if not loaded.is_meta else (p.n, p.k)
            if got != (p.n, p.k):
                raise ValueError(f"weight_shape {got} disagrees with expert {expert_id} {shard}'s {(p.n, p.k)}")
        return load

    # ---- forward ---------------------------------------------------------------------------------------
    def apply(self, experts, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        gu, dn = stack_names(self.config.fmt, "gate_up_proj"), stack_names(self.config.fmt, "down_proj")
        return experts.quant_ops.moe_experts_w4a16(
            hidden, getattr(experts, gu["qweight"]), getattr(experts, gu["scales"]), getattr(experts, dn["qweight"]),
            getattr(experts, dn["scales"]), topk_weights, topk_ids, self.config.group_size,
            experts.gate_up_proj_perm, experts.down_proj_perm)
