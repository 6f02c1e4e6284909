"""The cache specs a layer declares (kv/spec.py): bytes, groups, the window the block manager keeps, and what
the attention layer declares."""

import subprocess
import sys

import pytest

from turnout.kv.spec import CacheLayout, FullAttentionSpec, LatentSpec, SlidingWindowSpec, StateSpec, blocks_spanned


def test_bytes_per_token_and_per_request():
    assert FullAttentionSpec(8, 128, "bfloat16").bytes_per_token == 2 * 8 * 128 * 2
    assert FullAttentionSpec(8, 128, "float8_e4m3fn").bytes_per_token == 2 * 8 * 128
    assert SlidingWindowSpec(4, 64, "float32", window=16).bytes_per_token == 2 * 4 * 64 * 4
    lat = LatentSpec(512, 64, "bfloat16")  # DeepSeek-V3's: one 576-wide vector per token
    assert lat.token_shapes == ((576,),) and lat.bytes_per_token == 576 * 2
    st = StateSpec(((3, 16), (4, 8, 8)), ("bfloat16", "float32"))
    assert st.bytes_per_request == 3 * 16 * 2 + 4 * 8 * 8 * 4 and not st.per_token


def test_layers_with_equal_specs_form_a_group_and_sizes_add_up():
    full, slide = FullAttentionSpec(2, 8, "float32"), SlidingWindowSpec(2, 8, "float32", window=16)
    lat, st = LatentSpec(16, 4, "float32"), StateSpec(((5,),), ("float32",))
    lay = CacheLayout((slide, full, slide, lat, st, FullAttentionSpec(2, 8, "float32")))
    assert [(type(g.spec).__name__, g.layers) for g in lay.groups] == [
        ("SlidingWindowSpec", (0, 2)), ("FullAttentionSpec", (1, 5)), ("LatentSpec", (3,)), ("StateSpec", (4,))]
    assert lay.token_layers == (0, 1, 2, 3, 5) and lay.state_layers == (4,)
    assert lay.block_bytes(4) == 4 * (4 * 128 + 20 * 4)
    assert lay.state_bytes == 20
    assert "2 x sliding 16" in lay.describe() and "1 x state (20 B/request)" in lay.describe()


def test_blocks_are_freed_only_when_every_token_layer_is_sliding():
    s16, s32 = SlidingWindowSpec(2, 8, "float32", window=16), SlidingWindowSpec(2, 8, "float32", window=32)
    assert CacheLayout((s16, s16)).window == 16
    assert CacheLayout((s16, s32)).window == 32  # the widest
    assert CacheLayout((s16, FullAttentionSpec(2, 8, "float32"))).window is None  # Gemma 2: full layers read all
    assert CacheLayout((s16, LatentSpec(16, 4, "float32"))).window is None
    assert CacheLayout((s16, StateSpec(((5,),), ("float32",)))).window == 16  # a state holds no tokens


def test_max_blocks_per_sequence():
    # 16 positions starting at offset 3 touch blocks 0..4
    assert blocks_spanned(16, 4) == 5 and blocks_spanned(17, 4) == 5 and blocks_spanned(18, 4) == 6
    assert blocks_spanned(1, 8) == 1 and blocks_spanned(0, 8) == 0
    slide = SlidingWindowSpec(2, 8, "float32", window=16)
    assert slide.max_blocks(1000, 4, 1) == 5  # ceil(16 / 4) + 1 while decoding
    assert slide.max_blocks(10, 4, 1) == 3  # never more than the sequence has
    assert slide.max_blocks(1000, 4, 64) == blocks_spanned(80, 4)  # a chunk of 64 reads the window before it
    assert FullAttentionSpec(2, 8, "float32").max_blocks(1000, 4, 1) == 250
    # full and sliding layers: a table per group on one pool of one-layer pages, the full group's 250 and the
    # sliding group's 5 (kv/spec.py: table groups); one table held 250 pages of both layers (500 layer-blocks)
    mixed = CacheLayout((slide, FullAttentionSpec(2, 8, "float32")))
    assert mixed.max_blocks(1000, 4, 1) == 255 and mixed.block_bytes(4) == 4 * slide.bytes_per_token


def test_bad_specs_are_refused_by_name():
    with pytest.raises(ValueError, match="window must be >= 1"):
        SlidingWindowSpec(2, 8, "float32", window=0)
    with pytest.raises(ValueError, match="'float7'"):
        FullAttentionSpec(2, 8, "float7")
    with pytest.raises(ValueError, match="one dtype per shape"):
        StateSpec(((4,),), ())
    with pytest.raises(ValueError, match="no KV cache spec"):
        CacheLayout(())


def test_spec_module_imports_no_torch():
    code = "import sys, turnout.kv.spec; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_attention_layer_declares_its_spec():
    from turnout.layers.attention import Attention
    from turnout.ops import Policy, resolve
    from turnout.platforms import detect_platform

    ops = resolve(detect_platform("cpu"), Policy())
    attn = Attention(8, 2, 16, 0.25, ops)
    assert attn.kv_spec("bfloat16") == FullAttentionSpec(2, 16, "bfloat16")
    attn.sliding_window = 32  # what Attention(sliding_window=32) sets
    assert attn.kv_spec("float32") == SlidingWindowSpec(2, 16, "float32", window=32)
