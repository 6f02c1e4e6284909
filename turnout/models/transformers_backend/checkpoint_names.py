"""Checkpoint tensor names -> the transformers model's parameter names.

transformers 5 renames some modules of older checkpoints (GPT-NeoX's ``embed_out`` is ``lm_head``) and stacks
per-expert MoE tensors into one parameter; its conversion mapping (``get_model_conversion_mapping``) says how, and
its ``save_pretrained`` writes the old layout back. Renamings are applied name by name, so a checkpoint in either
layout loads. Of the tensor conversions, the MoE one is done here, tensor by tensor: a converter that stacks
per-expert tensors (``MergeModulelist(dim=0)``), optionally concatenating several of them (gate and up,
``Concatenate(dim=1)``), writes expert e's part j into rows [j R, (j + 1) R) of slice e of the stacked parameter,
with no stacked copy made (a stack split over ranks, experts.py, takes this rank's part through its
``load_expert``). Any other conversion is refused naming the tensor.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

import torch

logger = logging.getLogger(__name__)

STACKING_OPS = (("MergeModulelist",), ("MergeModulelist", "Concatenate"))


class CheckpointNames:
    """``rename(name) -> (model name, converter part or None)`` for one transformers model."""

    def __init__(self, hf_model):
        self.renamings, self.converters = [], []
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            transforms = get_model_conversion_mapping(hf_model)
        except (ImportError, AttributeError, TypeError) as e:  # another layout of these helpers: names as they are
            logger.debug("no checkpoint conversion mapping (%s): names taken as they are", e)
            return
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(self, name: str) -> tuple[str, tuple | None]:
        """(the model's name, None) or, for a tensor a converter takes, (the stacked parameter's name, (converter,
        expert index, part index, number of parts))."""
        for r in self.renamings:
            name, _ = r.rename_source_key(name)
        for conv in self.converters:
            new, pattern = conv.rename_source_key(name)
            if pattern is None:
                continue
            ops = tuple(type(op).__name__ for op in getattr(conv, "operations", ()))
            dims = tuple(getattr(op, "dim", None) for op in getattr(conv, "operations", ()))
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
            if ops not in STACKING_OPS or dims != (0, 1)[:len(ops)] or expert is None or not expert.groups():
                raise ValueError(f"checkpoint tensor {name!r}: transformers converts it into {new!r} with "
                                 f"{'/'.join(ops) or 'a conversion'}, which turnout's transformers backend does not do")
            return new, (int(expert.group(1)), conv.source_patterns.index(pattern), len(conv.source_patterns))
        return name, None


def renamed(weights: Iterable[tuple[str, torch.Tensor]], names: CheckpointNames, params: dict,
            buffers: dict) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` under the model's names, for ``turnout.models.weight_map.load_weights``:

    - a name already one of ``params`` or ``buffers`` is kept (a weight update from a transformers 5 trainer);
    - a persistent buffer's tensor (a learned activation constant) is copied into it here, not passed on;
    - per-expert tensors are written into their stacked parameter here; each stacked parameter is passed on
      once at the end (itself: the walk then counts it loaded), after checking every expert and part came.
    """
    stacked: dict[str, set] = {}
    for name, tensor in weights:
        new, part = (name, None) if name in params or name in buffers else names.rename(name)
        if part is not None:
            expert, j, parts = part
            param = params.get(new)
            if param is not None and hasattr(param, "load_expert"):  # this rank's part of a split stack (experts.py)
                with torch.no_grad():
                    param.load_expert(param, tensor, expert, j, parts)
                stacked.setdefault(new, set()).add((expert, j, parts))
                continue
            if param is None or param.dim() != 3 or param.shape[1] % parts or expert >= param.shape[0]:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: no stacked parameter {new!r} "
                                 f"takes expert {expert}")
            rows = param.shape[1] // parts
            target = param.data[expert, j * rows:(j + 1) * rows]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} -> {new!r}[{expert}] part {j}: "
                                 f"expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            stacked.setdefault(new, set()).add((expert, j, parts))
            continue
        if new in buffers and new not in params:
            buf = buffers[new]
            if tuple(buf.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} -> buffer {new!r} "
                                 f"{tuple(buf.shape)}: shapes differ")
            with torch.no_grad():
                buf.copy_(tensor)
            continue
        yield new, tensor
    for new, seen in stacked.items():
        param = params[new]
        parts = next(iter(seen))[2]
        experts = getattr(param, "num_experts", param.shape[0])  # all of them, whichever this rank holds
        missing = [(e, j) for e in range(experts) for j in range(parts) if (e, j, parts) not in seen]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} expert tensor(s) of {new!r} (expert, part): "
                             f"{missing[:8]}")
        yield new, param.data
