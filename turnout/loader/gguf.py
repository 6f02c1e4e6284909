"""GGUF files through the ``gguf`` package and transformers' own GGUF support.

transformers supplies the config (``AutoConfig.from_pretrained(dir, gguf_file=...)``), the tokenizer
with its chat template, the GGUF -> HF tensor-name map and the per-architecture tensor fix-ups (the
Llama Q/K un-permutation, MoE expert stacking). ``gguf.quants.dequantize`` turns every supported type
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ*) into float32. Unlike
``load_gguf_checkpoint(return_tensors=True)``, which builds the whole state dict first, tensors are
streamed one at a time into the model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

# GGUF tensors HF has no parameter for, that carry nothing HF's config does not already say.
HARMLESS_UNMAPPED = ("rope_freqs.weight",)


def split_path(path: str | Path) -> tuple[str, str]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GGUF file not found: {p}")
    return str(p.parent), p.name


def load_config(path: str | Path):
    from transformers import AutoConfig

    d, name = split_path(path)
    return AutoConfig.from_pretrained(d, gguf_file=name)


def load_tokenizer(path: str | Path):
    """The tokenizer embedded in the GGUF file (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    d, name = split_path(path)
    return AutoTokenizer.from_pretrained(d, gguf_file=name)


def dequantize_tensor(tensor) -> torch.Tensor:
    """A ``gguf.ReaderTensor`` -> float32 torch tensor in PyTorch (row-major, [out, in]) order."""
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.flags.writeable:  # plain F32 tensors come back as views of the read-only mmap
        arr = arr.copy()
    return torch.from_numpy(arr)


def _hf_name_map(hf_config, processor) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from transformers' map over an HF model on ``meta``."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    return get_gguf_hf_weights_map(hf_model, processor)


def iter_gguf_weights(path: str | Path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of a GGUF file, dequantised one at a time."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    reader = GGUFReader(str(path))
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())
    name_map = _hf_name_map(hf_config, processor)
    parsed = {"tensors": {}}  # where processors that merge tensors (MoE experts) accumulate them
    for t in reader.tensors:
        result = processor.process(weights=dequantize_tensor(t).numpy(), name=t.name,
                                   tensor_key_mapping=name_map, parsed_parameters=parsed)
        if result.name is None:  # consumed into ``parsed``
            continue
        if result.name not in name_map:
            if result.name in HARMLESS_UNMAPPED:
                logger.info("GGUF tensor %s has no HF counterpart; skipped (as transformers does)", t.name)
                continue
            raise ValueError(f"unexpected GGUF tensor {t.name!r} ({t.tensor_type.name}, shape "
                             f"{tuple(t.data.shape)}): no HF parameter maps to it for architecture {arch!r}")
        weights = result.weights
        yield name_map[result.name], torch.from_numpy(np.ascontiguousarray(weights))
    yield from parsed["tensors"].items()
