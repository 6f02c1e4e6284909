"""4-bit MoE experts on CPU: tiny random Qwen3-MoE, Qwen2-MoE and Mixtral models written as AWQ, GPTQ (with and
without desc_act) and compressed-tensors W4A16 checkpoints, experts packed per expert (tests/quant/
w4_moe_checkpoints.py), equal HF transformers holding the exact dequantised weights (logits within 1e-4 of their
range, greedy tokens identical); the experts stay 4-bit; TP=2 and EP=2 shards hold the slices of the one-rank
model's experts; what is refused, naming the tensor or the size."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import forward_logits, greedy_walk
from turnout.distributed.parallel_state import TPGroup
from turnout.layers.fusion import NO_FUSIONS
from turnout.layers.moe.experts import FusedExperts
from turnout.loader import load_model
from turnout.loader.safetensors import iter_safetensors, safetensors_files
from turnout.models.registry import get_model_class
from turnout.ops.reference.moe_w4a16 import dequantize_expert
from turnout.quant import experts_quant, linear_quant
from turnout.quant.moe_w4 import stack_names
from w4_moe_checkpoints import make_hf, write_w4_moe_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, fmt) -> (directory, HF model on the dequantised weights), each written once for the module."""
    made, models = {}, {}

    def get(family: str, fmt: str):
        if (family, fmt) not in made:
            if family not in models:
                models[family] = make_hf(family)
            d = tmp_path_factory.mktemp(f"{family}_{fmt}")
            made[family, fmt] = d, write_w4_moe_checkpoint(models[family], family, fmt, d)
        return made[family, fmt]
    return get


