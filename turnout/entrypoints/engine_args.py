"""The engine flags of `turnout serve / generate / bench`, made from EngineConfig's fields (turnout/config.py:
each field's help, flag, alias and choices), so the three commands and ``LLM(**options)`` cannot drift: a
new field is a new flag of each. A command that spells a field its own way (serve's positional MODEL,
generate's sampling --seed) leaves it out with ``exclude`` and adds its own flag.

Also vLLM's flags that change nothing in turnout (turnout/config.py): accepted with an INFO line, so
a vLLM command line runs as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from turnout.config import VLLM_NOOPS, EngineConfig, note_vllm_noop


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def cli_fields(exclude=()) -> list[dataclasses.Field]:
    """EngineConfig's fields that are flags (all but those set by turnout itself and ``exclude``)."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True) and f.name not in exclude]


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_engine_args(p, *, exclude=(), defaults=None, helps=None, groups=None) -> None:
    """One flag per EngineConfig field (dest: the field's name). ``defaults`` / ``helps``: a command's own
    default or help text for a field; ``groups``: serve's argument group for each field's metadata group."""
    defaults, helps, groups = defaults or {}, helps or {}, groups or {}
    hints = typing.get_type_hints(EngineConfig)
    for f in cli_fields(exclude):
        meta = f.metadata  # empty for a field declared without option(): a plain flag (tests/test_engine_options.py
        # fails on its missing help)
        target = groups.get(meta.get("group", "engine"), p)
        names = [meta["short"], _flag(f)] if meta.get("short") else [_flag(f)]
        kw = {"dest": f.name, "default": defaults.get(f.name, f.default), "help": helps.get(f.name, meta.get("help"))}
        kind = _base_type(hints[f.name])
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if meta.get("choices"):
                kw["choices"] = list(meta["choices"])
            if meta.get("metavar"):
                kw["metavar"] = meta["metavar"]
        target.add_argument(*names, **kw)


def engine_kwargs(args, exclude=()) -> dict:
    """The EngineConfig / LLM keyword arguments the flags of add_engine_args set (a field's ``none_as``
    value becomes None: --fair-share-seqs 0 is no cap)."""
    out = {}
    for f in cli_fields(exclude):
        value = getattr(args, f.name)
        none_as = f.metadata.get("none_as")
        out[f.name] = None if none_as is not None and value == none_as else value
    return out


def add_vllm_noop_args(p, server: bool = False) -> None:
    """vLLM's flags that change nothing here (turnout/config.py VLLM_NOOPS); ``server``: `serve`'s too."""
    for name, noop in VLLM_NOOPS.items():
        if noop.server and not server:
            continue
        flag = "--" + name.replace("_", "-")
        text = f"accepted from vLLM, no effect: {noop.why}"
        if noop.metavar:
            p.add_argument(flag, dest=name, default=None, metavar=noop.metavar, help=text)
        elif noop.refusal:  # --no-FLAG asks for what turnout does not do: refused by name, not "unrecognized"
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, dest=name, action="store_const", const=True, default=None, help=text)


def note_vllm_noop_args(args) -> None:
    """An INFO line for each vLLM no-op flag given; a ValueError naming the flag for a value turnout cannot
    honour (--no-enable-chunked-prefill, a --generation-config folder)."""
    for name in VLLM_NOOPS:
        value = getattr(args, name, None)
        if value is not None:
            note_vllm_noop(name, value, spell=lambda n: "--" + n.replace("_", "-"))
