"""KV bytes of one decoding sequence per table group (turnout/kv/spec.py: table groups), against one block table for
every layer: arithmetic from a model's config (the layers' KV specs as turnout's attention layers declare them),
no weights and no device. The same numbers as the engine's start-up log line ("KV per sequence at max_model_len").

    python benchmarks/group_kv_bytes.py benchmarks/configs/gemma3_12b.json --tokens 32768 --block-size 16
"""

from __future__ import annotations

import argparse
import json

import transformers

from turnout.kv.spec import CacheLayout, FullAttentionSpec, SlidingWindowSpec
from turnout.models.layer_spec import attention_spec
from turnout.worker.group_inputs import seq_kv_bytes


def layout_of(config_path: str, dtype: str = "bfloat16") -> CacheLayout:
    raw = json.load(open(config_path))
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    specs = []
    for i in range(config.num_hidden_layers):
        window = attention_spec(config, i).sliding_window
        specs.append(SlidingWindowSpec(heads, head_dim, dtype, window=window) if window else
                     FullAttentionSpec(heads, head_dim, dtype))
    return CacheLayout(tuple(specs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    layout = layout_of(args.config)
    before, rows = seq_kv_bytes(layout, args.tokens, args.block_size)
    print(f"{args.config}: {layout.describe()}; {args.tokens} tokens, blocks of {args.block_size}")
    for what, n, b in rows:
        print(f"  {what}: {n} blocks, {b / 1e9:.3f} GB")
    after = sum(b for _, _, b in rows)
    print(f"  per-group tables: {after / 1e9:.3f} GB ({after / 2**30:.3f} GiB); one table for every layer: "
          f"{before / 1e9:.3f} GB ({before / 2**30:.3f} GiB); {before / after:.2f}x")


if __name__ == "__main__":
    main()
