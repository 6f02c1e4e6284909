"""`turnout generate`: stream text for one prompt; a progress bar (tokens/s) for many."""

import argparse
import os
import sys

from turnout.config import EngineConfig
from turnout.entrypoints.engine_args import add_engine_args, add_vllm_noop_args

# Not flags of generate: --model and --seed are spelled below (--seed seeds the sampling here), and a server's
# name and replicas mean nothing offline.
EXCLUDED = ("model", "seed", "served_model_name", "data_parallel_size")


def add_arguments(p) -> None:
    # The positionals are the prompts (any text); a first one that is an existing model file or directory is
    # taken as the model (run: _model_given_as_prompt), as vLLM users type it.
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=None, help=EngineConfig.__dataclass_fields__["model"].metadata["help"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="apply the model's chat template to each prompt (default: off)")
    add_engine_args(p, exclude=EXCLUDED)
    add_vllm_noop_args(p)


def _model_given_as_prompt(args) -> None:
    """``turnout generate model.gguf "prompt"``: the first positional is a model, not text. A .gguf file or a
    directory with a config.json is taken as the model (when --model is not given); a name ending in .gguf
    that does not exist is an error naming it, never silently a prompt."""
    first = args.prompts[0]
    if args.model is not None or "\n" in first:
        return
    path = os.path.expanduser(first)
    is_model = (os.path.isfile(path) and first.endswith(".gguf")) or os.path.isfile(os.path.join(path, "config.json"))
    if not is_model and first.endswith(".gguf") and " " not in first:
        raise ValueError(f"model file {first!r} does not exist (the model is --model MODEL or "
                         "the first argument; the prompts follow)")
    if not is_model:
        return
    if len(args.prompts) == 1:
        raise ValueError(f"{first!r} is a model, and no prompt follows it "
                         f"(turnout generate {first} \"PROMPT\")")
    args.model, args.prompts = first, args.prompts[1:]


def run(args) -> int:
    import time

    from turnout.engine.llm import LLM
    from turnout.engine.sampling_params import SamplingParams
    from turnout.entrypoints.engine_args import engine_kwargs, note_vllm_noop_args

    _model_given_as_prompt(args)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    note_vllm_noop_args(args)
    llm = LLM(model=args.model, **engine_kwargs(args, exclude=EXCLUDED))
    engine = llm.engine
    if args.chat:
        prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts]
    else:
        prompts = list(args.prompts)
    if len(prompts) == 1:
        engine.add_request("0", prompts[0], params)
        shown, t0, n = 0, time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
                n = len(out.outputs[0].token_ids)
        dt = time.perf_counter() - t0
        sys.stdout.write("\n")
        print(f"[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tokens/s]", file=sys.stderr)
        return 0
    for i, out in enumerate(llm._run(prompts, params, use_tqdm=True)):
        print(f"--- [{i}] {args.prompts[i]!r}\n{out.outputs[0].text}")
    return 0
