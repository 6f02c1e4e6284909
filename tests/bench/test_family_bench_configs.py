"""The bundled ERNIE-4.5-21B-A3B and Gemma-3-12B configs (benchmarks/configs, dummy weights for `turnout bench`):
transformers reads them as the published shapes and turnout builds the same parameter count; shrunk copies of
them (every field kept but the sizes) run through `turnout bench latency` on CPU, and through the HF peer
(benchmarks/hf_peer.py) with identical weights and identical greedy tokens, which is what the GPU runs compare."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from turnout.entrypoints import bench_models
from turnout.entrypoints.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
# name -> (layers, hidden, heads, kv heads, vocab, total params in billions)
PUBLISHED = {"ernie4_5_21b_a3b": (28, 2560, 20, 4, 103424, 21.825), "gemma3_12b": (48, 3840, 16, 8, 262208, 11.766)}
SHRINK = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256, "torch_dtype": "float32"}
SHRINK_FAMILY = {"ernie4_5_21b_a3b": {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32},
                 "gemma3_12b": {"head_dim": 16, "sliding_window": 6, "sliding_window_pattern": 3,
                                "query_pre_attn_scalar": 24}}


def _shrunk(name: str, tmp_path) -> str:
    cfg = json.loads((REPO / "benchmarks" / "configs" / f"{name}.json").read_text())
    cfg.update(SHRINK, **SHRINK_FAMILY[name])
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_bundled_config_is_the_published_shape(name):
    from turnout.models.registry import get_model_class
    from turnout.ops import resolve
    from turnout.platforms.detect import detect_platform

    path, bundled = bench_models.resolve_model(name.replace("_", "-"))
    assert bundled
    c = transformers.AutoConfig.from_pretrained(path)
    layers, hidden, heads, kv, vocab, billions = PUBLISHED[name]
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == \
        (layers, hidden, heads, kv, vocab)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(c).parameters())
        model = get_model_class(c.architectures)(c, resolve(detect_platform("cpu")))
    assert abs(theirs / 1e9 - billions) < 0.01
    assert sum(p.numel() for p in model.parameters()) == theirs
    if name == "gemma3_12b":  # five sliding layers of 1024 to one global, two rope caches
        assert [layer.self_attn.attn.sliding_window for layer in model.model.layers[:6]] == [1024] * 5 + [None]
    else:  # 64 experts top-6 on every layer but the first, two shared experts
        sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
        assert sparse == [False] + [True] * 27 and model.model.layers[1].mlp.gate.routing.top_k == 6


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shrunk_config_runs_turnout_bench_latency(name, tmp_path):
    out = tmp_path / "lat.json"
    rc = cli_main(["--log-level", "WARNING", "bench", "latency", "--model", _shrunk(name, tmp_path), "--load-format",
                   "dummy", "--dtype", "float32", "--device", "cpu", "--input-len", "12", "--output-len", "5",
                   "--kv-cache-memory", str(1 << 22), "--no-ceilings", "--batch-size", "2", "--num-iters", "1",
                   "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["decode_tok_s"] > 0 and r["engine"]["max_model_len"] == 17


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shrunk_config_hf_peer_has_identical_weights_and_tokens(name, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import hf_peer
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    d = _shrunk(name, tmp_path)
    hf = hf_peer.build_hf_model(d, torch.float32, "cpu", seed=3)
    llm = hf_peer.make_turnout(d, "float32", "cpu", max_model_len=64, kv_cache_memory=1 << 22)
    hf_peer.load_into_turnout(llm, hf)
    prompts = bench_models.random_prompts(2, 11, 512, seed=5)
    r = hf_peer.compare(hf, llm, prompts, 12)
    assert r["weights_identical"], (r["checksum_hf"], r["checksum_turnout"])
    assert r["greedy_match"], r["first_mismatch"]
    assert len(set(sum(r["hf_tokens"], []))) > 2
