"""Loading an EAGLE-3 head (the module is turnout/models/eagle3.py) for speculative method "eagle3": its
checkpoint directory read and checked against the target, every mismatch a ValueError naming
``speculative_config.model``. Here, not beside the module, because the models import no loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from turnout.loader.safetensors import iter_safetensors, safetensors_files
from turnout.loader.source import resolve_source
from turnout.models.eagle3 import Eagle3Head, _bad, default_aux_layers
from turnout.models.weight_map import load_weights


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if any(path.glob("*.safetensors")):
        return dict(iter_safetensors(safetensors_files(path)))
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise _bad(f"{path} has no *.safetensors nor pytorch_model.bin")
    out = {}
    for b in bins:
        out.update(torch.load(b, map_location="cpu", weights_only=True))
    return out


def load_eagle3_head(model: str, target, ops, device, dtype) -> Eagle3Head:
    """The EAGLE-3 head at ``model`` (a directory or Hub id) for ``target`` (the loaded DecoderForCausalLM),
    checked against it: every mismatch is a ValueError naming ``speculative_config.model``."""
    import transformers

    try:
        path = resolve_source(model).path
    except ValueError as e:
        raise _bad(str(e)) from None
    if not path.is_dir():
        raise _bad(f"{model!r}: an EAGLE-3 head is a checkpoint directory, not a file")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("model_type", None)
    config = transformers.LlamaConfig(**raw)
    tc = target.config
    for name in ("draft_vocab_size", "hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(getattr(config, name, None), int):
            raise _bad(f"config.json lacks {name}: not an EAGLE-3 head")
    ht = getattr(config, "target_hidden_size", None) or config.hidden_size
    if ht != tc.hidden_size:
        raise _bad(f"the EAGLE-3 head's hidden_size ({ht}) differs from the target's ({tc.hidden_size})")
    if config.vocab_size != tc.vocab_size:
        raise _bad(f"the EAGLE-3 head's vocab_size ({config.vocab_size}) differs from the target's "
                   f"({tc.vocab_size})")
    n = tc.num_hidden_layers
    aux = tuple(getattr(config, "eagle_aux_hidden_state_layer_ids", None) or default_aux_layers(n))
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in aux):
        raise _bad(f"eagle_aux_hidden_state_layer_ids {list(aux)}: three layers of the target's 0..{n - 1}")
    tensors = _read_tensors(path)
    for name in ("d2t", "fc.weight", "lm_head.weight"):
        if name not in tensors:
            raise _bad(f"the EAGLE-3 checkpoint has no {name!r} tensor")
    d2t, t2d = tensors.pop("d2t").long(), tensors.pop("t2d", None)
    dv = config.draft_vocab_size
    target_ids = torch.arange(d2t.shape[0]) + d2t
    if d2t.shape != (dv,) or target_ids.min() < 0 or target_ids.max() >= tc.vocab_size:
        raise _bad(f"d2t (shape {tuple(d2t.shape)}) does not map draft_vocab_size {dv} draft ids into the target's "
                   f"{tc.vocab_size} token ids")
    if t2d is not None and (t2d.shape != (tc.vocab_size,) or int(t2d.sum()) != dv
                            or not bool(t2d.bool()[target_ids].all())):
        raise _bad(f"t2d (shape {tuple(t2d.shape)}) does not mark exactly the {dv} target ids d2t maps to")
    own = "embed_tokens.weight" in tensors
    if not own and config.hidden_size != tc.hidden_size:
        raise _bad("the EAGLE-3 head has no embed_tokens and its hidden_size differs from the target's")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(config, ops, None if own else target.model.embed_tokens, aux)
    finally:
        torch.set_default_dtype(prev)
    try:
        load_weights(head, tensors.items())
    except ValueError as e:
        raise _bad(f"the EAGLE-3 checkpoint does not fit its config: {e}") from None
    head.d2t.copy_(d2t)
    return head.eval()
