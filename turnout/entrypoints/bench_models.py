"""Which model a benchmark runs: bundled HF configs (dummy weights), paths, hub ids; random prompts."""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
from pathlib import Path

from turnout import envs

logger = logging.getLogger("turnout.entrypoints.bench_cmd")


# ---- model names ---------------------------------------------------------------------------------
def config_roots() -> list[Path]:
    roots = []
    if envs.get().bench_configs is not None:
        roots.append(envs.get().bench_configs)
    roots.append(Path(__file__).resolve().parents[2] / "benchmarks" / "configs")
    roots.append(Path.cwd() / "benchmarks" / "configs")
    return [r for i, r in enumerate(roots) if r.is_dir() and r.resolve() not in {x.resolve() for x in roots[:i]}]


def _norm(name: str) -> str:
    name = name.lower()
    for suffix in (".json",):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.replace("_", "-").replace(".", "-")


def _config_only_dir(json_file: Path) -> str:
    """A directory holding just ``config.json`` (a copy of ``json_file``), for loaders that want one."""
    d = Path(tempfile.mkdtemp(prefix=f"turnout-bench-{json_file.stem}-"))
    shutil.copyfile(json_file, d / "config.json")
    return str(d)


def resolve_model(model: str | None) -> tuple[str | None, bool]:
    """(what to load, whether it is a bundled config with no weights). A path is used as given (a
    ``.json`` file becomes a config-only directory); otherwise a name is looked up in
    ``benchmarks/configs`` (case, '-', '_' and '.' ignored); otherwise returned unchanged (hub id)."""
    if model is None:
        return None, False
    p = Path(model).expanduser()
    if p.is_dir():
        return str(p), False
    if p.is_file():
        return (_config_only_dir(p), True) if p.suffix == ".json" else (str(p), False)
    want = _norm(p.name)
    for root in config_roots():
        for entry in sorted(root.iterdir()):
            if _norm(entry.name) != want:
                continue
            if entry.is_dir() and (entry / "config.json").is_file():
                return str(entry), True
            if entry.is_file() and entry.suffix == ".json":
                return _config_only_dir(entry), True
    known = sorted({_norm(e.name) for r in config_roots() for e in r.iterdir()})
    if not p.is_absolute() and "/" not in model and known:
        logger.info("%r is not a path nor one of benchmarks/configs (%s); passing it on", model, ", ".join(known))
    return model, False


def has_tokenizer_files(path: str | None) -> bool:
    if path is None or not Path(path).is_dir():
        return True  # the loader finds one (embedded default, GGUF, hub)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((Path(path) / n).is_file() for n in names)


class NullTokenizer:
    """For config-only models: prompts are token ids and outputs need no text. The engine handles a
    missing tokenizer itself; this stand-in only keeps the benchmarks independent of that path."""

    eos_token_id = None
    pad_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True, **kw) -> str:
        return ""

    def encode(self, text, **kw):
        raise ValueError("this model has no tokenizer: give prompts as token ids")


def bench_tokenizer(path: str | None):
    """What to pass as ``tokenizer=`` for a benchmark engine: None (the model's own) or the stand-in."""
    return None if has_tokenizer_files(path) else NullTokenizer()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


# ---- arguments -----------------------------------------------------------------------------------
