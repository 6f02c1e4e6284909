"""The peer: HF transformers ``generate`` on the same workloads as ``turnout bench``, on weights that are
provably identical to the ones turnout runs.

How the weights are made identical: the HF model is built from the same config.json and filled with
seeded random values (``fill_seeded``); turnout builds the same config with dummy weights and then loads
the HF state dict through its own declarative weight map (``model.load_weights(hf.state_dict().items())``,
in-place copies, so captured CUDA graphs see them). ``--compare-turnout N`` then checks (1) a checksum of
every parameter (sum and sum of squares in float64; packing qkv or gate/up does not change them) and
(2) that N greedy tokens agree. tests/bench/test_bench_cli.py runs the same comparison on a tiny config.

Workloads (each written to the JSON as soon as it is measured, so a time limit loses only the rest):
  latency:    batch 1, --input-len / --output-len: eager (dynamic cache), then static cache
              (``cache_implementation="static"``, no compile), then static + torch.compile (--compile)
  throughput: one batch of --thr-input-len / --thr-output-len at the largest batch that fits
              (<= --max-batch and <= --thr-num-prompts), dynamic cache

    PYTHONPATH=$PWD python benchmarks/hf_peer.py --model qwen3-8b --dtype bfloat16 --output-json hf.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import time
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
from turnout.entrypoints.bench_models import random_prompts, resolve_model  # noqa: E402
from turnout.utils.roofline import machine  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- the model and its weights -----------------------------------------------------------------
def build_hf_model(config_dir: str, dtype: torch.dtype, device, seed: int = 0):
    """An HF causal LM from ``config_dir/config.json`` on ``device`` with seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    device = torch.device(device)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    # The peer never stops at EOS (turnout's benchmarks use ignore_eos): generate fills unset fields
    # from the model's own generation config, so the EOS id has to go there.
    model.generation_config.eos_token_id = None
    fill_seeded(model, seed)
    return model


@torch.no_grad()
def fill_seeded(model, seed: int = 0) -> None:
    """Deterministic weights with a useful spread: matrices N(0, 1/fan_in) (activations keep their
    scale, so greedy choices are not near-ties), 1-D weights (norms) 1 + N(0, 0.1^2), biases N(0, 0.02^2)."""
    gens: dict = {}
    for name, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        g = gens.get(p.device)
        if g is None:
            g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=g)
        elif p.ndim == 1:
            p.normal_(1.0, 0.1, generator=g)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)


@torch.no_grad()
def checksum(params) -> dict:
    """Sum and sum of squares (float64) of distinct parameter tensors, and their element count."""
    seen, s, s2, n = set(), 0.0, 0.0, 0
    for p in params:
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        x = p.detach().double()
        s += float(x.sum())
        s2 += float((x * x).sum())
        n += p.numel()
    return {"sum": s, "sum_sq": s2, "numel": n}


@torch.no_grad()
def turnout_checksum(model) -> dict:
    """``checksum`` of turnout's parameters as the checkpoint holds them: a (1 + w) norm (Gemma) stores 1 + w
    (turnout/layers/norm.py), so its w is taken back out: sum - n, and sum of squares - 2 sum + n."""
    c = checksum(model.parameters())
    for m in model.modules():
        if getattr(m, "unit_offset", False):
            w = m.weight.detach().double()
            c["sum"] -= w.numel()
            c["sum_sq"] += w.numel() - 2 * float(w.sum())
    return c


def load_into_turnout(llm, hf_model) -> set:
    """Copy the HF weights into the running turnout engine (through its weight map)."""
    model = llm.engine.runner.model
    loaded = model.load_weights(hf_model.state_dict().items())
    platform = llm.engine.platform
    platform.synchronize()
    return loaded


def make_turnout(config_dir: str, dtype: str, device: str, max_model_len: int, kv_cache_memory: int | None,
                 enforce_eager: bool = False, max_num_seqs: int = 8):
    from turnout.engine.llm import LLM
    from turnout.entrypoints.bench_models import bench_tokenizer

    return LLM(model=config_dir, load_format="dummy", dtype=dtype, device=device, max_model_len=max_model_len,
               kv_cache_memory=kv_cache_memory, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(2048, max_model_len), enable_prefix_caching=False,
               tokenizer=bench_tokenizer(config_dir))


