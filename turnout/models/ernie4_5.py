"""ERNIE-4.5 dense (``Ernie4_5ForCausalLM``, e.g. ERNIE-4.5-0.3B): the Llama decoder with rope on interleaved
pairs (transformers rotates (x0, x1), (x2, x3), ... : GPT-J style, not halves), one ``use_bias`` for every
projection of attention and MLP, and a tied head by default."""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.models.decoder import DecoderAttention, DecoderForCausalLM, DenseMLP


def use_bias(config) -> bool:
    return bool(getattr(config, "use_bias", False))


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    rope_is_neox = False

    def make_attention(self, config, layer_idx: int, ops, rotary, plan: FusionPlan = NO_FUSIONS):
        bias = use_bias(config)
        return DecoderAttention(config, ops, rotary, qkv_bias=bias, o_bias=bias, qk_norm=False, plan=plan, tp=self.tp,
                                spec=self.attention_spec(config, layer_idx))

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        return DenseMLP(config, ops, bias=use_bias(config), plan=plan, tp=self.tp)
