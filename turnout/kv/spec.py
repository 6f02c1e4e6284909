"""What each layer stores in the KV cache, declared by the layer. Plain Python, no torch.

A layer that keeps state across steps declares one spec (``Attention.kv_spec``); the runner sizes and
allocates the cache from the specs, and the block manager learns from them how long a sequence must keep
its blocks. Two kinds of storage:

- **per token**, in paged blocks (a block table per sequence and table group, below; block ``b`` of every
  layer of a group holds the same tokens): ``FullAttentionSpec`` (k and v), ``SlidingWindowSpec`` (k and
  v, of which a query reads only the last ``window`` tokens), ``LatentSpec`` (one compressed vector per token,
  ``kv_lora_rank + rope_dim`` wide, no separate k and v: DeepSeek-V3's multi-head latent attention);
- **per request**, a fixed-size state in one slot per sequence whatever its length: ``StateSpec``
  (recurrent layers: a convolution window and an SSM state, say).

Layers with equal specs form a cache group (``CacheLayout.groups``); every layer still has its own tensors.
The tensors of a token layer are ``[num_blocks, block_size, *shape]`` for each ``shape`` of
``token_shapes``; those of a state layer ``[num_slots, *shape]`` for each of ``shapes``.

Block tables (``CacheLayout.table_groups``, the table groups section below): a model whose token layers all declare one
spec has one block table per sequence (blocks freed out of a window when every layer is a sliding one,
Mistral). A model that mixes full and sliding layers of one shape (Gemma 2/3, GPT-OSS) has one table per
table group: its sliding groups free the blocks their window left behind while its full groups keep them,
the groups sharing one pool of pages (a block id stands for one block of ``size`` layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

# bytes per element of the storage dtypes a cache may use (torch's names, without "torch.")
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1, "int32": 4, "int64": 8}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"KV cache dtype {dtype!r}: not one of {sorted(DTYPE_BYTES)}") from None


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def blocks_spanned(num_tokens: int, block_size: int) -> int:
    """The most blocks ``num_tokens`` consecutive positions can touch (they may start anywhere in a block)."""
    if num_tokens <= 0:
        return 0
    return -(-(num_tokens - 1) // block_size) + 1


@dataclass(frozen=True)
class FullAttentionSpec:
    """k and v of every token: ``num_kv_heads`` heads of ``head_dim`` (this rank's heads under tensor
    parallelism), stored as ``dtype``."""

    num_kv_heads: int
    head_dim: int
    dtype: str

    per_token = True

    def __post_init__(self):
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"{type(self).__name__}: num_kv_heads and head_dim must be >= 1, got "
                             f"{self.num_kv_heads}, {self.head_dim}")
        dtype_bytes(self.dtype)

    @property
    def token_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim))

    @property
    def bytes_per_token(self) -> int:
        return sum(_prod(s) for s in self.token_shapes) * dtype_bytes(self.dtype)

    @property
    def keeps_all_tokens(self) -> bool:
        """Whether a query may read any earlier token (so no block may be freed while the sequence lives)."""
        return True

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of up to ``num_tokens`` tokens holds at once for this layer, computed
        at most ``chunk`` tokens a step."""
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """k and v, of which the query at position p reads positions (p - window, p]: the last ``window``
    tokens (Hugging Face's ``sliding_window``)."""

    window: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"SlidingWindowSpec: window must be >= 1, got {self.window}")

    @property
    def keeps_all_tokens(self) -> bool:
        return False

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        # a step computing positions [s, s + chunk) reads from s - window on (one token of margin: the block
        # manager keeps it), so it spans window + chunk positions
        return min(-(-num_tokens // block_size), blocks_spanned(self.window + max(chunk, 1), block_size))


@dataclass(frozen=True)
class LatentSpec:
    """One compressed vector per token (multi-head latent attention): ``kv_lora_rank`` latent values and
    ``rope_dim`` rotary key values, read by every head; no separate k and v."""

    kv_lora_rank: int
    rope_dim: int
    dtype: str

    per_token = True

    def __post_init__(self):
        if self.kv_lora_rank < 1 or self.rope_dim < 0:
            raise ValueError(f"LatentSpec: kv_lora_rank must be >= 1 and rope_dim >= 0, got {self.kv_lora_rank}, "
                             f"{self.rope_dim}")
        dtype_bytes(self.dtype)

    @property
    def token_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.kv_lora_rank + self.rope_dim,),)

    @property
    def bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.rope_dim) * dtype_bytes(self.dtype)

    @property
    def keeps_all_tokens(self) -> bool:
        return True

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size state per request (recurrent layers): one tensor of each ``shapes[i]`` and ``dtypes[i]``
    per sequence, whatever its length."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    per_token = False

    def __post_init__(self):
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(f"StateSpec: one dtype per shape, at least one shape; got {self.shapes}, {self.dtypes}")
        for s, d in zip(self.shapes, self.dtypes):
            if not all(isinstance(n, int) and n >= 1 for n in s):
                raise ValueError(f"StateSpec: shape {s} must be positive ints")
            dtype_bytes(d)

    @property
    def bytes_per_request(self) -> int:
        return sum(_prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))


