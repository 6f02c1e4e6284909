"""`turnout bench latency|throughput` on a tiny dummy config on CPU, the bundled config names, the roofline
accounting, and the HF peer on identical weights (greedy tokens and checksums agree)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnout import envs
from turnout.entrypoints import bench_cmd, bench_models, bench_report
from turnout.entrypoints.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 0}
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 200, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 64, "rope_type": "llama3"},
              "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 2, "bos_token_id": 1}


def _write(tmp_path, cfg, name="tiny"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


COMMON = ["--load-format", "dummy", "--dtype", "float32", "--device", "cpu", "--input-len", "12", "--output-len",
          "5", "--kv-cache-memory", str(1 << 22), "--no-ceilings"]


def test_bench_latency_json(tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = cli_main(["--log-level", "WARNING", "bench", "latency", "--model", str(_write(tmp_path, TINY)), *COMMON,
                   "--batch-size", "3", "--num-iters", "2", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    missing = [f for f in bench_report.LATENCY_FIELDS if f not in r]
    assert not missing, missing
    assert r["bench"] == "latency" and r["batch_size"] == 3 and len(r["latencies_s"]) == 2
    assert r["prefill_s"] > 0 and r["decode_step_ms"] > 0 and r["decode_tok_s"] > 0 and r["decode_GB_s"] > 0
    assert r["prefill_TFLOP_s"] > 0 and r["output_tok_s"] > 0
    assert r["cuda_graphs"]["enabled"] is False and r["ops"]["paged_attention"]
    assert r["geometry"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert r["engine"]["max_model_len"] == 12 + 5
    text = capsys.readouterr().out
    assert "decode_tok_s" in text and json.loads(text.split("JSON ", 1)[1]) == r


def test_bench_throughput_json_with_ceilings(tmp_path, capsys):
    out = tmp_path / "thr.json"
    # the model as the positional, the global flag after the subcommand
    argv = ["bench", "throughput", str(_write(tmp_path, TINY)), "--log-level", "WARNING", *COMMON,
            "--num-prompts", "5", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--output-json", str(out)]
    argv.remove("--no-ceilings")
    assert cli_main(argv) == 0
    r = json.loads(out.read_text())
    missing = [f for f in bench_report.THROUGHPUT_FIELDS if f not in r]
    assert not missing, missing
    assert r["num_prompts"] == 5 and r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
    assert r["num_prefill_steps"] >= 3  # 5 x 12 prompt tokens through a 32-token budget: chunked
    assert 1 <= r["mean_decode_batch"] <= 4
    assert r["ceilings"]["copy_GB_s"] > 0 and r["ceilings"]["gemm_TFLOP_s"] > 0
    assert 0 < r["frac_of_copy_bw"] and 0 < r["frac_of_gemm"]


def test_global_flags_before_and_after_every_subcommand():
    from turnout.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).log_level == "INFO"
    for argv in (["--log-level", "DEBUG", "generate", "hi"], ["generate", "--log-level", "DEBUG", "hi"],
                 ["generate", "hi", "--log-level", "DEBUG"], ["ops", "--log-level", "DEBUG"],
                 ["bench", "latency", "--log-level", "DEBUG"], ["--log-level", "DEBUG", "bench", "throughput"],
                 ["serve", "--log-level", "DEBUG"]):
        assert parser.parse_args(argv).log_level == "DEBUG", argv
    # given before and after: the later one wins, as for any repeated flag
    assert parser.parse_args(["--log-level", "ERROR", "generate", "--log-level", "DEBUG", "x"]).log_level == "DEBUG"


def test_unknown_log_level_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "--log-level", "LOUD", "hi"])
    assert e.value.code == 2 and "--log-level" in capsys.readouterr().err


def test_model_flag_and_positional_and_both_boolean_spellings():
    from turnout.entrypoints.cli import build_parser

    parser = build_parser()
    for argv in (["bench", "latency", "m1"], ["bench", "latency", "--model", "m1"]):
        args = parser.parse_args(argv)
        bench_cmd._validate(args)
        assert args.model == "m1", argv
    args = parser.parse_args(["bench", "latency", "m1", "--model", "m2"])
    with pytest.raises(ValueError, match=r"--model: the model is given twice"):
        bench_cmd._validate(args)
    assert parser.parse_args(["generate", "--model", "m1", "hi"]).model == "m1"
    flags = {"bench": ["enable-prefix-caching", "enforce-eager", "async-scheduling", "ceilings"],
             "generate": ["enable-prefix-caching", "enforce-eager", "async-scheduling", "chat"]}
    for cmd, names in flags.items():
        head = ["bench", "latency"] if cmd == "bench" else ["generate", "hi"]
        for name in names:
            dest = name.replace("-", "_")
            assert getattr(parser.parse_args(head + [f"--{name}"]), dest) is True, name
            assert getattr(parser.parse_args(head + [f"--no-{name}"]), dest) is False, name
    defaults = parser.parse_args(["bench", "latency"])
    assert (defaults.enable_prefix_caching, defaults.enforce_eager, defaults.ceilings) == (False, False, True)
    defaults = parser.parse_args(["generate", "hi"])
    assert (defaults.enable_prefix_caching, defaults.enforce_eager, defaults.chat) == (True, False, False)


def test_bench_rejects_bad_lengths(tmp_path, capsys):
    rc = cli_main(["bench", "latency", "--model", str(_write(tmp_path, TINY)), *COMMON[:-1], "--output-len", "0"])
    assert rc == 2 and "--output-len" in capsys.readouterr().err


def test_bundled_config_names(tmp_path, monkeypatch):
    for name in ("qwen3-8b", "Qwen3-8B", "qwen3_8b", "QWEN3-0.6B", "llama-3.1-8b", "Llama_3.1_8B"):
        path, bundled = bench_models.resolve_model(name)
        assert bundled and Path(path, "config.json").is_file(), name
    assert bench_models.resolve_model("qwen3-8b")[0] == str(REPO / "benchmarks" / "configs" / "qwen3-8b")
    # The <name>.json layout (one file per model) becomes a config-only directory.
    root = tmp_path / "configs"
    root.mkdir()
    (root / "qwen3_30b_a3b.json").write_text(json.dumps(TINY))
    monkeypatch.setenv("TURNOUT_BENCH_CONFIGS", str(root))
    envs.reload()
    path, bundled = bench_models.resolve_model("qwen3-30b-a3b")
    assert bundled and json.loads(Path(path, "config.json").read_text()) == TINY
    assert bench_models.resolve_model(str(root / "qwen3_30b_a3b.json"))[1]
    assert bench_models.resolve_model("some-org/some-model") == ("some-org/some-model", False)
    d = _write(tmp_path, TINY)
    assert bench_models.resolve_model(str(d)) == (str(d), False)


def test_bundled_configs_are_published_shapes():
    from transformers import AutoConfig

    want = {"qwen3-0.6b": (28, 1024, 16, 8, 151936, True), "qwen3-8b": (36, 4096, 32, 8, 151936, False),
            "llama-3.1-8b": (32, 4096, 32, 8, 128256, False)}
    for name, (layers, hidden, heads, kv, vocab, tied) in want.items():
        c = AutoConfig.from_pretrained(str(REPO / "benchmarks" / "configs" / name))
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size,
                bool(c.tie_word_embeddings)) == (layers, hidden, heads, kv, vocab, tied), name
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())
        assert abs(n / 1e9 - {"qwen3-0.6b": 0.596, "qwen3-8b": 8.19, "llama-3.1-8b": 8.03}[name]) < 0.01


def test_roofline_accounting():
    from types import SimpleNamespace

    from turnout.utils.roofline import decode_attn_pairs, model_geometry, prefill_attn_pairs

    class M(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(100, 8)
            self.proj = torch.nn.Linear(8, 8, bias=False)
            self.experts = torch.nn.Parameter(torch.zeros(4, 8, 8))
            self.lm_head = torch.nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    cfg = SimpleNamespace(num_attention_heads=2, hidden_size=8, num_key_value_heads=1, num_hidden_layers=3,
                          num_experts=4, num_experts_per_tok=1)
    g = model_geometry(M(False), cfg, torch.bfloat16)
    assert (g.body_params, g.expert_params, g.lm_head_params, g.embed_params) == (64, 256, 800, 800)
    assert g.kv_bytes_per_token == 2 * 3 * 1 * 4 * 2
    assert g.weight_bytes_per_step(1) == pytest.approx(4 * (64 + 800 + 256 * 0.25))
    assert g.weight_bytes_per_step(10**6) == pytest.approx(4 * (64 + 800 + 256))
    assert g.flops(10, 2, 7) == pytest.approx(2 * (64 + 64) * 10 + 2 * 800 * 2 + 4 * 3 * 2 * 4 * 7)
    t = model_geometry(M(True), cfg, torch.bfloat16)
    assert (t.lm_head_params, t.embed_params) == (800, 0)  # tied: counted once, as the lm_head
    assert prefill_attn_pairs(4) == 10 and prefill_attn_pairs(4, cached=2) == 2 * 2 + 3
    assert decode_attn_pairs(10, 1) == 0 and decode_attn_pairs(10, 4) == 11 + 12 + 13


@pytest.mark.parametrize("cfg", [TINY, TINY_LLAMA], ids=["qwen3", "llama3-tied"])
def test_hf_peer_identical_weights_same_greedy_tokens(tmp_path, cfg):
    """The HF model's seeded weights loaded into turnout: equal checksums, equal greedy tokens. This is
    the evidence that the peer benchmark compares the same model."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import hf_peer
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    d = str(_write(tmp_path, cfg))
    hf = hf_peer.build_hf_model(d, torch.float32, "cpu", seed=3)
    llm = hf_peer.make_turnout(d, "float32", "cpu", max_model_len=64, kv_cache_memory=1 << 22)
    hf_peer.load_into_turnout(llm, hf)
    prompts = bench_models.random_prompts(2, 11, cfg["vocab_size"], seed=5)
    r = hf_peer.compare(hf, llm, prompts, 12)
    assert r["weights_identical"], (r["checksum_hf"], r["checksum_turnout"])
    assert r["greedy_match"], r["first_mismatch"]
    assert len(set(sum(r["hf_tokens"], []))) > 2  # not one constant continuation
    # and they differ from turnout's own dummy weights (the load really replaced them)
    fresh = hf_peer.make_turnout(d, "float32", "cpu", max_model_len=64, kv_cache_memory=1 << 22)
    assert hf_peer.turnout_greedy(fresh, prompts, 12) != r["hf_tokens"]


