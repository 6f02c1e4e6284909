"""`turnout generate`: stream text for one prompt; a progress bar (tokens/s) for many."""

import argparse
import os
import sys

from turnout.entrypoints.engine_args import (add_kv_tier_and_parallel_args, add_multinode_args, add_quantization_arg,
                                            multinode_kwargs)


def add_arguments(p) -> None:
    # The positionals are the prompts (any text); a first one that is an existing model file or directory is
    # taken as the model (run: _model_given_as_prompt), as vLLM users type it.
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="apply the model's chat template to each prompt (default: off)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--ops-policy", default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of shared prompt prefixes (default: on)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="no CUDA graphs (default: graphs on a GPU)")
    add_kv_tier_and_parallel_args(p)
    add_quantization_arg(p)
    add_multinode_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode step before the last one's tokens are read back "
                        "(default: on for GPUs, off on CPU)")


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
    from turnout.entrypoints.engine_args import distributed_kwargs

    _model_given_as_prompt(args)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              load_format=args.load_format, ops_policy=args.ops_policy,
              enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
              **distributed_kwargs(args),
              enable_expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype,
              batch_invariant=args.batch_invariant,
              preemption_mode=args.preemption_mode, swap_space=args.swap_space, kv_offload_gb=args.kv_offload_gb,
              **multinode_kwargs(args))
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
