"""A colocated RL loop with turnout as the rollout engine, small enough to run on a laptop CPU.

The trainer is a transformers model (a tiny random Qwen3 unless ``--model`` names one); the task is a toy one
(reward: the share of its tokens below ``--below``). Each step: turnout samples, the engine sleeps while
the trainer recomputes the logprobs and takes a REINFORCE step, then wakes and takes the new weights. Printed
per step: the mean reward and the largest |turnout logprob - trainer logprob| of the sampled tokens (the
"training-inference mismatch", which should be ~1e-6 in float32).

    python examples/rl_loop.py --steps 8
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

from turnout import LLM, SamplingParams


def tiny_model(path: str) -> None:
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an HF model directory (default: a tiny random Qwen3)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--below", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-2)
    args = ap.parse_args(argv)
    path = args.model or tempfile.mkdtemp(prefix="turnout-rl-")
    if args.model is None:
        tiny_model(path)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20)
    prompts = [[1, 2, 3, 4], [9, 8, 7], [20, 21, 22, 23, 24], [5]] * 4
    sampling = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=0)
    worst = 0.0
    for step in range(args.steps):
        rollouts = llm.generate_tokens(prompts, sampling)
        llm.sleep(level=1)  # colocated: the trainer would have the device now
        rewards = torch.tensor([sum(t < args.below for t in r.token_ids) / len(r.token_ids) for r in rollouts])
        adv = rewards - rewards.mean()
        opt.zero_grad()
        loss, mismatch = 0.0, 0.0
        for r, a in zip(rollouts, adv):
            ids = torch.tensor([r.prompt_token_ids + r.token_ids])
            lp = trainer(ids).logits[0, :-1].float().log_softmax(-1)[len(r.prompt_token_ids) - 1:]
            tok_lp = lp.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
            mismatch = max(mismatch, (tok_lp.detach() - torch.tensor(r.logprobs)).abs().max().item())
            loss = loss - a * tok_lp.sum() / len(prompts)
        loss.backward()
        opt.step()
        llm.wake_up(tags=["weights"])
        llm.update_weights(trainer.named_parameters())
        llm.wake_up(tags=["kv_cache"])
        worst = max(worst, mismatch)
        print(f"step {step}: mean reward {rewards.mean():.3f}, rollout/trainer logprob mismatch {mismatch:.2e}")
    return worst


if __name__ == "__main__":
    main()
