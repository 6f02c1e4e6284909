"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4 MoE Lite): the attention block with its projections.

Per token: queries from ``q_proj`` (V2-Lite) or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` ([H, Dn + R]:
a no-rope part and a rope part per head); one latent ``kv_a_proj_with_mqa`` -> [L + R] whose first L values are
normed (``kv_a_layernorm``) into c and whose last R are the rope key k_pe, shared by every head. The cache keeps
only (c, rotated k_pe): one ``LatentSpec`` vector per token (turnout/kv/spec.py).

Attention is absorbed (turnout/ops/reference/mla.py): each head's no-rope query is taken into the latent space
with its W_UK (the first Dn rows of its slice of ``kv_b_proj``), attends over the latent cache
(``ops.mla_paged_attention``), and its latent output is taken back with its W_UV (the last Dv rows), then
``o_proj``. W_UK / W_UV are views of ``kv_b_proj.weight``, so a weight update reaches them. Decode always; a
prefill sequence where the step's plan (``meta.latent_prefill``, turnout/layers/mla_prefill.py) does not
decompress its context into per-head keys and values instead.

The softmax scale is transformers' ``yarn_apply_mscale``: (Dn + R)^-0.5, times mscale(factor, mscale_all_dim)^2
under YaRN; the cos/sin cache carries YaRN's own attention factor (turnout/layers/rotary.py, from transformers'
init function). Rope runs interleaved (pairs) where the checkpoint says so (``rope_interleave``; V2 always):
transformers' interleaved form stores the rotated pairs de-interleaved, which permutes q_pe and k_pe alike and
leaves every score unchanged.

Tensor parallelism: heads split (``q_b_proj`` / ``q_proj`` / ``kv_b_proj`` by output rows, which are head-major;
``o_proj`` by input), the latent projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` replicated: every rank keeps
the same latent cache for its own heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.attention import AttentionMetadata, _kv_scale
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import ColumnParallelLinear, RowParallelLinear
from turnout.layers.mla_prefill import LatentDims, decompressed_attention
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding, rope_parameters

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(ColumnParallelLinear):
    """``kv_b_proj``: [H (Dn + Dv), L], split by heads. Kept in the compute dtype (the absorbed attention reads it
    as per-head matrices, never through a linear kernel), so a quantisation plan leaves it alone; an fp8 block
    checkpoint's is dequantised as it loads (``dequantize_latent_up``)."""

    quantizable = False


BLOCK = 128  # the fp8 checkpoints' weight block


