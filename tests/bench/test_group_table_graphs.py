"""The decode CUDA graphs of a model with several table groups (a tiny Gemma 3, five sliding layers of window 6 to
one global): each further group's slot mapping and block tables are static graph inputs too. On CPU the graph
path runs with an eager stand-in for replay on the static buffers (tests/bench/test_cuda_graphs.py's pattern), so
the very input-building code of a replay (worker/graph_inputs.py: layout, padding, re-padding, the per-group
copies) is what feeds the forward; its tokens must equal the plain eager path's while sliding groups release
and reuse blocks (their tables differ from the full group's). On a GPU, real capture and replay."""

import json

import pytest
import torch

from turnout.worker.cuda_graphs import DecodeGraphs

GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
          "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_hidden_layers": 6, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "sliding_window": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
          "query_pre_attn_scalar": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
          "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 2}
PROMPTS = [list(range(3, 25)), [9, 8, 7, 6, 5, 4, 3, 2, 1], list(range(40, 53))]
MAX_TOKENS = [14, 20, 9]  # lanes finish at different steps: the batch shrinks


def _llm(tmp_path, **kw):
    from turnout.engine.llm import LLM
    from turnout.entrypoints.bench_models import NullTokenizer

    d = tmp_path / "gemma3"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(GEMMA3))
    return LLM(str(d), tokenizer=NullTokenizer(), load_format="dummy", dtype="float32", max_model_len=64,
               max_num_seqs=4, block_size=4, enable_prefix_caching=False, **kw)


def _spread(model):
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def _generate(llm):
    from turnout.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=3) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: e.logprob for t, e in lp.items()} for lp in o.outputs[0].logprobs])
            for o in outs]


def _same(a, b, atol):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        for x, y in zip(la, lb):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= atol for t in x)


class _EagerReplay:
    def __init__(self, graphs, b):
        self.graphs, self.b = graphs, b

    def replay(self):
        self.graphs._forward(self.b)


def test_group_tables_graph_path_matches_eager_cpu(tmp_path):
    llm = _llm(tmp_path, device="cpu", kv_cache_memory=60 * 4 * 2 * 2 * 16 * 4)  # 60 one-layer pages
    runner = llm.engine.runner
    assert runner.layer_group == (1, 2, 3, 4, 5, 0)  # the full group first, one layer per group
    _spread(runner.model)
    eager = _generate(llm)
    dg = DecodeGraphs(runner.model, runner.kv_caches, 4, runner.max_model_len, runner.block_size, runner.device,
                      layer_group=runner.layer_group)
    assert len(dg.inputs.group_tables) == 5
    dg.graphs = {b: _EagerReplay(dg, b) for b in dg.buckets}
    with torch.inference_mode():
        dg._forward(dg.buckets[-1])  # what capture's warm-up does first: the shared logits buffer
    runner.graphs = dg
    graphed = _generate(llm)
    assert dg.num_replays >= max(MAX_TOKENS) - 2
    _same(graphed, eager, 1e-5)
    assert llm.engine.block_manager.num_window_released > 0  # the sliding groups' tables moved on
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.capacity


@pytest.mark.gpu
def test_group_tables_cuda_graphs_match_eager(tmp_path):
    llm = _llm(tmp_path, device="auto", kv_cache_memory=1 << 24)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.enabled, getattr(runner.graphs, "disabled_reason", None)
    assert runner.graphs.layer_group == runner.layer_group and len(runner.graphs.inputs.group_tables) == 5
    _spread(runner.model)  # in place: the graphs read the same storage
    graphed = _generate(llm)
    assert runner.graphs.num_replays > 0
    runner.graphs, saved = None, runner.graphs
    eager = _generate(llm)
    runner.graphs = saved
    _same(graphed, eager, 1e-4)