def _experts(model) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def dequantised_experts(mod: FusedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E_local, 2 I_local, H], down [E_local, H, I_local]) float32 of a 4-bit experts layer, in the input's
    column order."""
    cfg = mod.quant.config
    out = []
    for stack in ("gate_up_proj", "down_proj"):
        names = stack_names(cfg.fmt, stack)
        q, sz, perm = getattr(mod, names["qweight"]), getattr(mod, names["scales"]), getattr(mod, f"{stack}_perm")
        out.append(torch.stack([dequantize_expert(q[e], sz[e], cfg.group_size, None if perm is None else perm[e])
                                for e in range(q.shape[0])]))
    return out[0], out[1]


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "gptq_desc_act"), ("qwen3_moe", "ct_w4a16"),
                                        ("qwen3_moe", "awq"), ("mixtral", "gptq"),
                                        ("qwen2_moe", "ct_w4a16_asym_actorder")])
def test_w4_moe_checkpoint_equals_the_dequantised_model(family, fmt, checkpoints, ids, cpu_ops):
    d, ref = checkpoints(family, fmt)
    loaded = load_model(str(d), ops=cpu_ops, device="cpu")
    experts = _experts(loaded.model)
    assert experts and all(not hasattr(m, "gate_up_proj") and m.quant is not None for m in experts)
    names = stack_names(experts[0].quant.config.fmt, "gate_up_proj")
    assert getattr(experts[0], names["qweight"]).dtype == torch.uint8
    ours = forward_logits(loaded.model, loaded.hf_config, ids)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-4
    seq, hf_seq, margins, _ = greedy_walk(loaded, ref, ids[:8], steps=3)
    assert torch.equal(seq, hf_seq), margins


def _shard(path, config, cpu_ops, rank: int, world: int, ep: bool):
    plan = replace(NO_FUSIONS, linear_quant=linear_quant(config, None, cpu_ops),
                   experts_quant=experts_quant(config, None, cpu_ops))
    model = get_model_class(config.architectures)(config, cpu_ops, plan, TPGroup(rank, world, group=object()),
                                                  expert_parallel=ep)
    model.load_weights(iter_safetensors(safetensors_files(path)))
    return model


def test_tensor_and_expert_parallel_shards_hold_slices(checkpoints, cpu_ops):
    """TP=2: each rank's gate and up rows [r I/2, (r+1) I/2) and down columns (whole groups); EP=2: experts
    [r E/2, (r+1) E/2) whole."""
    d, _ = checkpoints("qwen3_moe", "gptq")
    whole = load_model(str(d), ops=cpu_ops, device="cpu").model
    config = whole.config
    full = [dequantised_experts(m) for m in _experts(whole)]
    inter = config.moe_intermediate_size
    for ep in (False, True):
        for rank in range(2):
            shard = _experts(_shard(d, config, cpu_ops, rank, 2, ep))
            assert len(shard) == len(full)
            for mod, (gate_up, down) in zip(shard, full):
                got_gu, got_dn = dequantised_experts(mod)
                if ep:
                    half = gate_up.shape[0] // 2
                    want_gu, want_dn = gate_up[rank * half:(rank + 1) * half], down[rank * half:(rank + 1) * half]
                else:
                    il = inter // 2
                    want_gu = torch.cat([gate_up[:, rank * il:(rank + 1) * il],
                                         gate_up[:, inter + rank * il:inter + (rank + 1) * il]], dim=1)
                    want_dn = down[:, :, rank * il:(rank + 1) * il]
                assert torch.equal(got_gu, want_gu) and torch.equal(got_dn, want_dn), (ep, rank)


def test_activation_order_splits_experts_only_whole(cpu_ops):
    """Activation order scatters down's groups over I: the experts refuse a TP split naming it; EP keeps them
    whole and builds (a whole model is refused earlier, by its row-parallel o_proj: test_w4.py)."""
    from turnout.quant.moe_w4 import W4MoeMethod
    from turnout.quant.w4_config import W4Config

    method = W4MoeMethod(W4Config("gptq", 64, True, True, 1, "GPTQ checkpoint"))
    tp = TPGroup(0, 2, group=object())
    with pytest.raises(ValueError, match="activation order .* enable_expert_parallel"):
        FusedExperts(4, 128, 128, cpu_ops, tp=tp, quant=method)
    ep = FusedExperts(4, 128, 128, cpu_ops, tp=tp, expert_parallel=True, quant=method)
    assert ep.gate_up_proj_perm.shape == (2, 128) and ep.down_proj_perm.shape == (2, 128)


def test_refusals_name_the_tensor_or_the_size(checkpoints, cpu_ops, tmp_path):
    from turnout.quant.moe_w4 import W4MoeMethod
    from turnout.quant.w4_config import W4Config

    awq = W4MoeMethod(W4Config("awq", 64, True, False, 0, "AWQ checkpoint"))
    with pytest.raises(ValueError, match=r"moe_intermediate_size 128 / tensor_parallel_size 4 = 32\) must be whole"):
        FusedExperts(4, 128, 128, cpu_ops, tp=TPGroup(0, 4, group=object()), quant=awq)
    src, _ = checkpoints("qwen3_moe", "awq")
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.down_proj.scales"
    tensors[name] = tensors[name][:, :64].contiguous()  # half the rows its packed weight has
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"{name}.*scales .* disagrees"):
        load_model(str(tmp_path), ops=cpu_ops, device="cpu")
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.experts.1.gate_proj.qweight"
    tensors[name] = tensors[name][:8].contiguous()  # a packed weight of 64 columns where the scales have 128
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}.*qweight .* disagrees"):
        load_model(str(tmp_path), ops=cpu_ops, device="cpu")


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "gptq_desc_act")])
def test_engine_greedy_equals_hf(family, fmt, checkpoints, ids):
    """Through LLM (scheduler, paged cache, sampler), with vLLM's --quantization spelling: HF's greedy tokens on the
    dequantised weights."""
    from turnout import LLM, SamplingParams

    d, ref = checkpoints(family, fmt)
    llm = LLM(str(d), device="cpu", quantization="gptq", kv_cache_memory=1 << 22)
    out = llm.generate_tokens(ids[:8].tolist(), SamplingParams(max_tokens=6, temperature=0))
    with torch.no_grad():
        want = ref.generate(ids[:8][None], max_new_tokens=6, do_sample=False)[0, 8:]
    assert list(out.token_ids) == want.tolist()


def test_dummy_weights_fill_the_4bit_experts(cpu_ops):
    """--load-format dummy with a 4-bit quantization_config (the GPU benchmark's model): finite logits."""
    from w4_checkpoints import FORMATS
    from w4_moe_checkpoints import tiny_config

    cfg = tiny_config("qwen3_moe", quantization_config=FORMATS["awq"][0])
    m = load_model(cfg, load_format="dummy", ops=cpu_ops, device="cpu").model
    experts = _experts(m)[0]
    assert experts.gate_up_proj_qweight.dtype == torch.uint8 and experts.gate_up_proj_qweight.float().std() > 50
    logits = forward_logits(m, cfg, torch.arange(6))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_triton_experts_equal_hf(checkpoints, ids):
    """The experts through the Triton grouped kernel (TRITON_INTERPRET=1 on CPU, float32: ieee dots), the rest as
    the CPU table has it: HF's logits on the dequantised weights, at a prefill and at one token."""
    from turnout.ops import Policy, resolve
    from turnout.ops.triton._tuning import interpreted
    from turnout.platforms.detect import detect_platform

    if not interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU)")
    platform = detect_platform("cpu")
    ops = resolve(platform, Policy.from_sources("moe_experts_w4a16=triton.default", env={}, platform=platform))
    assert ops.chosen("moe_experts_w4a16") == "triton.default"
    d, ref = checkpoints("qwen3_moe", "gptq_desc_act")
    loaded = load_model(str(d), ops=ops, device="cpu")
    assert _experts(loaded.model)[0].quant_ops.chosen("moe_experts_w4a16") == "triton.default"
    for n in (12, 1):
        ours = forward_logits(loaded.model, loaded.hf_config, ids[:n])
        with torch.no_grad():
            want = ref(ids[:n][None]).logits[0]
        assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-4, n


def test_tensor_order_does_not_matter(checkpoints, cpu_ops):
    """desc_act: an expert's qweight read before its g_idx (the order unknown yet) is reordered when g_idx comes;
    zero points before scales recompute the zeros: the experts equal those of the file's own order."""
    d, _ = checkpoints("qwen3_moe", "gptq_desc_act")
    whole = load_model(str(d), ops=cpu_ops, device="cpu").model
    config = whole.config
    plan = replace(NO_FUSIONS, linear_quant=linear_quant(config, None, cpu_ops),
                   experts_quant=experts_quant(config, None, cpu_ops))
    model = get_model_class(config.architectures)(config, cpu_ops, plan)
    tensors = sorted(iter_safetensors(safetensors_files(d)), key=lambda kv: kv[0].endswith(("g_idx", "scales")))
    names = [name for name, _ in tensors]
    base = "model.layers.0.mlp.experts.1.gate_proj."
    assert names.index(base + "qweight") < names.index(base + "g_idx")
    assert names.index(base + "qzeros") < names.index(base + "scales")
    model.load_weights(tensors)
    for got, want in zip(_experts(model), _experts(whole)):
        for a, b in zip(dequantised_experts(got), dequantised_experts(want)):
            assert torch.equal(a, b)