def dequantize_latent_up(weights):
    """The checkpoint stream with each fp8 ``kv_b_proj.weight`` and its 128 x 128 ``weight_scale_inv`` replaced by
    the float weight (float32; the loader casts), once both have arrived; every other tensor passes through."""
    held: dict[str, dict] = {}
    for name, tensor in weights:
        for suffix in (".kv_b_proj.weight", ".kv_b_proj.weight_scale_inv"):
            if name.endswith(suffix) and (suffix.endswith("_inv") or tensor.dtype == torch.float8_e4m3fn):
                base = name[: -len(suffix)]
                got = held.setdefault(base, {})
                got[suffix] = tensor
                if len(got) == 2:
                    del held[base]
                    w, s = got[".kv_b_proj.weight"], got[".kv_b_proj.weight_scale_inv"].float()
                    n, k = w.shape
                    if s.shape != (-(-n // BLOCK), -(-k // BLOCK)):
                        raise ValueError(f"checkpoint tensor {base}.kv_b_proj.weight_scale_inv {tuple(s.shape)}: "
                                         f"expected ({-(-n // BLOCK)}, {-(-k // BLOCK)}) block scales of its weight "
                                         f"{tuple(w.shape)}")
                    s = s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
                    yield base + ".kv_b_proj.weight", w.float() * s
                break
        else:
            yield name, tensor
    for base, got in held.items():
        missing = ".kv_b_proj.weight_scale_inv" if ".kv_b_proj.weight" in got else ".kv_b_proj.weight"
        raise ValueError(f"checkpoint is missing {base}{missing} (an fp8 kv_b_proj needs its weight and its "
                         f"block scales)")


def mla_softmax_scale(config) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, with YaRN's mscale_all_dim folded in as transformers'
    ``yarn_apply_mscale`` does."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default":
        m_all = params.get("mscale_all_dim", 0)
        factor = float(params.get("factor", 1.0))
        if m_all and factor > 1:
            mscale = 0.1 * float(m_all) * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """``forward(positions, hidden [T, hidden], kv_cache (latent_cache,), meta) -> [T, hidden]``; see the module
    docstring. ``rotary``: a rope over ``qk_rope_head_dim`` (interleaved or not, as the family says)."""

    takes_pending_norm = False  # its first projection is replicated or low-rank: the layer hands it a tensor

    def __init__(self, config, ops, rotary: RotaryEmbedding, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE):
        super().__init__()
        total_heads = config.num_attention_heads
        if total_heads % tp.size:
            raise ValueError(f"num_attention_heads {total_heads} is not divisible by tensor-parallel size {tp.size}")
        self.num_heads = total_heads // tp.size
        self.nope_dim, self.rope_dim = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_dim, self.kv_lora_rank = int(config.v_head_dim), int(config.kv_lora_rank)
        if rotary.rotary_dim != self.rope_dim:
            raise ValueError(f"qk_rope_head_dim {self.rope_dim}: the rope given rotates {rotary.rotary_dim} dims")
        hidden, q_dim = config.hidden_size, self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        lin = dict(ops=ops, plan=plan)
        # The latent projections are whole on every rank: column-parallel over a group of one, so that a
        # quantisation plan reaches them (DeepSeek-V3's fp8 checkpoints quantise them) as it does any projection.
        if self.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias=bias, tp=SINGLE, **lin)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * q_dim, bias=False, tp=tp, **lin)
        else:  # DeepSeek-V2-Lite: no query compression
            self.q_proj = ColumnParallelLinear(hidden, total_heads * q_dim, bias=False, tp=tp, **lin)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias,
                                                       tp=SINGLE, **lin)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = LatentUpProjection(self.kv_lora_rank, total_heads * (self.nope_dim + self.v_dim),
                                            bias=False, tp=tp, **lin)
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias=bias, tp=tp, **lin)
        self.rotary_emb = rotary
        self.scale = mla_softmax_scale(config)
        self.ops = ops
        self.fp8_kv = getattr(getattr(ops, "policy", None), "kv_cache", "auto") == "fp8"
        if self.fp8_kv:  # one per-tensor scale for the latent vector (1.0: no checkpoint ships one)
            self.kv_scale = _kv_scale()

    @property
    def cache_kwargs(self) -> dict:
        return {"kv_scale": self.kv_scale} if self.fp8_kv else {}

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, Dn, L], W_UV [H, Dv, L]) of this rank's heads: views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata):
        t = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope_dim], q[..., self.nope_dim:].contiguous()  # [T, H, Dn], [T, H, R]
        latent = self.kv_a_proj_with_mqa(hidden)  # [T, L + R]
        kv_c = self.kv_a_layernorm(latent[:, : self.kv_lora_rank].contiguous())  # [T, L]
        k_pe = latent[:, self.kv_lora_rank:].contiguous().view(t, 1, self.rope_dim)
        self.rotary_emb(positions, q_pe, k_pe)  # in place
        (latent_cache,) = kv_cache  # [NB, BS, L + R]
        kw = self.cache_kwargs
        self.ops.mla_reshape_and_cache(kv_c, k_pe.view(t, self.rope_dim), latent_cache, meta.slot_mapping, **kw)
        plan = meta.latent_prefill
        if plan is None:
            o = self.absorbed(q_nope, q_pe, latent_cache, meta)
        else:  # this step's prefill sequences decompressed, the rest absorbed (turnout/layers/mla_prefill.py)
            rows = plan.tokens
            o_dec = decompressed_attention(self, q_nope if rows is None else q_nope[rows],
                                           q_pe if rows is None else q_pe[rows], latent_cache, plan)
            if rows is None:
                o = o_dec
            else:
                o = q_nope.new_empty((t, self.num_heads, self.v_dim))
                o[rows] = o_dec
                a_rows = plan.absorbed_tokens
                o[a_rows] = self.absorbed(q_nope[a_rows], q_pe[a_rows], latent_cache, plan.absorbed_meta)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed attention of the tokens meta describes -> [T, H, Dv]: queries into the latent space with W_UK,
        ``mla_paged_attention``, the latent outputs back with W_UV."""
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, T, Dn] x [H, Dn, L] -> [T, H, L]
        o_lat = self.ops.mla_paged_attention(q_lat.contiguous(), q_pe, latent_cache, meta.block_tables,
                                             meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                                             meta.max_seq_len, self.scale, **self.cache_kwargs)  # [T, H, L]
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, L] x [H, L, Dv] -> [H, T, Dv]
        return o.transpose(0, 1)

    @property
    def latent_dims(self) -> LatentDims:
        return LatentDims(self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim, self.num_heads,
                          self.kv_b_proj.weight.element_size())

    def kv_spec(self, cache_dtype: str):
        """One latent vector per token (turnout/kv/spec.py), the same on every rank."""
        from turnout.kv.spec import LatentSpec

        return LatentSpec(self.kv_lora_rank, self.rope_dim, cache_dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, latent={self.kv_lora_rank}+{self.rope_dim}, nope={self.nope_dim}, "
                f"v={self.v_dim}, q_lora_rank={self.q_lora_rank}" + (", kv_cache=fp8" if self.fp8_kv else ""))
