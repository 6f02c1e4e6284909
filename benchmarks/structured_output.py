"""What a grammar costs a decode step: constrained lanes against unconstrained ones, same model, same batch.

Three measurements (the embedded SmolLM2 by default; any model with a tokenizer via --model):

1. engine: B sequences decode ``--steps`` tokens (min_tokens = max_tokens, so every lane runs every step)
   with 0, 1 and B lanes constrained by a JSON schema (one long string field: the matcher stays inside
   JSON's string grammar, its commonest state) and B lanes by a regex. ms per step and tokens/s; the
   difference per step is the grammar's cost (fill the rows on the host, the copy, the mask op, the
   token accepted on the host, and the lookahead step async scheduling then does not launch).
2. stage: BitmaskStage.apply alone on [B, V] logits (fill + copy + apply_token_bitmask), with the bytes of
   logits it reads and writes per second.
3. compile: a cold schema (first request: TokenizerInfo is built once per engine, then the grammar) and a
   cached one, in ms.

Prints a table per part and one JSON line each (benchmarks/common.py: report).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from common import report


def _schema(min_len: int) -> dict:
    # minLength keeps the string open for every step measured (a token is at least one character), so no
    # lane finishes early and every step runs the whole batch
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": min_len,
                                                      "maxLength": 2 * min_len}}, "required": ["text"]}


def engine_rows(llm, batch: int, steps: int, reps: int) -> list[dict]:
    from turnout import SamplingParams
    from turnout.structured import StructuredOutputsParams

    tok = llm.get_tokenizer()
    prompt = tok.encode("Write a long story about a lighthouse keeper and the sea.")
    json_so = StructuredOutputsParams(json=_schema(16 * steps))
    regex_so = StructuredOutputsParams(regex=rf"[a-z ,.]{{{16 * steps},}}")

    def params(so, i):
        return SamplingParams(temperature=0.8, seed=i, max_tokens=steps, min_tokens=steps, ignore_eos=True,
                              structured_outputs=so)

    modes = [("unconstrained", [None] * batch), ("1 json lane", [json_so] + [None] * (batch - 1)),
             (f"{batch} json lanes", [json_so] * batch), (f"{batch} regex lanes", [regex_so] * batch)]
    llm.generate([prompt] * batch, [params(so, i) for i, so in enumerate(modes[3][1])], use_tqdm=False)  # warm
    # the prefill (and first token) is timed apart and taken off: it does not depend on the grammar
    first = min(_timed(llm, prompt, [SamplingParams(temperature=0.8, seed=i, max_tokens=1) for i in range(batch)])
                for _ in range(reps))
    best = {name: float("inf") for name, _ in modes}
    spent = {name: float("inf") for name, _ in modes}
    for _ in range(reps):  # the modes interleaved, so a noisy neighbour slows every mode alike
        for name, sos in modes:
            ps = [params(so, i) for i, so in enumerate(sos)]
            with _grammar_clock() as clock:
                took = _timed(llm, prompt, ps, steps) - first
            best[name] = min(best[name], took)
            spent[name] = min(spent[name], clock[0])
    if os.environ.get("SO_PROFILE"):  # where the host's time goes with every lane constrained (cProfile)
        import cProfile
        import pstats

        for name, sos in (modes[0], modes[2]):
            prof = cProfile.Profile()
            prof.enable()
            _timed(llm, prompt, [params(so, i) for i, so in enumerate(sos)], steps)
            prof.disable()
            print(f"== profile: {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ["SO_PROFILE"]))
    rows, base = [], best[modes[0][0]] / (steps - 1) * 1e3
    for name, _ in modes:
        ms = best[name] / (steps - 1) * 1e3
        rows.append({"mode": name, "batch": batch, "steps": steps, "ms_per_step": round(ms, 3),
                     "tok_per_s": round(batch * (steps - 1) / best[name], 1),
                     "extra_ms_per_step": round(ms - base, 3), "slower_pct": round(100 * (ms / base - 1), 1),
                     # timed inside the step: the mask stage (fill + copy + op) and the accepts on the host
                     "grammar_ms_per_step": round(spent[name] / steps * 1e3, 3),
                     "grammar_pct": round(100 * spent[name] / steps * 1e3 / ms, 2)})
    return rows


@contextlib.contextmanager
def _grammar_clock():
    """Seconds spent in BitmaskStage.apply and GrammarState.accept_token while the block runs ([total])."""
    from turnout.structured.mask import BitmaskStage
    from turnout.structured.matcher import GrammarState

    total = [0.0]
    saved = BitmaskStage.apply, GrammarState.accept_token

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[0] += time.perf_counter() - t0
        return run

    BitmaskStage.apply, GrammarState.accept_token = timed(saved[0]), timed(saved[1])
    try:
        yield total
    finally:
        BitmaskStage.apply, GrammarState.accept_token = saved


def _timed(llm, prompt, ps, steps: int = 1) -> float:
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * len(ps), ps, use_tqdm=False)
    took = time.perf_counter() - t0
    assert all(o.error is None and len(o.outputs[0].token_ids) == steps for o in outs), \
        [(o.error, len(o.outputs[0].token_ids)) for o in outs]
    return took


def stage_rows(llm, batches: list[int], reps: int) -> list[dict]:
    import torch

    from turnout.structured import StructuredOutputsParams
    from turnout.structured.mask import BitmaskStage

    engine = llm.engine
    compiler = engine.input_processor.grammar_compiler()
    runner = engine.runner
    v = runner.vocab_size
    compiled = compiler.compile(StructuredOutputsParams(json=_schema(64)))
    opening = engine.encode('{"text": "')
    rows = []
    for b in batches:
        states = []
        for _ in range(b):
            s = compiler.new_state(compiled)
            s.accept_tokens(opening)  # inside the string, where a long answer spends its steps
            states.append(s)
        stage = BitmaskStage(v, b, runner.device)
        logits = torch.randn(b, v, device=runner.device)
        grammars = list(enumerate(states))
        for _ in range(3):
            stage.apply(runner.ops, logits, grammars)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            stage.apply(runner.ops, logits, grammars)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = min(times)
        moved = 2 * logits.numel() * logits.element_size() + b * ((v + 31) // 32) * 4  # logits r+w, mask
        rows.append({"lanes": b, "vocab": v, "us_per_step": round(t * 1e6, 1), "us_per_lane": round(t * 1e6 / b, 1),
                     "GB_per_s": round(moved / t / 1e9, 3), "threaded": b >= 8})
    return rows


def compile_rows(model: str | None, **kw) -> list[dict]:
    from turnout import LLM
    from turnout.structured import StructuredOutputsParams

    llm = LLM(model, **kw)
    ip = llm.engine.input_processor
    t0 = time.perf_counter()
    compiler = ip.grammar_compiler()
    t_info = time.perf_counter() - t0
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "tags"]}
    so = StructuredOutputsParams(json=schema)
    t0 = time.perf_counter()
    compiler.compile(so)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=schema))
    t_hot = time.perf_counter() - t0
    return [{"what": "tokenizer info (once per engine)", "ms": round(t_info * 1e3, 2)},
            {"what": "3-field schema, cold", "ms": round(t_cold * 1e3, 2)},
            {"what": "same schema, cached", "ms": round(t_hot * 1e3, 3)}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--stage-batches", default="1,8,32")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--load-format", default=None, help="dummy: random weights (a config directory as --model)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (a dummy model's config has none)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-cache-memory-mb", type=int, default=256)
    ap.add_argument("--skip-compile", action="store_true", help="no cold-compile engine (saves a model load)")
    args = ap.parse_args()

    from turnout import LLM

    kw = {k: v for k, v in (("load_format", args.load_format), ("tokenizer", args.tokenizer),
                            ("dtype", args.dtype)) if v is not None}
    if not args.skip_compile:
        comp = compile_rows(args.model, kv_cache_memory=64 << 20, **kw)  # a fresh engine: the first request pays TokenizerInfo
        report("grammar compile", comp, ["what", "ms"], {})
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory_mb << 20, async_scheduling=args.async_scheduling,
              max_num_seqs=max(args.batch, 8), **kw)
    extra = {"device": str(llm.engine.runner.device), "async_scheduling": llm.engine.async_scheduling,
             "model": args.model or "SmolLM2-135M-Instruct", "tokenizer": args.tokenizer}
    report("structured output: stage alone", stage_rows(llm, [int(x) for x in args.stage_batches.split(",")],
                                                         20), ["lanes", "vocab", "us_per_step", "us_per_lane",
                                                               "GB_per_s", "threaded"], extra)
    report("structured output: decode steps", engine_rows(llm, args.batch, args.steps, args.reps),
           ["mode", "batch", "steps", "ms_per_step", "tok_per_s", "extra_ms_per_step", "slower_pct",
            "grammar_ms_per_step", "grammar_pct"], extra)
    extra["grammar_lookahead_steps"] = llm.engine.core.num_grammar_lookahead_steps
    print(extra)


if __name__ == "__main__":
    main()
