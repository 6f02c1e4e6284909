"""turnout as verl's rollout, tested with verl's own classes (verl 0.9 installed beside turnout; .ci/run builds
that environment). Skips where verl is not installed; wherever it is, every test runs and fails loudly.

- verl's registries, after ``import verl`` (which loads the ``verl.plugins`` entry point), hand out turnout's
  classes for ``rollout.name=turnout``.
- Every method verl 0.9 calls on its rollout server, its replica and its BaseRollout exists here with verl's
  whole signature (every parameter: name, kind, default), read from verl's classes (its vLLM server class from
  its source where vLLM is not installed: the module imports vLLM at the top).
- A real loop over Ray on the CPU (tiny float32 Qwen3): verl's replica registry launches a turnout replica in
  verl's colocated mode (verl's CheckpointEngineWorker actors building turnout's BaseRollout through verl's
  ``get_rollout_class``); verl's ``LLMServerClient`` and load balancer generate through it; the logprobs are
  HF's on the same weights within 1e-5; a weight update through verl's checkpoint-engine worker, and one
  through verl's own ``BucketedWeightSender``, make them the new weights' HF logprobs; sleep / wake, abort
  with and without ``reject_request``, resume and drain behave as verl's vLLM server does.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import os
import pathlib
import sys
import time

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (docs/architecture.md, 'turnout as verl's rollout': the tested environment)",
                allow_module_level=True)
import transformers  # noqa: E402
import verl  # noqa: E402,F401 - installed, so it must import (and load the verl.plugins entry points)
from verl.workers.rollout.base import BaseRollout, get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput  # noqa: E402

from turnout.integrations.verl import rollout as plugin  # noqa: E402
from turnout.integrations.verl.server import TurnoutServer  # noqa: E402

VERL_ROLLOUT = pathlib.Path(importlib.util.find_spec("verl.workers.rollout").submodule_search_locations[0])
VOCAB = 96
PROMPTS = [[3, 17, 42, 8, 91, 5, 60], [11, 2, 77, 30], list(range(50, 69))]

# what verl 0.9 calls on its rollout server actor (its replicas, its BaseRollout, its LLMServerClient)
SERVER_METHODS = ("__init__", "generate", "wake_up", "sleep", "clear_kv_cache", "release_kv_cache", "resume_kv_cache",
                  "abort_all_requests", "abort_request", "resume_generation", "resume_engine_generation",
                  "open_submission_gate", "wait_for_requests_to_drain", "collective_rpc", "get_server_address",
                  "get_master_address", "get_rollout_config", "launch_server", "set_global_steps", "start_profile",
                  "stop_profile", "set_pd_peer")


def test_verls_registries_hand_out_turnouts_classes():
    """``import verl`` ran turnout's entry point (nothing in this test registered it)."""
    assert sys.modules["turnout.integrations.verl.plugin"].REGISTERED == {"rollout": None, "replica": None}
    assert get_rollout_class("turnout", "async") is plugin.TurnoutRollout
    assert RolloutReplicaRegistry.get("turnout") is plugin.TurnoutReplica
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert get_rollout_replica_class("turnout") is plugin.TurnoutReplica
    assert issubclass(plugin.TurnoutRollout, BaseRollout) and not plugin.TurnoutRollout.__abstractmethods__
    assert issubclass(plugin.TurnoutReplica, RolloutReplica) and not plugin.TurnoutReplica.__abstractmethods__


def test_a_renamed_verl_registry_disables_that_entry_with_a_warning(monkeypatch, caplog):
    """verl moving a registry turnout uses (its rollout registry is a module-private dict) costs that entry,
    said once, never an import error; the other registry still takes turnout."""
    from verl.workers.rollout import base

    from turnout.integrations.verl import register

    monkeypatch.delattr(base, "_ROLLOUT_REGISTRY")
    with caplog.at_level("WARNING", logger="turnout.integrations.verl"):
        status = register()
    assert status["replica"] is None and "_ROLLOUT_REGISTRY is gone" in status["rollout"]
    assert "the rollout registry could not take turnout" in caplog.text