def test_hf_peer_cli_json(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import hf_peer
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path / "hf.json"
    rc = hf_peer.main(["--model", str(_write(tmp_path, TINY)), "--dtype", "float32", "--device", "cpu",
                       "--input-len", "8", "--output-len", "4", "--thr-num-prompts", "3", "--thr-input-len", "8",
                       "--thr-output-len", "3", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert not r["errors"], r["errors"]
    for mode in ("eager", "static"):  # (decode = total - prefill: too noisy to check on a tiny model)
        lat = r["latency"][mode]
        assert lat["latency_s"] > 0 and lat["prefill_s"] > 0 and lat["output_tok_s"] > 0 and "decode_tok_s" in lat
    assert r["throughput"]["batch"] == 3 and r["throughput"]["output_tok_s"] > 0
    assert os.path.exists(out) and r["num_params"] > 0


def test_hf_peer_eos_as_argmax_is_not_suppressed(tmp_path):
    """turnout's ignore_eos lets EOS be chosen; the peer must too (min_new_tokens would forbid it)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import hf_peer
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    prompts = bench_models.random_prompts(2, 8, TINY["vocab_size"], seed=11)
    hf = hf_peer.build_hf_model(str(_write(tmp_path, TINY, "probe")), torch.float32, "cpu", seed=1)
    with torch.no_grad():
        first = int(hf(torch.tensor([prompts[0]])).logits[0, -1].argmax())
    d = str(_write(tmp_path, {**TINY, "eos_token_id": first}, "eos"))  # same weights (seeded), EOS = argmax
    hf = hf_peer.build_hf_model(d, torch.float32, "cpu", seed=1)
    llm = hf_peer.make_turnout(d, "float32", "cpu", max_model_len=32, kv_cache_memory=1 << 22)
    hf_peer.load_into_turnout(llm, hf)
    r = hf_peer.compare(hf, llm, prompts, 6)
    assert r["turnout_tokens"][0][0] == first and r["greedy_match"], r


def test_hf_peer_measures_how_close_a_greedy_mismatch_was(tmp_path):
    """A continuation that takes HF's second choice at one position: the report gives the gap between the
    two logits (HF's top-2 margin there) in ulps, and calls it a near-tie only when it is a few ulps."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import hf_peer
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    hf = hf_peer.build_hf_model(str(_write(tmp_path, TINY)), torch.float32, "cpu", seed=2)
    prompts = bench_models.random_prompts(2, 8, TINY["vocab_size"], seed=13)
    hf_tokens = hf_peer.hf_greedy(hf, prompts, 5)
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + hf_tokens[0][:3]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    ours = [hf_tokens[0][:3] + [second, 0], list(hf_tokens[1])]
    (m,) = hf_peer.mismatch_margins(hf, prompts, hf_tokens, ours, [3, None])
    assert (m["prompt"], m["position"], m["hf_token"], m["turnout_token"]) == (0, 3, hf_tokens[0][3], second)
    assert m["gap_to_turnout_choice"] == pytest.approx(m["hf_top2_margin"], abs=1e-6)
    assert m["near_tie"] == (m["gap_ulps"] <= hf_peer.NEAR_TIE_ULPS)
    assert m["gap_ulps"] > 100  # random fp32 logits: the top two are far apart in fp32 ulps


def test_decode_step_ab_checks_settings_and_needs_a_gpu():
    """benchmarks/decode_step_ab.py: a malformed --settings is refused before anything loads; without a
    GPU it says it needs one (exit 2) instead of failing inside graph capture."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_step_ab.py"
    bad = subprocess.run([sys.executable, str(script), "--settings", '{"TURNOUT_PDL": "0"}'], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "--settings" in bad.stderr
    bad = subprocess.run([sys.executable, str(script), "--settings", '[{"model:fused_norms": "0"}]'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "model:fused_norms" in bad.stderr and "model:fused_prenorm" in bad.stderr
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, str(script), "--settings", '[{}, {"TURNOUT_PDL": "0"}]'],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


def test_bench_measures_with_the_startup_heap_frozen_and_gives_the_collector_back(tmp_path, monkeypatch):
    """`turnout bench` freezes the start-up heap for the measured steps (turnout/utils/gc_freeze.py: full
    collections scan none of it) and unfreezes after, so a caller in the same process (this test) keeps its
    collector."""
    import gc

    seen = []
    measure = bench_cmd.bench_latency

    def spy(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return measure(*args, **kwargs)
    monkeypatch.setattr(bench_cmd, "bench_latency", spy)
    assert gc.get_freeze_count() == 0
    rc = cli_main(["--log-level", "WARNING", "bench", "latency", "--model", str(_write(tmp_path, TINY)), *COMMON,
                   "--batch-size", "2", "--num-iters", "1"])
    assert rc == 0 and len(seen) == 1 and seen[0] > 1000  # the model, torch, transformers: far more than that
    assert gc.get_freeze_count() == 0
