"""Checkpoint tensor names -> the transformers model's parameter names.

transformers 5 renames some modules of older checkpoints (GPT-NeoX's ``embed_out`` is ``lm_head``) and stacks
per-expert MoE tensors into one parameter; its conversion mapping (``get_model_conversion_mapping``) says how,
and its ``save_pretrained`` writes the old layout back. The renamings are applied here, name by name, so a
checkpoint in either layout loads. A tensor that needs a converter (stacked experts) is refused naming it:
the backend does not run transformers' tensor conversions yet.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

logger = logging.getLogger(__name__)


def checkpoint_renamer(hf_model) -> Callable[[str], tuple[str, bool]]:
    """name -> (the model's name for it, whether a tensor converter would be needed); identity where this
    transformers has no conversion mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(hf_model)
    except (ImportError, AttributeError, TypeError) as e:  # an older or newer layout of these helpers
        logger.debug("no checkpoint conversion mapping (%s): names taken as they are", e)
        return lambda name: (name, False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> tuple[str, bool]:
        new, pattern = rename_source_key(name, renamings, converters)
        return new, pattern is not None

    return rename


def renamed(weights: Iterable[tuple[str, torch.Tensor]], rename, params: dict) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` under the model's names; a name that is already one of ``params`` is kept as it is (a weight
    update from a transformers 5 trainer sends the new names)."""
    for name, tensor in weights:
        if name in params:
            yield name, tensor
            continue
        new, converted = rename(name)
        if converted:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: transformers converts it into "
                             f"{new!r} with a tensor conversion (e.g. per-expert tensors stacked), which turnout's "
                             "transformers backend does not do yet")
        yield new, tensor
