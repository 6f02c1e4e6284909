"""``TransformersForCausalLM``: a model turnout has no class for, run through transformers' own modeling code.

Built as every turnout model is, ``cls(hf_config, ops, plan, tp[, expert_parallel])`` under the engine's device and
dtype:

1. ``AutoModelForCausalLM.from_config`` with ``attn_implementation="turnout"`` (attention.py), its parameters on
   the meta device (build.py);
2. the base model's linear layers and RMSNorms become turnout's (build.py: the op table, fp8, tensor
   parallelism per ``base_model_tp_plan``), the stacked MoE experts go through ``moe_experts`` by transformers'
   experts interface, split per rank (experts.py), the embedding and the LM head become turnout's vocab-parallel
   layers (vocab.py), then every parameter gets storage on the device;
3. the causal LM's children are registered on this module under their own names, so ``named_parameters()`` are
   the checkpoint's tensor names (``model.layers.0.self_attn.q_proj.weight``): the loaders, dummy weights and RL
   weight updates go through ``turnout.models.weight_map`` unchanged;
4. one probe forward of two tokens records every attention call (heads, head dims, window, soft-cap, scale,
   sinks), which gives one turnout ``Attention`` layer and one KV spec per call, and refuses what the interface
   cannot carry (bidirectional attention, a position bias, layers that mix tokens another way).

``forward`` calls the base model with the step's tokens as one row and ``turnout_step`` (attention.py);
``compute_logits`` applies the head as the class's own forward does (support.py ``head_spec``).
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Iterable

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.attention import Attention
from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.models.transformers_backend import support
from turnout.models.transformers_backend.attention import IMPLEMENTATION, ProbeAttention, StepAttention, register
from turnout.models.transformers_backend.build import materialize, parameters_on_meta, replace_linears, replace_norms
from turnout.models.transformers_backend.checkpoint_names import CheckpointNames, renamed
from turnout.models.transformers_backend.experts import route_experts
from turnout.models.transformers_backend.vocab import replace_vocab
from turnout.models.weight_map import load_weights

logger = logging.getLogger(__name__)

PROBE_TOKENS = 2


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM behind turnout's model contract (turnout/models/decoder.py's)."""

    supports_tensor_parallel = True
    supports_expert_parallel = True  # where the experts go through moe_experts (experts.py); whole otherwise
    no_cuda_graphs: str | None = None  # why decode CUDA graphs cannot capture this model (the runner then runs eagerly)

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE, expert_parallel: bool = False):
        super().__init__()
        from transformers import AutoModelForCausalLM

        why = support.unsupported_reason(config)
        if why is not None:
            raise ValueError(f"architecture {_arch(config)}: cannot run through transformers' modeling code: {why}")
        self.config, self.ops, self.plan, self.tp = config, ops, plan, tp
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        register()
        hf_config = copy.deepcopy(config)  # from_config writes dtype and the attention implementation into it
        with parameters_on_meta():
            hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation=IMPLEMENTATION, dtype=dtype)
        hf.eval()
        self.head = support.head_spec(type(hf))
        base = hf.base_model
        made = replace_linears(base, ops, plan, tp, getattr(hf_config, "base_model_tp_plan", None))
        norms = replace_norms(base, ops)
        self.experts_through_op, self.experts_kept = route_experts(hf, ops, tp, expert_parallel)
        vocab = replace_vocab(hf, self.head.module, ops, plan, tp)
        for name, child in hf.named_children():
            self.add_module(name, child)  # the checkpoint's names
        materialize(self, device)
        self._hf = (hf, base, getattr(hf, self.head.module))  # a tuple: not registered a second time
        self._names = CheckpointNames(hf)
        scale_kind, scale_attr, self._scale_op = self.head.scale or (None, None, None)
        self._scale = None if scale_kind is None else getattr(hf_config if scale_kind == "config" else hf, scale_attr)
        cap = getattr(hf_config.get_text_config(), self.head.softcap_attr, None) if self.head.softcap_attr else None
        self._softcap = float(cap) if cap else None
        aliases = {n for n, _ in self.named_parameters(remove_duplicate=False)} - {n for n, _ in self.named_parameters()}
        unexpected = tuple(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or ())
        self.ignored_weights = (*(rf"^{re.escape(n)}$" for n in sorted(aliases)), *unexpected)
        self.attn_layers = nn.ModuleList()
        if device.type != "meta":  # a meta model (shapes for dummy weights under TP) runs nothing
            self._probe(base, device)
            experts = f"{self.experts_through_op} experts modules through moe_experts" if self.experts_through_op \
                else f"experts stay transformers code ({self.experts_kept})" if self.experts_kept else "no experts"
            logger.info("transformers backend: %s through transformers' modeling code; %d attention layers through "
                        "turnout's paged attention; turnout layers: %s, %d RMSNorm, vocab-parallel embedding %s, "
                        "head %s; %s; still transformers code: %s", type(hf).__name__, len(self.attn_layers),
                        ", ".join(f"{n} {k}" for k, n in sorted(made.items())) or "no linear", norms,
                        "yes" if vocab[0] else "no", "yes" if vocab[1] else "no", experts,
                        ", ".join(self.transformers_modules()))

    def _probe(self, base: nn.Module, device: torch.device) -> None:
        ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
        pos = torch.arange(PROBE_TOKENS, device=device)[None]
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()  # the probe's values must be finite; the weights are loaded afterwards
            if device.type == "cuda":  # a forward that waits for the host cannot be captured in a CUDA graph
                self.no_cuda_graphs = _host_sync(lambda: base(input_ids=ids, position_ids=pos, use_cache=False,
                                                              turnout_step=ProbeAttention()))
            probe = ProbeAttention()
            try:
                base(input_ids=ids, position_ids=pos, use_cache=False, turnout_step=probe)
            except Exception as e:  # noqa: BLE001 - whatever the modeling code raises: the model cannot run here
                if "without turnout_step" in str(e):
                    raise ValueError(f"architecture {_arch(self.config)}: cannot run through transformers' modeling "
                                     "code: its layers do not pass the model's keyword arguments down to attention, so "
                                     "turnout's step cannot reach it") from None
                raise ValueError(f"architecture {_arch(self.config)}: transformers' modeling code failed on a probe "
                                 f"forward through turnout's attention ({type(e).__name__}: {e})") from None
        layers = getattr(self.config.get_text_config(), "num_hidden_layers", None)
        if probe.refusals:
            raise ValueError(f"architecture {_arch(self.config)}: cannot run through transformers' modeling code: "
                             f"{probe.refusals[0]}")
        if not probe.calls or (layers and len(probe.calls) < layers):
            raise ValueError(f"architecture {_arch(self.config)}: cannot run through transformers' modeling code: "
                             f"{len(probe.calls)} of its {layers} layers attend through the attention interface; the "
                             "others mix tokens another way (a recurrent or convolution state turnout does not keep)")
        for call in probe.calls:
            scale = call.scale if call.scale is not None else call.head_dim ** -0.5
            self.attn_layers.append(Attention(call.num_heads, call.num_kv_heads, call.cache_head_dim, scale, self.ops,
                                              sliding_window=call.sliding_window, logit_softcap=call.logit_softcap,
                                              tp=self.tp))

    def transformers_modules(self) -> list[str]:
        """The classes of transformers code that run in the forward (everything but turnout's layers)."""
        names = {type(m).__name__ for m in self.modules()
                 if not type(m).__module__.startswith("turnout.") and not isinstance(m, (nn.ModuleList, nn.ModuleDict))
                 and "turnout_shard" not in m.__dict__}  # experts computed by moe_experts (experts.py)
        return sorted(names)

    def weight_bytes(self) -> dict[str, int]:
        """This rank's parameter bytes: the routed experts' stacks, the embedding and head, the rest (each
        parameter once, however many modules hold it)."""
        vocab = {id(p) for m in self.modules() if isinstance(m, (VocabEmbedding, LMHead)) for p in m.parameters()}
        experts = {id(p) for m in self.modules() if "turnout_shard" in m.__dict__
                   for p in (m.gate_up_proj, m.down_proj)}
        out = {"experts": 0, "vocab": 0, "other": 0}
        for p in self.parameters():
            kind = "experts" if id(p) in experts else "vocab" if id(p) in vocab else "other"
            out[kind] += p.numel() * p.element_size()
        return out

    def kv_specs(self, cache_dtype: str) -> list:
        """One KV spec per attention call of a forward, in call order (turnout/kv/spec.py)."""
        return [layer.kv_spec(cache_dtype) for layer in self.attn_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """input_ids, positions [T] int64 -> the base model's last hidden state [T, H]."""
        _, base, _ = self._hf
        step = StepAttention(meta, kv_caches, self.attn_layers)
        out = base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, turnout_step=step)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32, as the causal LM's own forward computes them."""
        logits = self._hf[2](hidden)
        if self._scale is not None:
            logits = logits * self._scale if self._scale_op == "mul" else logits / self._scale
        logits = logits.float()
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if out is not None:
            return out.copy_(logits)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (the checkpoint's names, old layout or transformers 5's) into the parameters."""
        return load_weights(self, renamed(weights, self._names, dict(self.named_parameters()),
                                          dict(self.named_buffers())))


def _host_sync(forward) -> str | None:
    """Why ``forward`` cannot be captured in a CUDA graph: the first host synchronisation it makes (torch's sync
    debug mode raises there), or None."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
    except RuntimeError as e:
        if "synchroniz" in str(e):
            return f"its forward synchronises with the host ({str(e).splitlines()[0][:120]})"
        return None  # any other failure: the probe forward that follows reports it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def _arch(config) -> str:
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    return str(archs[0])


def rank_weight_bytes(worker) -> dict[str, int]:
    """``TransformersForCausalLM.weight_bytes`` of a worker's model (``collective_rpc(rank_weight_bytes)``)."""
    return worker.runner.model.weight_bytes()
