"""FP8 routed experts: the parameters of a quantised ``FusedExperts`` (turnout/layers/moe/experts.py), how checkpoint
tensors load into them, and its forward through the ``moe_experts_fp8`` op.

Built with ``plan.experts_quant`` set to an ``Fp8MoeMethod``, the experts layer calls ``create_weights(experts, ops)``
in its constructor and ``apply(experts, hidden, topk_weights, topk_ids)`` as its forward. It holds:

* ``gate_up_proj [E_local, 2 I_local, H]`` and ``down_proj [E_local, H, I_local]`` float8_e4m3fn, the stacks of the
  float layer (gate rows then up rows), sliced per rank the same way;
* ``gate_up_proj_scale_inv [E_local, 2 ceil(I_local/128), ceil(H/128)]`` (the gate's 128 x 128 blocks, then the
  up's) and ``down_proj_scale_inv [E_local, ceil(H/128), ceil(I_local/128)]`` float32: the op's layout
  (turnout/ops/reference/moe_fp8.py), the names transformers' FP8 experts give the stacked scales. A checkpoint's
  per-expert ``experts.N.gate_proj.weight_scale_inv`` (compressed-tensors: ``weight_scale``) maps to its expert's
  block rows (``expert_weight_rules``).

Under tensor parallelism a rank's intermediate slice must start and end on a 128 block (else the blocks of the
checkpoint would straddle two ranks): refused when the layer is built, naming the sizes. Expert parallelism keeps
experts whole and needs nothing. Quantised at load (``checkpoint=False``) each float expert tensor is sliced for the
rank, then quantised in 128 x 128 blocks (max |w| / 448 of each block), and the scales are buffers. With
``--load-format dummy`` the fp8 stacks fill as the dense ones do (fp8 N(0, 1), scale 0.02).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnout.quant.config import Fp8Config
from turnout.quant.fp8 import BLOCK, FP8, FP8_MAX, _cdiv, _dummy_fill, _dummy_fp8, _param

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # as quantize_fp8's: an all-zero block must not divide by zero
SCALES = {"gate_up_proj": "gate_up_proj_scale_inv", "down_proj": "down_proj_scale_inv"}


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (fp8 [N, K], float32 scales [ceil(N/128), ceil(K/128)]): max |w| / 448 per 128 x 128
    block, w / scale rounded to nearest. Load-time arithmetic on the weight's device, not a kernel."""
    n, k = w.shape
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    wf = w.float()
    padded = F.pad(wf.abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    scale = (padded.view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (wf / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _unpack(expert_id, shard):
    return expert_id if isinstance(expert_id, tuple) else (expert_id, shard)


class Fp8MoeMethod:
    """The fp8 forward and parameters of the routed experts of one model (see the module docstring); ``config``
    is block weights with activations per 128 group (``turnout.quant.config.experts_config``)."""

    def __init__(self, config: Fp8Config):
        if (config.weights, config.activations) != ("block", "group"):
            raise ValueError(f"fp8 MoE experts take 128x128 block weights and activations per 128 group, got "
                             f"{config.describe()}")
        self.config = config

    def describe(self) -> str:
        return self.config.describe()

    # ---- parameters ------------------------------------------------------------------------------------
    def create_weights(self, experts, ops) -> None:
        if ops is None:
            raise ValueError("fp8 MoE experts need the op table (ops=...)")
        el, il, h = experts.num_local_experts, experts.local_intermediate, experts.hidden_size
        if experts.tp.size > 1 and not experts.expert_parallel and il % BLOCK:
            raise ValueError(f"quantization: a rank's slice of the MoE experts (moe_intermediate_size "
                             f"{experts.intermediate_size} / tensor_parallel_size {experts.tp.size} = {il} rows) does "
                             f"not start on a {BLOCK} x {BLOCK} fp8 block; block scales need 128-row slices "
                             "(or enable_expert_parallel, which keeps experts whole)")
        experts.quant_ops = ops
        ckpt = self.config.checkpoint
        weights = self._fp8_loader(experts) if ckpt else self._online_loader(experts)
        experts.gate_up_proj = _param(torch.empty(el, 2 * il, h, dtype=FP8), weights, _dummy_fp8)
        experts.down_proj = _param(torch.empty(el, h, il, dtype=FP8), weights, _dummy_fp8)
        nb_i, nb_h = _cdiv(il, BLOCK), _cdiv(h, BLOCK)
        for name, shape, shards in (("gate_up_proj_scale_inv", (el, 2 * nb_i, nb_h), ("gate", "up")),
                                    ("down_proj_scale_inv", (el, nb_h, nb_i), ("down",))):
            scale = torch.empty(shape, dtype=torch.float32)
            if ckpt:
                setattr(experts, name, _param(scale, self._scale_loader(experts), _dummy_fill))
                getattr(experts, name).shard_ids = experts.shard_ids(shards)
            else:  # quantised at load: the scales are made, not read
                experts.register_buffer(name, scale.fill_(0.02))

    def _fp8_loader(self, experts):
        def load(param, loaded, expert_id=None, shard=None):
            if loaded.dtype != FP8:
                raise ValueError(f"expected a float8_e4m3fn weight ({self.config.source}), got "
                                 f"{str(loaded.dtype).replace('torch.', '')}")
            experts.weight_loader(param, loaded, expert_id, shard)
        return load

    @staticmethod
    def _scale_loader(experts):
        """Block scales of one expert's gate / up ([ceil(I/128), ceil(H/128)]) or down ([ceil(H/128), ceil(I/128)]),
        or the stacks whole ([E, 2 ceil(I/128), .] / [E, ., ceil(I/128)]): this rank's block rows / columns."""
        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            gate_up = param is experts.gate_up_proj_scale_inv
            nb_full, nb_h = _cdiv(experts.intermediate_size, BLOCK), _cdiv(experts.hidden_size, BLOCK)
            b0, nb = experts.inter_start // BLOCK, _cdiv(experts.local_intermediate, BLOCK)
            e0, el = experts.expert_start, experts.num_local_experts
            loaded = loaded.float()
            if expert_id is None:
                want = (experts.num_experts, 2 * nb_full, nb_h) if gate_up else (experts.num_experts, nb_h, nb_full)
                _check_shape("the stacked expert scales", want, loaded)
                mine = loaded.narrow(0, e0, el)
                if gate_up:
                    param.data.narrow(1, 0, nb).copy_(mine.narrow(1, b0, nb))
                    param.data.narrow(1, nb, nb).copy_(mine.narrow(1, nb_full + b0, nb))
                else:
                    param.data.copy_(mine.narrow(2, b0, nb))
                return
            if gate_up != (shard in ("gate", "up")) or shard not in ("gate", "up", "down"):
                raise ValueError(f"shard {shard!r} does not belong in this parameter {tuple(param.shape)}")
            e = int(expert_id)
            if not 0 <= e < experts.num_experts:
                raise ValueError(f"expert id {expert_id} out of range [0, {experts.num_experts})")
            _check_shape(f"expert {e} {shard}", (nb_h, nb_full) if shard == "down" else (nb_full, nb_h), loaded)
            if not e0 <= e < e0 + el:  # another rank's expert
                return
            if shard == "down":
                param.data[e - e0].copy_(loaded.narrow(1, b0, nb))
            else:
                param.data[e - e0].narrow(0, 0 if shard == "gate" else nb, nb).copy_(loaded.narrow(0, b0, nb))
        return load

    @staticmethod
    def _online_loader(experts):
        """Slice a float expert tensor for this rank, then quantise it in blocks into the stack and its scales."""
        def load(param, loaded, expert_id=None, shard=None):
            expert_id, shard = _unpack(expert_id, shard)
            if loaded.dtype == FP8:
                raise ValueError("an fp8 tensor in a checkpoint without quantization_config")
            gate_up = param is experts.gate_up_proj
            inter, hidden = experts.intermediate_size, experts.hidden_size
            if expert_id is None:  # a stacked tensor [E, 2I, H] / [E, H, I]: expert by expert
                want = (experts.num_experts, 2 * inter, hidden) if gate_up else (experts.num_experts, hidden, inter)
                _check_shape("the stacked experts", want, loaded)
                for e in range(experts.expert_start, experts.expert_start + experts.num_local_experts):
                    if gate_up:
                        load(param, loaded[e, :inter], e, "gate")
                        load(param, loaded[e, inter:], e, "up")
                    else:
                        load(param, loaded[e], e, "down")
                return
            if gate_up != (shard in ("gate", "up")) or shard not in ("gate", "up", "down"):
                raise ValueError(f"shard {shard!r} does not belong in this parameter {tuple(param.shape)}")
            placed = experts.rank_slice(loaded, expert_id, shard)
            if placed is None or param.is_meta:  # another rank's expert; or update_weights' check: it fits
                return
            e, part = placed
            q, s = quantize_blocks(part.to(param.device))
            scale = getattr(experts, SCALES["gate_up_proj" if gate_up else "down_proj"])
            if shard == "down":
                param.data[e].copy_(q)
                scale[e].copy_(s)
            else:
                half = 0 if shard == "gate" else 1
                param.data[e].narrow(0, half * q.shape[0], q.shape[0]).copy_(q)
                scale[e].narrow(0, half * s.shape[0], s.shape[0]).copy_(s)
        return load

    # ---- forward ---------------------------------------------------------------------------------------
    @staticmethod
    def apply(experts, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return experts.quant_ops.moe_experts_fp8(hidden, experts.gate_up_proj, experts.gate_up_proj_scale_inv,
                                                 experts.down_proj, experts.down_proj_scale_inv, topk_weights,
                                                 topk_ids)


def _check_shape(what: str, want: tuple, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(want):
        raise ValueError(f"shape mismatch for {what}: checkpoint tensor {tuple(loaded.shape)}, parameter expects "
                         f"{tuple(want)}")