@torch.no_grad()
def hf_greedy(hf_model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuation of each prompt, one at a time (no padding: nothing differs but the weights)."""
    out = []
    dev = next(hf_model.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        g = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config(hf_model, "eager", n))
        out.append(g[0, len(p):].tolist())
    return out


def turnout_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from turnout.engine.sampling_params import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


NEAR_TIE_ULPS = 4  # a flip within this many ulps of the model dtype, at the logits' scale, is a near-tie


@torch.no_grad()
def mismatch_margins(hf_model, prompts, hf_tokens, ours, first) -> list[dict]:
    """For each prompt whose greedy tokens diverge at position i: HF's logits there, the margin between its
    top two, and the gap between HF's choice and ours, in ulps of the model dtype at the logits' scale.
    A gap of a few ulps is a near-tie that summation order can flip; a large one is a wrong kernel."""
    dev = next(hf_model.parameters()).device
    mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}.get(hf_model.dtype, 23)
    out = []
    for j, (p, a, b, i) in enumerate(zip(prompts, hf_tokens, ours, first)):
        if i is None or i >= min(len(a), len(b)):
            continue
        logits = hf_model(torch.tensor([list(p) + a[:i]], device=dev)).logits[0, -1].float()
        top = logits.topk(2).values
        scale = logits.abs().max().item()
        ulp = 2.0 ** (math.floor(math.log2(max(scale, 1e-30))) - mant)
        gap = (logits[a[i]] - logits[b[i]]).item()
        out.append({"prompt": j, "position": i, "hf_token": a[i], "turnout_token": b[i],
                    "hf_top2_margin": (top[0] - top[1]).item(), "gap_to_turnout_choice": gap,
                    "logit_scale": scale, "gap_ulps": gap / ulp, "near_tie": gap / ulp <= NEAR_TIE_ULPS})
    return out


def compare(hf_model, llm, prompts, n: int) -> dict:
    """Weights checksum and greedy tokens, turnout vs HF, on identical weights."""
    hf_sum = checksum(hf_model.parameters())
    tu_sum = turnout_checksum(llm.engine.runner.model)
    a, b = hf_greedy(hf_model, prompts, n), turnout_greedy(llm, prompts, n)
    first = []
    for x, y in zip(a, b):
        first.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None if x == y else min(len(x), len(y))))
    rel = abs(hf_sum["sum_sq"] - tu_sum["sum_sq"]) / max(abs(hf_sum["sum_sq"]), 1e-30)
    margins = mismatch_margins(hf_model, prompts, a, b, first)
    return {"greedy_match": a == b, "num_tokens": n, "first_mismatch": first, "mismatches": margins,
            "mismatches_all_near_ties": all(m["near_tie"] for m in margins) if margins else None,
            "hf_tokens": a, "turnout_tokens": b,
            "checksum_hf": hf_sum, "checksum_turnout": tu_sum, "checksum_rel_diff": rel,
            "weights_identical": rel < 1e-5 and hf_sum["numel"] <= tu_sum["numel"]}


# ---- timing ------------------------------------------------------------------------------------
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def _generate_s(model, ids, new_tokens: int, mode: str = "eager") -> float:
    cfg = gen_config(model, mode, new_tokens)
    dev = ids.device
    _sync(dev)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    _sync(dev)
    assert out.shape[1] == ids.shape[1] + new_tokens, f"generated {out.shape[1] - ids.shape[1]} of {new_tokens}"
    return time.perf_counter() - t0


def gen_config(model, mode: str, new_tokens: int):
    """Greedy, exactly ``new_tokens`` (EOS neither stops nor is suppressed); eager = dynamic cache; static = static
    cache without compiling; static_compiled = static cache and generate's own torch.compile."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.max_new_tokens = new_tokens
    # ignore_eos as turnout does it: no EOS to stop at. (min_new_tokens would instead *forbid* EOS, which
    # changes greedy choices whenever EOS is the argmax.)
    cfg.min_new_tokens = None
    cfg.eos_token_id = None
    cfg.do_sample = False
    cfg.pad_token_id = 0
    for k in ("temperature", "top_p", "top_k"):
        setattr(cfg, k, None)
    if mode != "eager":
        cfg.cache_implementation = "static"
        cfg.disable_compile = mode != "static_compiled"
    return cfg


def hf_latency(model, prompt: list[int], output_len: int, mode: str) -> dict:
    """Batch 1: prefill = generate 1 token; decode step = (generate all - generate 1) / (output_len - 1)."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    t0 = time.perf_counter()
    _generate_s(model, ids, min(4, output_len), mode)  # warm-up (and the compile, for static_compiled)
    warm = time.perf_counter() - t0
    prefill = min(_generate_s(model, ids, 1, mode) for _ in range(2))
    total = _generate_s(model, ids, output_len, mode)
    step = (total - prefill) / max(output_len - 1, 1)
    return {"mode": mode, "input_len": len(prompt), "output_len": output_len, "warmup_s": warm, "prefill_s": prefill,
            "latency_s": total, "decode_step_ms": step * 1e3, "decode_tok_s": 1.0 / step if step > 0 else None,
            "output_tok_s": output_len / total}


def hf_throughput(model, num_prompts: int, input_len: int, output_len: int, max_batch: int, seed: int,
                  budget_frac: float = 0.8) -> dict:
    """One batch at the largest size that fits: estimated from the KV and activation bytes, then halved
    on out-of-memory."""
    dev = next(model.parameters()).device
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_tok = 2 * cfg.num_hidden_layers * (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim * \
        next(model.parameters()).element_size()
    batch = max(1, min(num_prompts, max_batch))
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        act_tok = 6 * cfg.intermediate_size * 2 + 4 * cfg.vocab_size / max(input_len, 1)  # rough, per prefill token
        while batch > 1 and batch * ((input_len + output_len) * kv_tok + input_len * act_tok) > budget_frac * free:
            batch //= 2
    vocab = cfg.vocab_size
    errors = []
    while batch >= 1:
        ids = torch.tensor(random_prompts(batch, input_len, vocab, seed), device=dev)
        try:
            dt = _generate_s(model, ids, output_len)
            return {"batch": batch, "input_len": input_len, "output_len": output_len, "elapsed_s": dt,
                    "output_tok_s": batch * output_len / dt, "total_tok_s": batch * (input_len + output_len) / dt,
                    "oom_retries": errors}
        except torch.cuda.OutOfMemoryError as e:
            errors.append(f"batch {batch}: out of memory")
            del e
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            batch //= 2
    return {"batch": 0, "error": "out of memory at batch 1", "oom_retries": errors}


# ---- main --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", help="config dir/file or a benchmarks/configs name")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--thr-num-prompts", type=int, default=512)
    ap.add_argument("--thr-input-len", type=int, default=1024)
    ap.add_argument("--thr-output-len", type=int, default=512)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--modes", default="eager,static", help="latency modes: eager, static, static_compiled")
    ap.add_argument("--compile", action="store_true", help="also static_compiled (torch.compile; slow to start)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--compare-turnout", type=int, default=0, metavar="N",
                    help="load these weights into turnout and compare N greedy tokens (0: skip)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)

    path, _ = resolve_model(args.model)
    dtype, dev = _DTYPES[args.dtype], torch.device(args.device)
    result = {"peer": "hf-transformers", "model": args.model, "model_path": path, "dtype": args.dtype,
              "device": str(dev), "machine": machine(), "latency": {}, "errors": {}}

    def save():
        text = json.dumps(result, indent=2, default=str)
        if args.output_json:
            with open(args.output_json + ".tmp", "w") as f:
                f.write(text + "\n")
            os.replace(args.output_json + ".tmp", args.output_json)

    def attempt(key, fn, put):
        """Run one workload; ``put(result)`` records it (None on error) before the JSON is saved."""
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - record and go on with the next workload
            result["errors"][key] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            out = None
        print(f"[hf_peer] {key}: {time.perf_counter() - t0:.1f}s {json.dumps(out, default=str)[:400]}", flush=True)
        put(out)
        save()

    t0 = time.perf_counter()
    model = build_hf_model(path, dtype, dev, args.seed)
    result["build_s"] = time.perf_counter() - t0
    result["num_params"] = sum(p.numel() for p in model.parameters())
    save()
    if args.compare_turnout > 0:
        def cmp():
            n = args.compare_turnout
            prompts = random_prompts(2, min(args.input_len, 64), model.config.vocab_size, args.seed + 7)
            llm = make_turnout(path, args.dtype, args.device, max_model_len=len(prompts[0]) + n,
                               kv_cache_memory=1 << 30 if dev.type == "cuda" else 1 << 26)
            try:
                load_into_turnout(llm, model)
                return compare(model, llm, prompts, n)
            finally:
                del llm
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        attempt("turnout_same_weights", cmp, lambda v: result.__setitem__("turnout_same_weights", v))
    prompt = random_prompts(1, args.input_len, model.config.vocab_size, args.seed)[0]
    for mode in [m for m in args.modes.split(",") if m and m != "static_compiled"]:
        attempt(f"latency_{mode}", lambda m=mode: hf_latency(model, prompt, args.output_len, m),
                lambda v, m=mode: result["latency"].__setitem__(m, v))
    if not args.skip_throughput:
        attempt("throughput", lambda: hf_throughput(model, args.thr_num_prompts, args.thr_input_len,
                                                    args.thr_output_len, args.max_batch, args.seed),
                lambda v: result.__setitem__("throughput", v))
    if args.compile or "static_compiled" in args.modes.split(","):  # last: compiling may take minutes
        attempt("latency_static_compiled", lambda: hf_latency(model, prompt, args.output_len, "static_compiled"),
                lambda v: result["latency"].__setitem__("static_compiled", v))
    print("JSON " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
