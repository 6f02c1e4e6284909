"""What `turnout bench serve` sends: random prompts of exact token lengths, or the rows of a JSONL file.

Random prompts are token-exact where a tokenizer is at hand (``--tokenizer``, the ``--model`` directory or
.gguf file, a Hub id already in the local cache, or the embedded default when the server serves it): the
completions endpoint gets the token ids themselves, the chat endpoint text that encodes back to exactly
``input_len`` tokens (the chat template then adds its own). Without one, prompts are random words, about
one token each; the input lengths reported are the server's ``usage.prompt_tokens`` either way.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("turnout.entrypoints.bench_serve")

# The name the server gives the embedded default model (turnout/engine/llm_engine.py).
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government number "
          "night point home water room mother area money story fact month lot right study book eye job word "
          "business issue side kind head house service friend father power hour game line end member law car "
          "city community name president team minute idea kid body information back parent face others level").split()


@dataclass
class BenchRequest:
    """One request of the run: a completions prompt (text or token ids) or chat messages."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    input_len: int | None = None  # our count; the server's usage.prompt_tokens wins when it reports one
    output_len: int = 128


# ---- tokenizer -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _load(spec: str, local_only: bool):
    from transformers import AutoTokenizer

    p = Path(spec).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        from turnout.loader.gguf import load_tokenizer

        return load_tokenizer(p)
    return AutoTokenizer.from_pretrained(str(p) if p.exists() else spec, local_files_only=local_only)


def resolve_tokenizer(tokenizer: str | None, model: str | None):
    """The tokenizer for random prompts, or None. ``tokenizer`` given: it must load (a ValueError naming
    --tokenizer otherwise); "none" means no tokenizer. Not given: the model name if it loads from local
    files, or the embedded default's when the server serves it; else None (a warning says so)."""
    if tokenizer is not None:
        if tokenizer.lower() == "none":
            return None
        try:
            return _load(tokenizer, False)
        except Exception as e:  # noqa: BLE001 - any loader failure is the user's path or id
            raise ValueError(f"--tokenizer: cannot load {tokenizer!r} ({type(e).__name__}: {e})") from None
    if model == DEFAULT_SERVED_NAME:
        from turnout.loader.source import default_model_path

        try:
            return _load(default_model_path(), True)
        except Exception as e:  # noqa: BLE001
            logger.warning("the embedded default's tokenizer did not load (%s); prompts are random words", e)
            return None
    if model:
        try:
            return _load(model, True)
        except Exception:  # noqa: BLE001 - a served name that is no local path nor cached Hub id
            pass
    logger.warning("no tokenizer for %r (give --tokenizer PATH_OR_ID): random prompts are random words, "
                   "about one token each; input lengths come from the server's usage", model)
    return None


# ---- random dataset ------------------------------------------------------------------------------
def sample_lens(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    """``n`` lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)] (at least 1), as vLLM's random set."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _exact_ids(tok, rng: random.Random, length: int, pool: list[int]) -> tuple[list[int], str]:
    """Random ids whose decoded text encodes back to ``length`` tokens (re-encoding merges or splits a few:
    trim or extend and try again; a few rounds settle it)."""
    ids = [rng.choice(pool) for _ in range(length)]
    for _ in range(8):
        text = tok.decode(ids)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return ids, text
        ids = ids[:length] + [rng.choice(pool) for _ in range(length - len(ids))]
    return ids, tok.decode(ids)  # the ids are exact; the text may be off by a token


def random_requests(n: int, input_len: int, output_len: int, ratio: float, seed: int, tokenizer,
                    endpoint: str) -> list[BenchRequest]:
    """``n`` prompts (lengths as :func:`sample_lens`; bench_serve._validate has checked the flags)."""
    rng = random.Random(seed)
    in_lens, out_lens = sample_lens(rng, input_len, ratio, n), sample_lens(rng, output_len, ratio, n)
    pool = None
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pool = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for L, O in zip(in_lens, out_lens):
        if pool is None:
            text = " ".join(rng.choice(_WORDS) for _ in range(L))
            ids = None
        else:
            ids, text = _exact_ids(tokenizer, rng, L, pool)
        if endpoint == "chat":
            out.append(BenchRequest(messages=[{"role": "user", "content": text}], input_len=None, output_len=O))
        else:
            out.append(BenchRequest(prompt=ids if ids is not None else text, input_len=L if ids else None,
                                    output_len=O))
    return out


# ---- JSONL dataset -------------------------------------------------------------------------------
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _row(obj, where: str, default_out: int) -> BenchRequest:
    """One line: {"prompt": ...} or {"messages": [...]} or ShareGPT's {"conversations": [{"from", "value"}]};
    optional "max_tokens" (or "output_len"). A conversation is cut after its last user turn."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    out_len = obj.get("max_tokens", obj.get("output_len", default_out))
    if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {out_len!r}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: prompt must be a string")
        return BenchRequest(prompt=obj["prompt"], output_len=out_len)
    msgs = obj.get("messages")
    if msgs is None and "conversations" in obj:
        conv = obj["conversations"]
        if not isinstance(conv, list):
            raise ValueError(f"{where}: conversations must be a list")
        msgs = [{"role": _ROLES.get(str(t.get("from", "")).lower(), "user"), "content": t.get("value", "")}
                for t in conv if isinstance(t, dict)]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: needs a \"prompt\" string, or a non-empty \"messages\" or \"conversations\" list")
    last_user = max((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"), default=None)
    if last_user is None:
        raise ValueError(f"{where}: the conversation has no user turn")
    return BenchRequest(messages=msgs[: last_user + 1], output_len=out_len)


def jsonl_requests(path: str | None, n: int | None, default_out: int, seed: int, shuffle: bool,
                   endpoint: str) -> list[BenchRequest]:
    if not path:
        raise ValueError("--dataset-path: required with --dataset jsonl")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset-path: no such file {path!r}")
    rows = []
    for k, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--dataset-path: {path}:{k}: not JSON ({e})") from None
        rows.append(_row(obj, f"--dataset-path: {path}:{k}", default_out))
    if not rows:
        raise ValueError(f"--dataset-path: {path} has no rows")
    if shuffle:
        random.Random(seed).shuffle(rows)
    n = len(rows) if n is None else n
    picked = [rows[i % len(rows)] for i in range(n)]  # fewer rows than --num-prompts: cycle
    for r in picked:  # each endpoint takes the other shape too
        if endpoint == "chat" and r.messages is None:
            r.messages, r.prompt = [{"role": "user", "content": r.prompt}], None
        elif endpoint == "completions" and r.prompt is None:
            r.prompt = "\n".join(str(m.get("content", "")) for m in r.messages)
    return [BenchRequest(prompt=r.prompt, messages=r.messages, output_len=r.output_len) for r in picked]
