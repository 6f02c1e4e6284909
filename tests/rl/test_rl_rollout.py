"""turnout as an RL rollout engine, uniproc on the CPU in float32, against a real trainer: a
transformers model that torch optimises; after every optimizer step its ``named_parameters()`` go to
``LLM.update_weights`` and turnout's greedy tokens and the logprobs of its sampled tokens must equal the
updated HF model's. Then sleep / wake (memory really released, outputs identical after), all-or-nothing
updates, and pause / abort / resume while a generate() runs in another thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

VOCAB = 96
PROMPTS = [[3, 17, 42, 8, 91, 5, 60], [11, 2, 77, 30], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63,
                                                       64, 65, 66, 67, 68]]  # the last one crosses a block of 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KW = dict(kv_cache_memory=2 << 20, enforce_eager=True, dtype="float32", device="cpu")


def _randomise(model, seed):
    """HF initialises norms to 1 and weights small: random values make every parameter count and the greedy
    tokens vary."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def _dense_config():  # tied embeddings: the head is the embedding (one HF name updates both)
    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=256, tie_word_embeddings=True)


def _moe_config():  # 2I != H, so a transposed expert tensor cannot pass for the right one
    return transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                       moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                                       decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])


def _save(config, path, seed):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(hf, seed)
    hf.save_pretrained(path, safe_serialization=True)
    return hf.eval()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl_dense")
    return _save(_dense_config(), path, 0), str(path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl_moe")
    return _save(_moe_config(), path, 1), str(path)


def _fresh_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def _hf_logprobs(hf, prompt, tokens):
    """log p(token_i | prompt, tokens_<i) under the HF model: the trainer's recomputation."""
    logits = hf(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _check_matches_hf(llm, hf, tol=1e-5) -> float:
    """Greedy tokens equal HF's; turnout's logprobs of them equal the HF model's. Returns the max |delta|."""
    worst = 0.0
    outs = llm.generate_tokens(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.stop_reason == "completed" and out.finish_reason == "length"
        assert out.token_ids == _hf_greedy(hf, prompt, GREEDY.max_tokens)
        ref = _hf_logprobs(hf, prompt, out.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, ref)))
    assert worst <= tol, f"train/rollout logprob mismatch {worst:.3g}"
    return worst


def _train_step(hf, opt, rollouts):
    """One policy-gradient-shaped step on turnout's samples: -mean(advantage * log p(sampled)) recomputed
    by the trainer; returns the trainer's logprobs before the step (to compare with turnout's)."""
    hf.train()
    opt.zero_grad()
    loss = 0.0
    before = []
    for i, r in enumerate(rollouts):
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        lp = hf(ids).logits[0, :-1].float().log_softmax(-1)
        n = len(r.prompt_token_ids)
        tok_lp = lp[n - 1:].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        before.append(tok_lp.detach().tolist())
        loss = loss - (1.0 if i % 2 == 0 else -1.0) * tok_lp.mean()
    loss.backward()
    opt.step()
    hf.eval()
    return before


def _per_expert(named):
    """HF's stacked expert tensors, split into the per-expert checkpoint names (the older HF format)."""
    for name, t in named:
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_trainer_loop_pushes_weights_and_rollout_matches_trainer(family, dense, moe, capsys):
    _, path = dense if family == "dense" else moe
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    _check_matches_hf(llm, hf)
    opt = torch.optim.Adam(hf.parameters(), lr=3e-2)
    sampling = SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    for step in range(3):
        rollouts = llm.generate_tokens(PROMPTS, sampling)
        trainer_lps = _train_step(hf, opt, rollouts)
        # turnout's logprobs of its own samples = the trainer's recomputation on the same (pre-step) weights
        mismatch = max(abs(a - b) for r, t in zip(rollouts, trainer_lps) for a, b in zip(r.logprobs, t))
        assert mismatch <= 1e-5, mismatch  # in float32 the importance ratios stay within 1e-5 of 1
        old = llm.generate_tokens(PROMPTS[0], GREEDY)
        named = list(hf.named_parameters())
        if family == "moe" and step % 2 == 1:
            named = list(_per_expert(named))  # the per-expert format on odd steps, stacked on even ones
        written = llm.update_weights(named[::-1])  # any order
        assert written
        after = _check_matches_hf(llm, hf)
        with capsys.disabled():
            print(f"\n[{family}] step {step}: sampled-token logprob mismatch {mismatch:.2e}, "
                  f"greedy after push {after:.2e}")
        if step == 0:  # the push did change the rollout model
            assert llm.generate_tokens(PROMPTS[0], GREEDY).logprobs != old.logprobs


def test_update_weights_any_subset_keeps_k_major_layout(dense):
    hf, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
    stride, ptr = qkv.stride(), qkv.data_ptr()
    assert stride == (1, qkv.shape[0])  # CPU weights are K-major after the load (turnout/layers/layout.py)
    with torch.no_grad():
        hf.model.layers[0].self_attn.k_proj.weight.mul_(-1.5)
        hf.model.embed_tokens.weight.add_(0.1)  # tied: the LM head follows
    llm.update_weights({"model.layers.0.self_attn.k_proj.weight": hf.model.layers[0].self_attn.k_proj.weight,
                        "model.embed_tokens.weight": hf.model.embed_tokens.weight})
    assert qkv.stride() == stride and qkv.data_ptr() == ptr  # written in place: layout and address kept
    _check_matches_hf(llm, hf)


def test_bad_update_raises_naming_the_tensor_and_changes_nothing(dense):
    _, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    before = llm.generate_tokens(PROMPTS, GREEDY)
    good = [(n, t * 0.5) for n, t in hf.named_parameters()]
    cases = {
        "model.layers.1.mlp.up_proj.weight": [("model.layers.1.mlp.up_proj.weight", torch.zeros(95, 64))],
        "model.layers.0.self_attn.q_norm.weight": [("model.layers.0.self_attn.q_norm.weight", torch.zeros(17))],
        "model.layers.0.self_attn.bogus.weight": [("model.layers.0.self_attn.bogus.weight", torch.zeros(4))],
        "model.norm.weight": [("model.norm.weight", torch.zeros(64, dtype=torch.int32))],
    }
    for bad_name, bad in cases.items():
        with pytest.raises(ValueError, match=bad_name.replace(".", r"\.")):
            llm.update_weights(good[:7] + bad + good[7:])  # valid tensors before it: none may be written
    with pytest.raises(ValueError, match="weights\\[0\\]"):
        llm.update_weights([torch.zeros(3)])
    llm.reset_prefix_cache()  # from scratch as before: prefix hits round a CPU GEMM differently in the last bits
    after = llm.generate_tokens(PROMPTS, GREEDY)
    assert [(o.token_ids, o.logprobs) for o in after] == [(o.token_ids, o.logprobs) for o in before]


def _storages(llm):
    r = llm.engine.runner
    return ([StorageWeakRef(p.untyped_storage()) for p in r.model.parameters()],
            [StorageWeakRef(t.untyped_storage()) for kv in r.kv_caches for t in kv])


def test_sleep_level1_releases_and_wake_restores_identical_outputs(dense):
    _, path = dense
    llm = LLM(path, **KW)
    mem = llm.engine.runner.memory
    before = llm.generate_tokens(PROMPTS, GREEDY)
    held = mem.resident_bytes()
    assert held["weights"] > 0 and held["kv_cache"] > 0
    _, kv_refs = _storages(llm)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    now = mem.resident_bytes()
    assert now["weights"] == 0 and now["kv_cache"] == 0  # every parameter is an empty tensor, no KV tensor
    assert now["host_weights"] == held["weights"]  # level 1: the values wait in host memory
    assert all(r.expired() for r in kv_refs)  # the KV cache storage is really gone, not just unreferenced here
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate_tokens(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.update_weights([])
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()  # the weights still sleep
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate(PROMPTS[0], GREEDY)
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert mem.resident_bytes()["weights"] == held["weights"] and mem.resident_bytes()["host_weights"] == 0
    after = llm.generate_tokens(PROMPTS, GREEDY)
    assert [(o.token_ids, o.logprobs) for o in after] == [(o.token_ids, o.logprobs) for o in before]


def test_sleep_level2_discards_then_update_restores(dense):
    _, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    before = llm.generate_tokens(PROMPTS, GREEDY)
    w_refs, kv_refs = _storages(llm)
    llm.sleep(level=2)
    assert all(r.expired() for r in w_refs) and all(r.expired() for r in kv_refs)  # nothing kept anywhere
    assert llm.engine.runner.memory.resident_bytes() == {"weights": 0, "kv_cache": 0, "host_weights": 0}
    llm.wake_up(tags=["weights"])
    llm.update_weights(hf.named_parameters())
    llm.wake_up(tags=["kv_cache"])
    after = llm.generate_tokens(PROMPTS, GREEDY)
    assert [(o.token_ids, o.logprobs) for o in after] == [(o.token_ids, o.logprobs) for o in before]


def test_sleep_and_wake_arguments_are_checked(dense):
    _, path = dense
    llm = LLM(path, **KW)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["weights", "kv"])
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags="weights")
    with pytest.raises(ValueError, match="mode"):
        llm.pause_generation(mode="drop")
    with pytest.raises(ValueError, match="n:"):
        llm.generate_tokens(PROMPTS[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="request_id"):
        llm.generate_tokens(PROMPTS, GREEDY, request_id="x")
    assert llm.generate_tokens(PROMPTS[0], GREEDY, request_id="mine").request_id == "mine"
    assert not llm.is_sleeping()
    llm.engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()  # the KV cache is in use
    llm.engine.abort_request("busy")
    llm.sleep()
    llm.wake_up()
    assert llm.generate_tokens(PROMPTS[0], GREEDY).stop_reason == "completed"


def test_update_resets_prefix_cache(dense):
    _, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    long_prompt = PROMPTS[2] + PROMPTS[0] + PROMPTS[1]  # 30 tokens: one full block to cache
    llm.generate(long_prompt, GREEDY, use_tqdm=False)
    hit = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 16
    with torch.no_grad():
        hf.model.layers[0].self_attn.v_proj.weight.mul_(-1.0)
    llm.update_weights([("model.layers.0.self_attn.v_proj.weight", hf.model.layers[0].self_attn.v_proj.weight)])
    assert llm.engine.block_manager.num_cached_free_blocks == 0
    miss = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    assert miss.num_cached_tokens == 0  # the cached KV came from the old weights
    assert miss.outputs[0].token_ids == _hf_greedy(hf, long_prompt, GREEDY.max_tokens)


class _Slow:
    """A logits processor that marks when a request has drawn ``after`` tokens and slows each step, so
    another thread can act while generate() runs."""

    def __init__(self, after=3):
        self.after, self.reached = after, threading.Event()

    def __call__(self, token_ids, logits):
        if len(token_ids) >= self.after:
            self.reached.set()
        time.sleep(0.005)
        return logits


def _slow_steps(llm, after=4):
    """Slow every engine step of ``llm`` a little and mark when ``after`` have run (an event like _Slow's)."""
    runner, mark = llm.engine.runner, _Slow(after)
    execute, calls = runner.execute, []

    def slow_execute(*args, **kwargs):
        calls.append(1)
        mark(calls, None)
        return execute(*args, **kwargs)

    runner.execute = slow_execute  # the instance's: the engine core calls it for every step
    return mark


def _in_thread(fn, *args):
    box = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_reached(slow, t, box):
    """Until the generate() in ``t`` has drawn the tokens (or, with its error, failed)."""
    deadline = time.monotonic() + 60
    while not slow.reached.wait(0.05):
        assert t.is_alive() and time.monotonic() < deadline, box.get("err", "generate() ended early")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_all_during_generation_then_resume(dense, async_scheduling):
    _, path = dense
    llm = LLM(path, async_scheduling=async_scheduling, **KW)
    slow = _slow_steps(llm)  # no logits processor: lookahead steps stay on with async scheduling
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    t, box = _in_thread(llm.generate_tokens, PROMPTS, params)
    _wait_reached(slow, t, box)
    aborted = llm.abort_all_requests()
    t.join(60)
    assert not t.is_alive() and "err" not in box, box.get("err")
    outs = box["out"]
    assert [o.stop_reason for o in outs] == ["aborted"] * len(PROMPTS)
    assert {o.request_id for o in aborted} == {o.request_id for o in outs}
    for o in outs:
        assert 3 <= len(o.token_ids) < 200 and len(o.logprobs) == len(o.token_ids)  # the partial tokens
    assert (llm.engine.num_lookahead_steps > 0) == async_scheduling
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate_tokens(PROMPTS[0], GREEDY)
    llm.resume_generation()
    fresh = LLM(path, **KW).generate_tokens(PROMPTS, GREEDY)
    llm.reset_prefix_cache()  # computed from scratch like fresh (a prefix hit rounds differently in the last bits)
    again = llm.generate_tokens(PROMPTS, GREEDY)
    assert [(o.token_ids, o.logprobs) for o in again] == [(o.token_ids, o.logprobs) for o in fresh]


def test_pause_keep_update_weights_then_resume(dense):
    _, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    slow = _Slow()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logits_processors=[slow])
    t, box = _in_thread(llm.generate_tokens, PROMPTS[:2], params)
    _wait_reached(slow, t, box)
    assert llm.pause_generation(mode="keep") == []
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.01)
    llm.update_weights(hf.named_parameters())  # the generate loop is parked between two steps
    assert t.is_alive()
    llm.resume_generation()
    t.join(60)
    assert "err" not in box, box.get("err")
    assert [(o.stop_reason, len(o.token_ids)) for o in box["out"]] == [("completed", 30)] * 2
    _check_matches_hf(llm, hf)  # new requests run on the new weights


