"""Which token layers share a block table (a table group), and which layers share cache tensors. Plain Python.

One table group (every model whose token layers all declare the same spec, Llama or Mistral; or whose layers
could not share pages: different shapes or dtypes, latent layers, per-request state): one block table per
sequence, one tensor set per layer, exactly as before per-group tables.

Several table groups (a model that mixes full and sliding layers of one shape: Gemma 2/3, GPT-OSS), after
vLLM's hybrid KV cache manager: the layers of each kind (full; sliding W) are cut into groups of ``size``
layers (``size``: the fewest layers of any kind, so the rarest kind is one group; the last group of a kind
may be short), the full groups first. Each group has its own block table per sequence and its own slot
mapping; a sliding group frees the blocks its window left behind, a full group keeps them all. Layer ``j``
of every group uses the same tensors (``cache_owner``: the first layer in model order at position ``j``),
so one block id stands for ``size`` layers' worth of one block (a page), whichever group holds it: the
pool is shared, and a block a sliding group frees serves any group of any sequence.

Gemma-3-12B (8 full, 40 sliding layers): 6 groups of 8, one full; at 32k tokens a sequence holds 2048
blocks in the full group and about 64 (window 1024, 16-token blocks) in each of the five sliding ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TableGroup:
    """Layers (indices into the model's cache list) that read one block table; ``window``: the tokens a
    sequence must keep in it (None: all of them)."""

    window: int | None
    layers: tuple[int, ...]


def _shared_shape(specs) -> bool:
    first = specs[0]
    return all(type(s).__name__ in ("FullAttentionSpec", "SlidingWindowSpec") and s.token_shapes ==
               first.token_shapes and s.dtype == first.dtype for s in specs)


def split_groups(specs) -> tuple[tuple[TableGroup, ...], tuple[int, ...]]:
    """(table groups, cache owner per layer) of ``specs`` (one per cache-holding layer, the model's order)."""
    token = [i for i, s in enumerate(specs) if s.per_token]
    kinds: dict = {}
    for i in token:
        kinds.setdefault(specs[i], []).append(i)
    per_table = (len(kinds) > 1 and len(token) == len(specs) and _shared_shape([specs[i] for i in token])
                 and any(not s.keeps_all_tokens for s in kinds))
    if not per_table:
        window = None
        if token and not any(specs[i].keeps_all_tokens for i in token):
            window = max(specs[i].window for i in token)
        return (TableGroup(window, tuple(token)),), tuple(range(len(specs)))
    size = min(len(layers) for layers in kinds.values())
    ordered = sorted(kinds.items(), key=lambda kv: not kv[0].keeps_all_tokens)  # full groups first (stable)
    groups = []
    for spec, layers in ordered:
        window = None if spec.keeps_all_tokens else spec.window
        groups.extend(TableGroup(window, tuple(layers[k:k + size])) for k in range(0, len(layers), size))
    owner = list(range(len(specs)))
    first_at: dict[int, int] = {}  # position in a group -> its first layer in model order
    for g in groups:
        for j, layer in enumerate(g.layers):
            first_at[j] = min(first_at.get(j, layer), layer)
    for g in groups:
        for j, layer in enumerate(g.layers):
            owner[layer] = first_at[j]
    return tuple(groups), tuple(owner)


def layer_groups(groups: tuple[TableGroup, ...], num_layers: int) -> tuple[int, ...]:
    """The table group of each layer (0 for a state layer, which reads none)."""
    out = [0] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layers:
            out[layer] = g
    return tuple(out)
