"""Hardware ceilings measured in the same run, and the bytes / FLOPs a model step must move.

The benchmarks (``turnout bench``, ``benchmarks/*.py``) print achieved GB/s and TFLOP/s beside tokens/s,
and the ratio to the ceilings measured here on the same machine in the same process: a copy's bandwidth
(bytes read + written) and a large GEMM's FLOP rate.

Model accounting (``ModelGeometry``): a decode step reads every weight once (for MoE, the experts the
step's tokens touch, in expectation) plus the KV of every cached token it attends to; it does
2 x (active matmul parameters) FLOPs per token, 2 x lm_head per sampled token, and 4 x heads x head_dim
FLOPs per (query, key) pair of attention, per layer.
"""

from __future__ import annotations

import platform as _platform
import time
from dataclasses import asdict, dataclass

import torch


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timeit(fn, device, iters: int) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device, nbytes: int = 1 << 28, iters: int = 10) -> float:
    """Achieved GB/s of a large device-to-device copy (bytes read + written)."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dt = _timeit(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / dt / 1e9


def gemm_tflops(device, dtype, n: int = 4096, iters: int = 10) -> float:
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    dt = _timeit(lambda: a @ b, device, iters)
    return 2 * n**3 / dt / 1e12


def measure_ceilings(device, dtype=None) -> dict:
    """The copy bandwidth and GEMM rate of this device. On a GPU: a 2 GiB copy and an 8192^3 GEMM in
    bf16 (the weights' dtype for half types); on CPU small sizes in fp32 so that tests stay fast."""
    device = torch.device(device)
    if device.type == "cuda":
        gdtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        nbytes, n, iters = 2 << 30, 8192, 10
    else:
        gdtype, nbytes, n, iters = torch.float32, 1 << 26, 512, 3
    out = {"copy_GB_s": copy_bandwidth(device, nbytes, iters), "copy_bytes": nbytes,
           "gemm_TFLOP_s": gemm_tflops(device, gdtype, n, iters), "gemm_n": n,
           "gemm_dtype": str(gdtype).replace("torch.", "")}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def machine() -> dict:
    info = {"host": _platform.node(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda or torch.version.hip
    return info


@dataclass
class ModelGeometry:
    """What one step of a model reads and computes, from its parameters and its config."""

    body_bytes: int  # matmul weights every token passes through (attention, dense MLP, norms, router)
    expert_bytes: int  # routed experts (MoE), all of them
    lm_head_bytes: int  # the output projection (the embedding when tied)
    embed_bytes: int  # the input embedding table when not tied (only B rows are read a step)
    body_params: int
    expert_params: int
    lm_head_params: int
    embed_params: int
    num_experts: int
    experts_per_token: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int  # K and V of one token, all layers

    @property
    def total_bytes(self) -> int:
        return self.body_bytes + self.expert_bytes + self.lm_head_bytes + self.embed_bytes

    @property
    def total_params(self) -> int:
        return self.body_params + self.expert_params + self.lm_head_params + self.embed_params

    def expert_fraction_touched(self, num_tokens: float) -> float:
        """Expected fraction of experts a step of ``num_tokens`` tokens reads (uniform routing)."""
        if not self.num_experts or not self.expert_bytes:
            return 0.0
        p = min(1.0, self.experts_per_token / self.num_experts)
        return 1.0 - (1.0 - p) ** max(num_tokens, 0.0)

    def weight_bytes_per_step(self, num_tokens: float) -> float:
        return self.body_bytes + self.lm_head_bytes + self.expert_bytes * self.expert_fraction_touched(num_tokens)

    @property
    def active_matmul_params(self) -> float:
        """Parameters a token multiplies through below the lm_head (MoE: its k experts of E)."""
        frac = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return self.body_params + self.expert_params * frac

    def flops(self, num_tokens: float, num_sampled: float, attn_pairs: float) -> float:
        """FLOPs of a step (or a sum of steps): ``num_tokens`` through the body, ``num_sampled`` through
        the lm_head, ``attn_pairs`` (query, key) pairs of attention per layer."""
        return (2.0 * self.active_matmul_params * num_tokens + 2.0 * self.lm_head_params * num_sampled
                + 4.0 * self.num_layers * self.num_heads * self.head_dim * attn_pairs)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"], d["total_params"] = self.total_bytes, self.total_params
        return d


def model_geometry(model, hf_config, kv_dtype: torch.dtype) -> ModelGeometry:
    """Classify a model's parameters by name: embedding, lm_head, routed experts, the rest.

    Tied embeddings (one tensor) count as the lm_head: every step reads all of it there."""
    from turnout.worker.kv_sizing import kv_geometry

    groups = {"embed": [0, 0], "lm_head": [0, 0], "experts": [0, 0], "body": [0, 0]}
    seen = set()
    for name, p in model.named_parameters():
        key = (p.data_ptr(), p.numel()) if p.device.type != "meta" else id(p)
        if key in seen:
            continue
        seen.add(key)
        if name.startswith("mtp."):  # multi-token-prediction layers: kept for drafting, not read by a step
            continue
        if "lm_head" in name:
            g = "lm_head"
        elif "embed_tokens" in name or name.endswith("wte.weight") or "embeddings" in name:
            g = "embed"
        elif "experts" in name and "shared_expert" not in name:
            g = "experts"
        else:
            g = "body"
        groups[g][0] += p.numel() * p.element_size()
        groups[g][1] += p.numel()
    if groups["lm_head"][1] == 0:  # tied: the embedding is the output projection
        groups["lm_head"], groups["embed"] = groups["embed"], [0, 0]
    layers, kv_heads, head_dim = kv_geometry(hf_config)
    kv_elem = torch.empty((), dtype=kv_dtype).element_size()
    num_experts = int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None)
                      or getattr(hf_config, "num_local_experts", None) or 0)
    topk = int(getattr(hf_config, "num_experts_per_tok", None) or 0)
    return ModelGeometry(
        body_bytes=groups["body"][0], expert_bytes=groups["experts"][0], lm_head_bytes=groups["lm_head"][0],
        embed_bytes=groups["embed"][0], body_params=groups["body"][1], expert_params=groups["experts"][1],
        lm_head_params=groups["lm_head"][1], embed_params=groups["embed"][1], num_experts=num_experts,
        experts_per_token=topk, num_layers=layers, num_heads=hf_config.num_attention_heads,
        num_kv_heads=kv_heads, head_dim=head_dim, kv_bytes_per_token=_kv_bytes_per_token(model, kv_dtype) or
        2 * layers * kv_heads * head_dim * kv_elem)


def _kv_bytes_per_token(model, kv_dtype: torch.dtype) -> int | None:
    """Bytes a token keeps in every layer's cache where the model lists its cache specs (latent attention: one
    vector per token, not k and v per head); None otherwise."""
    if not callable(getattr(model, "kv_specs", None)):
        return None
    specs = model.kv_specs(str(kv_dtype).replace("torch.", ""))
    return sum(s.bytes_per_token for s in specs if s.per_token)


def prefill_attn_pairs(prompt_len: int, cached: int = 0) -> int:
    """(query, key) pairs of a causal prefill of ``prompt_len`` tokens after ``cached`` cached ones."""
    n = prompt_len - cached
    return n * cached + n * (n + 1) // 2


def decode_attn_pairs(prompt_len: int, output_len: int) -> int:
    """Pairs of the output_len - 1 decode steps of one sequence (the first token comes from prefill):
    step k attends to prompt_len + k tokens."""
    steps = max(output_len - 1, 0)
    return steps * prompt_len + steps * (steps + 1) // 2
