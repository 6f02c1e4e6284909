"""Model building blocks. Layers receive the op table in their constructor and call kernels by name;
they never import a kernel implementation."""

from turnout.layers.activation import SiluAndMul
from turnout.layers.attention import Attention, AttentionMetadata
from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.linear import (
                                   ColumnParallelLinear,
                                   MergedColumnParallelLinear,
                                   QKVParallelLinear,
                                   ReplicatedLinear,
                                   RowParallelLinear,
                                   default_weight_loader,
)
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["Attention", "AttentionMetadata", "ColumnParallelLinear", "LMHead", "MergedColumnParallelLinear",
           "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear",
           "SiluAndMul", "VocabEmbedding", "default_weight_loader", "get_rope"]
