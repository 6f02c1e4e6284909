"""GGUF files through the ``gguf`` package and transformers' own GGUF support.

transformers supplies the config (``AutoConfig.from_pretrained(dir, gguf_file=...)``), the tokenizer
with its chat template, the GGUF -> HF tensor-name map and the per-architecture tensor fix-ups (the
Llama Q/K un-permutation, MoE expert stacking). ``gguf.quants.dequantize`` turns every supported type
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ*) into float32. Unlike
``load_gguf_checkpoint(return_tensors=True)``, which builds the whole state dict first, tensors are
streamed one at a time into the model.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

# GGUF tensors HF has no parameter for, that carry nothing HF's config does not already say.
HARMLESS_UNMAPPED = ("rope_freqs.weight",)


@contextlib.contextmanager
def parse_once():
    """Within this block, transformers parses a GGUF file's metadata once, not once per use.

    Left alone, it parses every metadata field (a 49k-token vocabulary: seconds) for the config and
    again for the tokenizer, and rebuilds gguf's tensor-name table for every submodule of the model
    (~400 times for 30 layers). Both are pure functions of their arguments, so they are memoised
    here (results deep-copied, as callers may mutate them) and restored on exit. Speed only.
    """
    import gguf as gguf_pkg
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    orig_checkpoint, orig_name_map = hf_gguf.load_gguf_checkpoint, gguf_pkg.get_tensor_name_map
    checkpoints, name_maps = {}, {}

    def checkpoint(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return orig_checkpoint(path, return_tensors, *args, **kwargs)
        if str(path) not in checkpoints:
            checkpoints[str(path)] = orig_checkpoint(path, return_tensors=False)
        return copy.deepcopy(checkpoints[str(path)])

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = orig_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    hf_gguf.load_gguf_checkpoint, gguf_pkg.get_tensor_name_map = checkpoint, name_map
    try:
        yield
    finally:
        hf_gguf.load_gguf_checkpoint, gguf_pkg.get_tensor_name_map = orig_checkpoint, orig_name_map


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


def read_tensors(path: str | Path, fast: bool = True) -> tuple[str, Iterator[tuple[str, int, np.ndarray]]]:
    """(GGUF architecture, lazy iterator of (tensor name, ggml type, raw bytes or values)).

    ``fast``: transformers' header reader (``integrations.gguf.GgufHeader``, which skips over the
    tokenizer arrays; several times faster) when this transformers has it; else, or with
    ``fast=False``, ``gguf.GGUFReader`` (which parses every metadata field: seconds on a 49k vocabulary).
    """
    if fast:
        try:
            from transformers.integrations.gguf import GgufHeader
        except (ImportError, AttributeError):  # transformers < 5.x: no header reader
            GgufHeader = None
        if GgufHeader is not None:
            header = GgufHeader.from_file(str(path))
            blob = np.memmap(str(path), mode="r", dtype=np.uint8)

            def raw():
                from gguf.quants import quant_shape_to_byte_shape

                for info in header.tensors:
                    start = header.data_start + info.offset
                    data = blob[start: start + info.nbytes]
                    yield info.name, info.ggml_type, data.reshape(quant_shape_to_byte_shape(info.shape,
                                                                                            info.ggml_type))

            return header.architecture, raw()
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(path))
    return read_field(reader, "general.architecture")[0], ((t.name, int(t.tensor_type), t.data)
                                                           for t in reader.tensors)


def dequantize(data: np.ndarray, ggml_type: int) -> torch.Tensor:
    """Raw GGUF data (bytes shaped [..., row bytes], or float values) -> float32 [..., cols] tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    arr = np.ascontiguousarray(gguf_dequantize(data, GGMLQuantizationType(ggml_type)), dtype=np.float32)
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
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch, tensors = read_tensors(path)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())
    name_map = _hf_name_map(hf_config, processor)
    parsed = {"tensors": {}}  # where processors that merge tensors (MoE experts) accumulate them
    for name, ggml_type, data in tensors:
        result = processor.process(weights=dequantize(data, ggml_type).numpy(), name=name,
                                   tensor_key_mapping=name_map, parsed_parameters=parsed)
        if result.name is None:  # consumed into ``parsed``
            continue
        if result.name not in name_map:
            if result.name in HARMLESS_UNMAPPED:
                logger.info("GGUF tensor %s has no HF counterpart; skipped (as transformers does)", name)
                continue
            raise ValueError(f"unexpected GGUF tensor {name!r} (ggml type {ggml_type}, shape "
                             f"{tuple(data.shape)}): no HF parameter maps to it for architecture {arch!r}")
        yield name_map[result.name], torch.from_numpy(np.ascontiguousarray(result.weights))
    yield from parsed["tensors"].items()