def test_rollout_config_to_engine_options_and_refusals_name_the_field():
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    from turnout.integrations.verl.config import check_supported, engine_options

    def cfg(**kw):
        return RolloutConfig(name="turnout", tensor_model_parallel_size=1, **kw)

    opts = engine_options(cfg(dtype="float32", max_model_len=512, seed=3, full_determinism=True,
                              engine_kwargs={"turnout": {"kv_cache_memory": 1 << 20}}), 2, "")
    assert opts["device"] == "cpu" and opts["seed"] == 5 and opts["batch_invariant"] is True
    assert opts["dtype"] == "float32" and opts["max_model_len"] == 512 and opts["kv_cache_memory"] == 1 << 20
    check_supported(cfg())
    for config, field in [(cfg(data_parallel_size=2), "rollout.data_parallel_size"),
                          (cfg(logprobs_mode="raw_logprobs"), "rollout.logprobs_mode"),
                          (cfg(checkpoint_engine=CheckpointEngineConfig(backend="delta_sharded")),
                           "rollout.checkpoint_engine.backend")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            check_supported(config)


# ---- signatures -------------------------------------------------------------------------------------
def _params(fn):
    """[(name, kind, default repr)] of every parameter, from a live function."""
    sig = inspect.signature(inspect.unwrap(fn))
    return [(p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in sig.parameters.values()]


def _ast_params(path: pathlib.Path, cls: str) -> dict:
    """The same, for every method of a class in verl's source (its vLLM modules import vLLM at the top)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for f in node.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = f.args
        pos = a.posonlyargs + a.args
        first_default = len(pos) - len(a.defaults)
        ps = [(p.arg, "POSITIONAL_OR_KEYWORD",
               repr(ast.literal_eval(a.defaults[i - first_default])) if i >= first_default else None)
              for i, p in enumerate(pos)]
        if a.vararg:
            ps.append((a.vararg.arg, "VAR_POSITIONAL", None))
        ps += [(p.arg, "KEYWORD_ONLY", None if d is None else repr(ast.literal_eval(d)))
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
        if a.kwarg:
            ps.append((a.kwarg.arg, "VAR_KEYWORD", None))
        out[f.name] = (ps, isinstance(f, ast.AsyncFunctionDef))
    return out


def _verl_class_methods(module: str, cls: str, path: pathlib.Path) -> dict:
    try:
        klass = getattr(importlib.import_module(module), cls)
    except (ImportError, ValueError):  # verl's vLLM package without vLLM raises ValueError at import
        return _ast_params(path, cls)
    return {n: (_params(f), inspect.iscoroutinefunction(inspect.unwrap(f)))
            for n, f in vars(klass).items() if inspect.isfunction(f)}


def test_server_has_every_method_verl_calls_with_verls_signature():
    theirs = _verl_class_methods("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer",
                                 VERL_ROLLOUT / "vllm_rollout" / "vllm_async_server.py")
    for name in SERVER_METHODS:
        params, is_async = theirs[name]
        ours = getattr(TurnoutServer, name)
        assert _params(ours) == params, name
        assert inspect.iscoroutinefunction(ours) == is_async, name


def test_rollout_and_replica_have_verls_signatures():
    for name in (*BaseRollout.__abstractmethods__, "generate_sequences"):
        base, ours = _params(getattr(BaseRollout, name)), _params(getattr(plugin.TurnoutRollout, name))
        assert [p for p in ours if p[0] in {b[0] for b in base}] == base, name  # verl's, in verl's order
        assert all(p[2] is not None for p in ours if p not in base), name  # anything more is optional
        assert inspect.iscoroutinefunction(getattr(plugin.TurnoutRollout, name)) == \
            inspect.iscoroutinefunction(getattr(BaseRollout, name)), name
    # the keyword arguments verl's workers pass (its vLLM rollout's update_weights and constructor)
    adapter = _verl_class_methods("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter",
                                  VERL_ROLLOUT / "vllm_rollout" / "vllm_rollout.py")
    ours = {p[0]: p for p in _params(plugin.TurnoutRollout.update_weights)}
    for p in adapter["update_weights"][0]:
        assert ours[p[0]] == p, p
    assert _params(plugin.TurnoutRollout.__init__) == adapter["__init__"][0]
    for p in ("peft_config", "base_sync_done"):  # verl's hybrid worker passes them by name
        assert p in ours
    for name, fn in vars(RolloutReplica).items():
        if inspect.isfunction(fn) and hasattr(plugin.TurnoutReplica, name):
            assert _params(getattr(plugin.TurnoutReplica, name)) == _params(fn), name


# ---- a real loop over Ray on the CPU ------------------------------------------------------------------
def _config():
    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=4096, tie_word_embeddings=True)


def _randomised(seed):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=g))
    return hf.eval()


@torch.no_grad()
def _hf_logprobs(hf, prompt, tokens):
    lp = hf(torch.tensor([list(prompt) + list(tokens)])).logits[0].float().log_softmax(-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _worst(hf, prompts, outs):
    worst = 0.0
    for p, o in zip(prompts, outs):
        assert o.token_ids and len(o.log_probs) == len(o.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(o.log_probs, _hf_logprobs(hf, p, o.token_ids))))
    return worst


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """Ray, then verl's own start-up of a colocated rollout: its replica registry's class for "turnout", its
    resource pool and CheckpointEngineWorker actors (each building turnout's BaseRollout through verl's
    get_rollout_class), its load balancer and LLMServerClient."""
    import ray
    from omegaconf import OmegaConf
    from verl.single_controller.ray import RayResourcePool
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    path = tmp_path_factory.mktemp("verl_tiny")
    hf = _randomised(0)
    hf.save_pretrained(path, safe_serialization=True)
    t0 = time.perf_counter()
    # a shared CI box runs other memory-hungry jobs: Ray's memory monitor must not kill this test's actors
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        config = RolloutConfig(name="turnout", mode="async", tensor_model_parallel_size=1, dtype="float32", max_model_len=4096, prompt_length=64,
                               response_length=16, max_num_seqs=8, free_cache_engine=True, enable_sleep_mode=True,
                               engine_kwargs={"turnout": {"kv_cache_memory": 8 << 20}},
                               checkpoint_engine=CheckpointEngineConfig(backend="naive",
                                                                         update_weights_bucket_megabytes=1))
        model = HFModelConfig(path=str(path), load_tokenizer=False)
        replica = RolloutReplicaRegistry.get("turnout")(replica_rank=0, config=config, model_config=model,
                                                         gpus_per_node=1)
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1, name_prefix="turnout")
        asyncio.run(replica.init_colocated(pool))
        lb = get_router_handle(servers={replica.server_address: replica.server_handle})
        client = LLMServerClient(OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "turnout"}}}), lb)
        print(f"\nverl loop: Ray + colocated turnout replica up in {time.perf_counter() - t0:.1f}s")
        yield {"hf": hf, "replica": replica, "client": client, "server": replica.server_handle, "config": config,
               "model": model, "lb": lb}
    finally:
        ray.shutdown()


SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
GREEDY = {"temperature": 0.0, "logprobs": True, "max_tokens": 6, "ignore_eos": True}


async def _rollout(client, sampling, tag, prompts=PROMPTS):
    return await asyncio.gather(*(client.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=dict(sampling))
                                  for i, p in enumerate(prompts)))


def test_verls_client_generates_through_turnout_with_hfs_logprobs(loop):
    async def body():
        return await _rollout(loop["client"], {**SAMPLED, "seed": 7}, "s"), await _rollout(loop["client"], GREEDY, "g")

    sampled, greedy = asyncio.run(body())
    for o in sampled + greedy:
        assert isinstance(o, TokenOutput) and o.stop_reason == "completed"
        assert o.extra_fields["global_steps"] is None and "max_global_steps" in o.extra_fields
    assert [len(o.token_ids) for o in sampled] == [16] * 3  # the config's response_length
    worst = max(_worst(loop["hf"], PROMPTS, sampled), _worst(loop["hf"], PROMPTS, greedy))
    print(f"\nverl loop: rollout vs HF logprobs max |delta| = {worst:.2e}")
    assert worst <= 1e-5


def test_bad_requests_name_the_field(loop):
    import ray

    async def body():
        errors = []
        for prompt, sampling in [(PROMPTS[0], {"temprature": 1.0}), (PROMPTS[0], {"n": 2}),
                                 (PROMPTS[0], {"temperature": -1.0}), (PROMPTS[0], {"max_tokens": "8"}),
                                 ([5] * 4096, {}), (["a"], {})]:
            with pytest.raises(ray.exceptions.RayTaskError) as e:
                await loop["client"].generate("bad", prompt_ids=prompt, sampling_params=sampling)
            errors.append(str(e.value.cause))
        ok = await loop["client"].generate("ok", prompt_ids=PROMPTS[1], sampling_params=dict(GREEDY))
        return errors, ok

    errors, ok = asyncio.run(body())
    for err, field in zip(errors, ["sampling_params.temprature", "sampling_params.n", "temperature",
                                   "sampling_params.max_tokens", "prompt_ids", "prompt_ids"]):
        assert err.startswith(field), (field, err)
    assert ok.stop_reason == "completed" and len(ok.token_ids) == 6  # the engine is still fine


def _verls_sender():
    """verl's own BucketedWeightSender: its module needs only zmq and torch, but its package's __init__ imports
    vLLM, so it is loaded from its file. verl 0.9 has no host platform (on a CPU-only machine it assumes CUDA),
    so its device hooks (synchronize, ipc_collect, empty_cache) get the host's no-ops where no GPU is; the
    packing and the ZMQ exchange stay verl's."""
    spec = importlib.util.spec_from_file_location(
        "verl_bucketed_weight_transfer", VERL_ROLLOUT / "vllm_rollout" / "bucketed_weight_transfer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not torch.cuda.is_available():
        from types import SimpleNamespace

        mod.get_torch_device = lambda: SimpleNamespace(synchronize=torch.cpu.synchronize, empty_cache=lambda: None)
        mod.is_support_ipc = lambda: False
    return mod.BucketedWeightSender


def test_weight_updates_through_verls_senders_give_the_new_weights_logprobs(loop):
    import ray
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    from turnout.integrations.verl.buckets import zmq_handle

    client, server, hf = loop["client"], loop["server"], loop["hf"]
    new, newer = _randomised(5), _randomised(6)
    # 1. verl's checkpoint-engine worker (the colocated replica's own actor) hands the trainer's weights to
    #    turnout's BaseRollout.update_weights, as CheckpointEngineManager.update_weights does
    wg = RayWorkerGroup(worker_handles=loop["replica"].workers,
                        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker)))
    weights = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    ray.get(wg.execute_checkpoint_engine(["send_weights"], [weights]))
    t0 = time.perf_counter()
    ray.get(wg.update_weights(global_steps=3))
    took = time.perf_counter() - t0
    first = asyncio.run(_rollout(client, GREEDY, "w1"))
    assert {o.extra_fields["global_steps"] for o in first} == {3}
    assert _worst(new, PROMPTS, first) <= 1e-5 and _worst(hf, PROMPTS, first) > 1e-3

    # 2. verl's own sender, driven as verl's vLLM ServerAdapter drives it (1 MiB buckets: several of them)
    async def push():
        receive = server.collective_rpc.remote("update_weights_from_ipc", kwargs={
            "peft_config": None, "base_sync_done": True, "use_shm": True})
        handle = zmq_handle(ray.get_runtime_context().get_job_id(), 0, 0)
        await _verls_sender()(zmq_handle=handle, bucket_size_mb=1, use_shm=True).async_send_weights(
            newer.named_parameters())
        await receive
        await server.clear_kv_cache.remote()
        await server.set_global_steps.remote(4)
        return await _rollout(client, GREEDY, "w2")

    second = asyncio.run(push())
    assert {o.extra_fields["global_steps"] for o in second} == {4}
    worst = _worst(newer, PROMPTS, second)
    print(f"\nverl loop: update through CheckpointEngineWorker {took:.2f}s; after verl's sender, rollout vs HF "
          f"{worst:.2e}")
    assert worst <= 1e-5
    # a bad update is refused before any bucket is read, and the sender is not left hanging
    with pytest.raises(ray.exceptions.RayTaskError, match="peft_config"):
        ray.get(server.collective_rpc.remote("update_weights_from_ipc", kwargs={"peft_config": {"r": 8}}))
    with pytest.raises(ray.exceptions.RayTaskError, match="not one turnout"):
        ray.get(server.collective_rpc.remote("init_weight_transfer_engine", kwargs={"init_info": {}}))
    ray.get(wg.execute_checkpoint_engine(["send_weights"], [[(n, p.detach().clone()) for n, p in hf.named_parameters()]]))
    ray.get(wg.update_weights(global_steps=5))  # the original weights back for the next test
    assert _worst(hf, PROMPTS, asyncio.run(_rollout(client, GREEDY, "w3"))) <= 1e-5


async def _until_generating(server, n, min_tokens=2):
    for _ in range(3000):
        running = await server.__ray_call__.remote(
            lambda self: [len(o.outputs[0].token_ids) for o in self._running.values()])
        if len(running) >= n and min(running) >= min_tokens:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the requests did not start generating")


def test_sleep_wake_abort_reject_resume_drain_as_verls_server(loop):
    replica, client, server, hf = loop["replica"], loop["client"], loop["server"], loop["hf"]
    long = {"temperature": 1.0, "logprobs": True, "max_tokens": 3000, "ignore_eos": True}

    async def body():
        before = await _rollout(client, GREEDY, "z0")
        await replica.sleep()
        asleep = await server.__ray_call__.remote(lambda self: self.engine.is_sleeping())
        await replica.wake_up()
        after = await _rollout(client, GREEDY, "z1")
        # abort with reject_request: partial outputs; the gate rejects newcomers until resume
        tasks = [asyncio.ensure_future(client.generate(f"a-{i}", prompt_ids=p, sampling_params=dict(long)))
                 for i, p in enumerate(PROMPTS)]
        await _until_generating(server, len(PROMPTS))
        info = await replica.abort_all_requests(reject_request=True)
        partial = await asyncio.gather(*tasks)
        rejected = await client.generate("late", prompt_ids=PROMPTS[0], sampling_params=dict(GREEDY))
        await replica.resume_generation()
        # a plain abort parks newcomers until resume
        await replica.abort_all_requests()
        parked = asyncio.ensure_future(client.generate("parked", prompt_ids=PROMPTS[1], sampling_params=dict(GREEDY)))
        await asyncio.sleep(1.0)
        was_parked = not parked.done()
        await replica.resume_generation()
        parked = await parked
        # drain waits for what is in flight
        drained = asyncio.ensure_future(client.generate("d", prompt_ids=PROMPTS[2],
                                                        sampling_params={**GREEDY, "max_tokens": 200}))
        await _until_generating(server, 1, 1)
        await server.wait_for_requests_to_drain.remote()
        finished_by_drain = drained.done() or (await asyncio.wait_for(drained, 0.5)) is not None
        return before, asleep, after, info, partial, rejected, was_parked, parked, finished_by_drain, await drained

    before, asleep, after, info, partial, rejected, was_parked, parked, finished_by_drain, drained = asyncio.run(body())
    assert asleep
    assert [o.token_ids for o in after] == [o.token_ids for o in before] and _worst(hf, PROMPTS, after) <= 1e-5
    assert info["aborted_count"] == 3 and len(info["request_ids"]) == 3
    for o in partial:
        assert o.stop_reason == "aborted" and 2 <= len(o.token_ids) < 3000
    assert _worst(hf, PROMPTS, partial) <= 1e-5  # the partial tokens are real samples
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert was_parked and parked.stop_reason == "completed" and len(parked.token_ids) == 6
    assert finished_by_drain and drained.stop_reason == "completed" and len(drained.token_ids) == 200


def test_hybrid_step_as_verls_fused_worker_drives_it(loop):
    """verl's hybrid worker around a training step (engine_workers.py), through turnout's BaseRollout built by
    verl's get_rollout_class, on the same server in verl's hybrid mode: release (sleep level 2: weights
    dropped), resume(["weights"]), update_weights(the trainer's async generator, peft_config=None,
    base_sync_done=True, global_steps=7), resume(["kv_cache"]); then the checkpoint engine's order: abort,
    release_kv_cache, update, resume_kv_cache, resume_generation."""
    import ray

    replica, client, server, hf = loop["replica"], loop["client"], loop["server"], loop["hf"]
    ray.get(server.__ray_call__.remote(lambda self: setattr(self, "rollout_mode", "hybrid")))
    rollout = get_rollout_class("turnout", "async")(config=loop["config"], model_config=loop["model"],
                                                    device_mesh=None)
    new = _randomised(8)

    async def trainer_weights():
        for n, p in new.named_parameters():
            yield n, p.detach().clone()

    async def body():
        await rollout.release()
        level = await server.__ray_call__.remote(lambda self: self.engine.engine.rl.sleep_level)
        await rollout.resume(tags=["weights"])
        await rollout.update_weights(trainer_weights(), peft_config=None, base_sync_done=True, global_steps=7)
        await rollout.resume(tags=["kv_cache"])
        trained = await _rollout(client, GREEDY, "h1")
        await replica.abort_all_requests()
        await replica.release_kv_cache()
        await rollout.update_weights(hf.named_parameters(), global_steps=8)
        await replica.resume_kv_cache()
        await replica.resume_generation()
        back = await _rollout(client, GREEDY, "h2")
        errors = []
        for kwargs in ({"peft_config": {"r": 8}, "base_sync_done": True}, {"wire_format": "delta_flush"}):
            with pytest.raises(ValueError) as e:
                await rollout.update_weights(iter([]), **kwargs)
            errors.append(str(e.value))
        return level, trained, back, errors

    try:
        level, trained, back, errors = asyncio.run(body())
    finally:
        ray.get(server.__ray_call__.remote(lambda self: setattr(self, "rollout_mode", "colocated")))
    assert level == 2
    assert {o.extra_fields["global_steps"] for o in trained} == {7} and _worst(new, PROMPTS, trained) <= 1e-5
    assert {o.extra_fields["global_steps"] for o in back} == {8} and _worst(hf, PROMPTS, back) <= 1e-5
    assert errors[0].startswith("peft_config:") and errors[1].startswith("wire_format:")


def test_partial_rollout_resumes_across_an_abort_with_verls_fully_async_client(loop):
    """verl's FullyAsyncLLMServerClient (partial rollout): a request aborted mid-way is resubmitted with its
    tokens so far once generation resumes; the whole equals the uninterrupted rollout, logprobs HF's."""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    replica, server = loop["replica"], loop["server"]
    client = FullyAsyncLLMServerClient(OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "turnout"}}}),
                                       loop["lb"])
    sampling = {**GREEDY, "max_tokens": 120}

    async def body():
        whole = await loop["client"].generate("whole", prompt_ids=PROMPTS[2], sampling_params=dict(sampling))
        task = asyncio.ensure_future(client.generate("part", prompt_ids=PROMPTS[2], sampling_params=dict(sampling)))
        await _until_generating(server, 1, 5)
        info = await replica.abort_all_requests()
        await asyncio.sleep(0.5)
        await replica.resume_generation()
        return whole, info, await task

    whole, info, resumed = asyncio.run(body())
    assert info["aborted_count"] == 1
    assert resumed.stop_reason == "length" and resumed.token_ids == whole.token_ids  # the client says "length"
    assert len(resumed.log_probs) == 120 and _worst(loop["hf"], [PROMPTS[2]], [resumed]) <= 1e-5