def test_update_while_generating_in_another_thread_is_refused(dense):
    _, path = dense
    llm = LLM(path, **KW)
    slow = _Slow()
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logits_processors=[slow])
    t, box = _in_thread(llm.generate_tokens, PROMPTS[0], params)
    _wait_reached(slow, t, box)
    with pytest.raises(RuntimeError, match="pause_generation"):
        llm.update_weights([])
    with pytest.raises(RuntimeError, match="pause_generation"):
        llm.sleep()
    llm.abort_all_requests()
    t.join(60)
    assert box["out"].stop_reason == "aborted"
    llm.resume_generation()


def test_update_weights_from_disk(dense, tmp_path):
    from safetensors.torch import save_file

    _, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    before = llm.generate_tokens(PROMPTS, GREEDY)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "step1", safe_serialization=True, max_shard_size="100KB")  # sharded
    assert llm.update_weights_from_disk(str(tmp_path / "step1"))
    _check_matches_hf(llm, hf)
    # a checkpoint with one tensor of the wrong shape: refused from the headers, nothing written
    bad = {n: t.detach().clone() for n, t in _fresh_hf(path).named_parameters()}
    bad["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 63)
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight"):
        llm.update_weights_from_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="safetensors"):
        llm.update_weights_from_disk(str(tmp_path / "nothing_here"))
    _check_matches_hf(llm, hf)  # still the step-1 weights
    llm.update_weights_from_disk(path)  # back to the original checkpoint
    after = llm.generate_tokens(PROMPTS, GREEDY)
    assert [(o.token_ids, o.logprobs) for o in after] == [(o.token_ids, o.logprobs) for o in before]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_weights_from_distributed_broadcast(dense):
    """The trainer (rank 0 of its own gloo group, in a thread here) broadcasts; the engine receives and writes."""
    from turnout.worker.weight_broadcast import broadcast_weights, stateless_group

    _, path = dense
    hf = _fresh_hf(path)
    llm = LLM(path, **KW)
    port = free_port()
    trainer, tbox = _in_thread(stateless_group, "127.0.0.1", port, 0, 2, "gloo")
    assert llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2) == [1]
    trainer.join(30)
    group = tbox["out"]
    for _ in range(2):
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
        named = list(hf.named_parameters())
        sender, sbox = _in_thread(broadcast_weights, group, named)
        llm.update_weights_from_distributed([n for n, _ in named], [t.dtype for _, t in named],
                                            [tuple(t.shape) for _, t in named])
        sender.join(30)
        assert "err" not in sbox, sbox.get("err")
        _check_matches_hf(llm, hf)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):  # checked before anything is received
        llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [(65,)])
    with pytest.raises(ValueError, match="dtypes"):
        llm.update_weights_from_distributed(["model.norm.weight"], ["float33"], [(64,)])
    with pytest.raises(ValueError, match="rank_offset"):
        llm.init_weight_update_group("127.0.0.1", port, rank_offset=0, world_size=2)
    _check_matches_hf(llm, hf)


def test_example_rl_loop_runs():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "rl_loop", Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--steps", "2"]) <= 1e-5  # the example's own rollout/trainer mismatch


def test_update_weights_from_ipc_buckets_from_another_process(dense):
    import multiprocessing as mp
    import pickle

    from ipc_trainer import perturbed, trainer_main

    _, path = dense
    llm = LLM(path, **KW)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=trainer_main, args=(path, 11, 3, theirs), daemon=True)
    proc.start()
    try:
        n = 0
        while msg := mine.recv_bytes():
            assert llm.update_weights_from_ipc(pickle.loads(msg))
            mine.send("done")
            n += 1
        assert n == 3
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    _check_matches_hf(llm, perturbed(path, 11))
    from turnout.worker.weight_ipc import make_bucket

    _, bad = make_bucket([("model.norm.weight", torch.zeros(63))])
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        llm.update_weights_from_ipc(bad)
    with pytest.raises(ValueError, match="buckets"):
        llm.update_weights_from_ipc([bad, bad])