TOKEN_SPECS = (FullAttentionSpec, SlidingWindowSpec, LatentSpec)
KVSpec = FullAttentionSpec | SlidingWindowSpec | LatentSpec | StateSpec


# ---- table groups --------------------------------------------------------------------------------
# Which token layers share a block table (a table group), and which layers share cache tensors. Plain Python.
#
# One table group (every model whose token layers all declare the same spec, Llama or Mistral; or whose layers
# could not share pages: different shapes or dtypes, latent layers, per-request state): one block table per
# sequence, one tensor set per layer, exactly as before per-group tables.
#
# Several table groups (a model that mixes full and sliding layers of one shape: Gemma 2/3, GPT-OSS), after
# vLLM's hybrid KV cache manager: the layers of each kind (full; sliding W) are cut into groups of ``size``
# layers (``size``: the fewest layers of any kind, so the rarest kind is one group; the last group of a kind
# may be short), the full groups first. Each group has its own block table per sequence and its own slot
# mapping; a sliding group frees the blocks its window left behind, a full group keeps them all. Layer ``j``
# of every group uses the same tensors (``cache_owner``: the first layer in model order at position ``j``),
# so one block id stands for ``size`` layers' worth of one block (a page), whichever group holds it: the
# pool is shared, and a block a sliding group frees serves any group of any sequence.
#
# Gemma-3-12B (8 full, 40 sliding layers): 6 groups of 8, one full; at 32k tokens a sequence holds 2048
# blocks in the full group and about 64 (window 1024, 16-token blocks) in each of the five sliding ones.


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


@dataclass(frozen=True)
class CacheGroup:
    """Layers (indices into the model's cache list) that store the same thing."""

    spec: KVSpec
    layers: tuple[int, ...]


@dataclass(frozen=True)
class CacheLayout:
    """The model's specs, one per cache-holding layer in the model's order, and what follows from them."""

    specs: tuple[KVSpec, ...]

    def __post_init__(self):
        if not self.specs:
            raise ValueError("CacheLayout: the model declares no KV cache spec (no attention layer found)")
        for i, s in enumerate(self.specs):
            if not isinstance(s, TOKEN_SPECS + (StateSpec,)):
                raise ValueError(f"CacheLayout: layer {i} declares {s!r}, not a KV cache spec")

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        """Layers with equal specs, in the order each spec first appears."""
        by_spec: dict = {}
        for i, s in enumerate(self.specs):
            by_spec.setdefault(s, []).append(i)
        return tuple(CacheGroup(s, tuple(layers)) for s, layers in by_spec.items())

    @property
    def token_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.specs) if s.per_token)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.specs) if not s.per_token)

    @cached_property
    def _tables(self) -> tuple[tuple[TableGroup, ...], tuple[int, ...]]:
        return split_groups(self.specs)

    @property
    def table_groups(self) -> tuple[TableGroup, ...]:
        """The token layers that share a block table (one group unless full and sliding layers mix)."""
        return self._tables[0]

    @property
    def cache_owner(self) -> tuple[int, ...]:
        """Per layer, the layer whose cache tensors it uses (itself but with several table groups)."""
        return self._tables[1]

    @cached_property
    def layer_group(self) -> tuple[int, ...]:
        """Per layer, its table group."""
        return layer_groups(self.table_groups, len(self.specs))

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block id: one block of every token layer, or with several table groups of every
        layer position of a group (the page the groups share)."""
        if len(self.table_groups) > 1:
            return block_size * len(self.table_groups[0].layers) * self.specs[self.table_groups[0].layers[0]].bytes_per_token
        return block_size * sum(s.bytes_per_token for s in self.specs if s.per_token)

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state across every state layer (0 without such layers)."""
        return sum(s.bytes_per_request for s in self.specs if not s.per_token)

    @property
    def window(self) -> int | None:
        """How many of its latest tokens a sequence must keep in its blocks: the widest window when every
        token layer is a sliding one, else None (some layer reads every token: keep all blocks)."""
        token = [s for s in self.specs if s.per_token]
        if not token or any(s.keeps_all_tokens for s in token):
            return None
        return max(s.window for s in token)

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of up to ``num_tokens`` tokens holds at once (one table: the widest
        need of any token layer; several: the sum of each group's)."""
        if len(self.table_groups) > 1:
            return sum(self.specs[g.layers[0]].max_blocks(num_tokens, block_size, chunk) for g in self.table_groups)
        return max((s.max_blocks(num_tokens, block_size, chunk) for s in self.specs if s.per_token), default=0)

    def describe(self) -> str:
        parts = []
        for g in self.groups:
            s = g.spec
            what = {FullAttentionSpec: "full", SlidingWindowSpec: f"sliding {getattr(s, 'window', 0)}",
                    LatentSpec: "latent", StateSpec: "state"}[type(s)]
            size = f"{s.bytes_per_token} B/token" if s.per_token else f"{s.bytes_per_request} B/request"
            parts.append(f"{len(g.layers)} x {what} ({size})")
        if len(self.table_groups) > 1:
            parts.append(f"{len(self.table_groups)} block tables of {len(self.table_groups[0].layers)} layers")
        return ", ".join(parts)
