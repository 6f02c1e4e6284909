"""The KV tiers' counters where users read them: ``LLM.get_stats()`` and ``turnout bench``'s table and JSON
(``kv_tiers``: the counters' change over the measured part), on a tiny dummy Qwen3 on CPU with a KV cache
small enough to force swap preemptions."""

from __future__ import annotations

import json

from turnout.engine.llm import LLM
from turnout.engine.sampling_params import SamplingParams
from turnout.entrypoints.cli import main as cli_main
from turnout.kv.stats import GAUGES, TOTALS

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 0}
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block_size x kv heads x head_dim x float32


def _model(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def test_bench_reports_the_tier_counters(tmp_path, capsys):
    out = tmp_path / "thr.json"
    argv = ["--log-level", "WARNING", "bench", "throughput", _model(tmp_path), "--load-format", "dummy",
            "--dtype", "float32", "--device", "cpu", "--input-len", "12", "--output-len", "40", "--no-ceilings",
            "--kv-cache-memory", str(8 * BLOCK_BYTES), "--num-prompts", "8", "--max-num-seqs", "8",
            "--preemption-mode", "swap", "--swap-space", "0.01", "--output-json", str(out)]
    assert cli_main(argv) == 0
    r = json.loads(out.read_text())
    t = r["kv_tiers"]
    assert set(TOTALS) | set(GAUGES) <= t.keys()
    assert t["preemption_mode"] == "swap" and t["swap_strategy"] == "sync per layer" and t["swap_ops_failed"] == []
    assert t["swap_preemptions_total"] > 0 and t["recompute_preemptions_total"] == 0
    assert t["swap_preemptions_total"] == r["num_preemptions"]  # the same measured part as the old key
    assert t["swapped_out_blocks_total"] == t["swapped_in_blocks_total"] > 0 and t["num_swapped"] == 0
    text = capsys.readouterr().out
    assert f"{t['swap_preemptions_total']} swap / 0 recompute preemptions" in text


def test_llm_get_stats_has_the_tier_counters(tmp_path):
    llm = LLM(model=_model(tmp_path), load_format="dummy", dtype="float32", kv_cache_memory=8 * BLOCK_BYTES,
              max_num_seqs=8, preemption_mode="swap", swap_space=0.01)
    llm.generate([[5 + i] * 12 for i in range(8)], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    s = llm.get_stats()
    assert s == llm.engine.get_stats()
    assert s.swap_preemptions_total > 0 and s.swapped_out_blocks_total == s.swapped_in_blocks_total > 0
    assert s.num_preemptions_total == s.swap_preemptions_total + s.recompute_preemptions_total
