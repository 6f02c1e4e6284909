"""turnout/integrations/verl.py driven as verl's rollout loop drives its vLLM server (tiny float32 Qwen3 on
the CPU, written here): token ids in, the log probability of every sampled token out, equal to the HF
trainer's recomputation; the hybrid step (release -> resume weights -> update_weights from the trainer's
async iterator -> resume kv_cache) with sleep levels 1 and 2; abort_all_requests / abort_request during
generation return the partial tokens with stop_reason "aborted". verl's own classes are checked only
where ``import verl`` works (not in CI: verl pulls Ray, vLLM or SGLang and a GPU stack)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM  # noqa: E402
from turnout.integrations.verl import TokenOutput, TurnoutRolloutAdapter, TurnoutRolloutServer  # noqa: E402

VOCAB = 96
PROMPTS = [[3, 17, 42, 8, 91, 5, 60], [11, 2, 77, 30], list(range(50, 69))]  # the last crosses a block of 16


def _config():
    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=4096, tie_word_embeddings=True)


def _randomised(seed):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    return hf.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("verl_dense")
    hf = _randomised(0)
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=4 << 20, enforce_eager=True,
              max_model_len=4096, max_num_seqs=8)
    return llm, hf


@torch.no_grad()
def _hf_logprobs(hf, prompt, tokens):
    lp = hf(torch.tensor([list(prompt) + list(tokens)])).logits[0].float().log_softmax(-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@torch.no_grad()
def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _run(server, body):
    """One event loop per test, as verl's server actor has one; the engine thread stops with it."""
    async def main():
        try:
            return await body()
        finally:
            await server.shutdown()

    return asyncio.run(main())


async def _rollout(server, sampling, tag):
    """The agent loop's fan-out: every prompt at once, each its own request id."""
    return await asyncio.gather(*(server.generate(p, dict(sampling), request_id=f"{tag}-{i}")
                                  for i, p in enumerate(PROMPTS)))


def _check_against_trainer(hf, outs, max_tokens):
    worst = 0.0
    for p, o in zip(PROMPTS, outs):
        assert isinstance(o, TokenOutput) and o.stop_reason == "completed"
        assert len(o.token_ids) == max_tokens == len(o.log_probs)
        ref = _hf_logprobs(hf, p, o.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(o.log_probs, ref)))
    assert worst <= 1e-5, f"rollout/trainer logprob mismatch {worst:.3g}"
    return worst


def test_generate_tokens_in_logprobs_equal_trainer(setup, capsys):
    llm, hf = setup
    server = TurnoutRolloutServer(llm, response_length=5)

    async def body():
        sampled = await _rollout(server, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True,
                                          "repetition_penalty": 1.0, "seed": 7, "ignore_eos": True}, "s")
        greedy = await _rollout(server, {"temperature": 0.0, "logprobs": True, "max_new_tokens": 6,
                                         "ignore_eos": True}, "g")
        plain = await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 3}, "plain")
        full = await server.generate([5] * 4096, {"max_tokens": 8, "logprobs": True}, "full")
        return sampled, greedy, plain, full

    sampled, greedy, plain, full = _run(server, body)
    worst = max(_check_against_trainer(hf, sampled, 5), _check_against_trainer(hf, greedy, 6))
    with capsys.disabled():
        print(f"\nverl adapter: rollout vs trainer logprobs max |delta| = {worst:.2e}")
    assert [o.token_ids for o in greedy] == [_hf_greedy(hf, p, 6) for p in PROMPTS]
    assert plain.token_ids == greedy[0].token_ids[:3] and plain.log_probs is None  # logprobs not asked for
    assert full.token_ids == [] and full.log_probs == [] and full.stop_reason == "completed"  # no room left


def test_bad_requests_name_the_field(setup):
    llm, _ = setup
    server = TurnoutRolloutServer(llm)

    async def body():
        for sampling, field in [({"temprature": 1.0}, "sampling_params.temprature"), ({"n": 2}, "n"),
                                ({"temperature": -1.0}, "temperature"), ({"max_tokens": "8"}, "max_tokens"),
                                ({"max_tokens": 2, "max_new_tokens": 2}, "max_new_tokens"),
                                ({"return_routed_experts": True}, "return_routed_experts")]:  # a dense model
            with pytest.raises(ValueError, match=field):
                await server.generate(PROMPTS[0], sampling, "bad")
        with pytest.raises(ValueError, match="image_data"):
            await server.generate(PROMPTS[0], {}, "img", image_data=["x"])
        with pytest.raises(ValueError, match="prompt_ids"):
            await server.generate([5] * 4097, {}, "long")
        with pytest.raises(ValueError, match="peft_config"):
            await server.update_weights([], peft_config={"r": 8})
        # the engine is still fine
        return await server.generate(PROMPTS[1], {"temperature": 0.0, "max_tokens": 2}, "ok")

    assert len(_run(server, body).token_ids) == 2


def _trainer_weights(hf):
    """verl's trainer hands the rollout an (async) generator of (HF name, full tensor)."""
    async def gen():
        for name, p in hf.named_parameters():
            yield name, p.detach().clone()
            await asyncio.sleep(0)
    return gen()


@pytest.mark.parametrize("level", [1, 2])
def test_hybrid_step_release_update_resume(setup, level):
    """What verl's hybrid worker does around a training step: release (sleep), resume(["weights"]),
    update_weights(trainer's new weights), resume(["kv_cache"]); the next rollout is the new model's."""
    llm, hf = setup
    server = TurnoutRolloutServer(llm)
    adapter = TurnoutRolloutAdapter(server, sleep_level=level)
    new = _randomised(level + 10)
    greedy = {"temperature": 0.0, "logprobs": True, "max_tokens": 5, "ignore_eos": True}

    async def body():
        before = await _rollout(server, greedy, "b")
        await adapter.release()
        assert server.is_sleeping()
        with pytest.raises(Exception, match="sleep"):
            await server.generate(PROMPTS[0], greedy, "asleep")
        await adapter.resume(["weights"])
        await adapter.update_weights(_trainer_weights(new))
        await adapter.resume(["kv_cache"])
        assert not server.is_sleeping()
        changed = await _rollout(server, greedy, "c")
        await adapter.release()
        await adapter.resume(["weights"])
        await adapter.update_weights(hf.named_parameters())  # a plain iterator works too
        await adapter.resume(["kv_cache"])
        back = await _rollout(server, greedy, "r")
        return before, changed, back

    before, changed, back = _run(server, body)
    _check_against_trainer(new, changed, 5)
    assert [o.token_ids for o in changed] == [_hf_greedy(new, p, 5) for p in PROMPTS]
    assert [o.token_ids for o in changed] != [o.token_ids for o in before]
    # the old weights back: the old rollout (logprobs to rounding: "before" may have been a prefix-cache hit of
    # an earlier test's prompts, whose chunks a CPU GEMM rounds differently in the last bits)
    assert [o.token_ids for o in back] == [o.token_ids for o in before]
    _check_against_trainer(hf, back, 5)


async def _until_generating(server, request_ids, min_tokens=2):
    for _ in range(3000):
        outs = [server._last.get(r) for r in request_ids]
        if all(o is not None and len(o.outputs[0].token_ids) >= min_tokens for o in outs):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the requests did not start generating")


def test_abort_all_and_abort_one_return_partial_outputs(setup):
    llm, hf = setup
    server = TurnoutRolloutServer(llm)
    long = {"temperature": 1.0, "logprobs": True, "max_tokens": 3000, "ignore_eos": True}

    async def body():
        tasks = [asyncio.ensure_future(server.generate(p, dict(long), f"long-{i}")) for i, p in enumerate(PROMPTS)]
        await _until_generating(server, [f"long-{i}" for i in range(len(PROMPTS))])
        info = await server.abort_all_requests()
        outs = await asyncio.gather(*tasks)
        after = await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 2}, "after")  # admitted again
        one = asyncio.ensure_future(server.generate(PROMPTS[1], dict(long), "one"))
        other = asyncio.ensure_future(server.generate(PROMPTS[2], {**long, "max_tokens": 4}, "other"))
        await _until_generating(server, ["one"])
        missing = await server.abort_request("nobody")
        res = await server.abort_request("one")
        return info, outs, after, await one, await other, missing, res

    info, outs, after, one, other, missing, res = _run(server, body)
    assert info["aborted_count"] == 3 and sorted(info["request_ids"]) == ["long-0", "long-1", "long-2"]
    for o in outs + [one]:
        assert o.stop_reason == "aborted" and 2 <= len(o.token_ids) < 3000 and len(o.log_probs) == len(o.token_ids)
    for p, o in zip(PROMPTS, outs):  # the partial tokens are real samples: their logprobs are the trainer's
        ref = _hf_logprobs(hf, p, o.token_ids)
        assert max(abs(a - b) for a, b in zip(o.log_probs, ref)) <= 1e-5
    assert len(after.token_ids) == 2 and after.stop_reason == "completed"
    assert res == {"aborted": True, "request_id": "one"} and missing["aborted"] is False
    assert other.stop_reason == "completed" and len(other.token_ids) == 4  # aborting one left the other alone


def test_matches_verls_own_classes(setup):
    """verl's BaseRollout abstract methods and the vLLM server methods its replica and agent loop call exist
    here with the same parameters; TokenOutput converts to verl's pydantic TokenOutput."""
    pytest.importorskip("verl", reason="verl is not installed (it needs Ray and vLLM or SGLang)")
    server_mod = pytest.importorskip("verl.workers.rollout.vllm_rollout.vllm_async_server",
                                     reason="verl's vLLM server needs vllm and ray")
    from verl.workers.rollout.base import BaseRollout

    vLLMHttpServer = server_mod.vLLMHttpServer  # noqa: N806 - verl's name

    for name in BaseRollout.__abstractmethods__:
        ours = getattr(TurnoutRolloutAdapter, name)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(getattr(BaseRollout, name))
        assert list(inspect.signature(getattr(BaseRollout, name)).parameters)[:2] == \
            list(inspect.signature(ours).parameters)[:2]
    for name in ("generate", "wake_up", "sleep", "clear_kv_cache", "abort_all_requests", "abort_request"):
        theirs = inspect.unwrap(getattr(vLLMHttpServer, name, None) or getattr(vLLMHttpServer.__ray_actor_class__, name))
        ours = getattr(TurnoutRolloutServer, name)
        assert inspect.iscoroutinefunction(ours)
        required = [p for p, v in inspect.signature(theirs).parameters.items() if v.default is inspect.Parameter.empty]
        assert set(required) <= set(inspect.signature(ours).parameters), name
    v = TokenOutput([1, 2], [-0.5, -0.25], None, "completed").to_verl()
    assert v.token_ids == [1, 2] and v.log_probs == [-0.5, -0.25] and v.stop_reason == "completed"
