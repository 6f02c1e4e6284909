"""StructuredOutputsParams -> an xgrammar ``Grammar`` (tokenizer-free: the part that validates the spec)."""

from __future__ import annotations

import json
import re

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: ... : ".
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


MAX_WHITESPACE = 20  # characters in one whitespace run of JSON output


def clean_error(e: BaseException) -> str:
    """xgrammar's message without its source location (the user sees it in a 400)."""
    text = str(e).strip()
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    return text.splitlines()[0].strip() if text else type(e).__name__


def ebnf_string(s: str) -> str:
    """A string literal of xgrammar's EBNF that matches exactly ``s``."""
    out = []
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_ebnf(choices) -> str:
    return "root ::= " + " | ".join(f"({ebnf_string(c)})" for c in dict.fromkeys(choices))


def import_xgrammar():
    """xgrammar, or a RuntimeError saying that structured output needs it (it is a dependency of turnout;
    a trimmed install may lack it, and then only structured output is off)."""
    try:
        import xgrammar
    except ImportError as e:
        raise RuntimeError(f"structured output needs the xgrammar package, which does not import here: {e}") from e
    return xgrammar


def build_grammar(params):
    """The xgrammar Grammar of ``params``; an invalid spec raises StructuredOutputsError naming its field."""
    xgr = import_xgrammar()

    kind = params.kind
    # disable_any_whitespace means no whitespace at all (vLLM's documented meaning), not json.dumps' ", ".
    # Whitespace runs are bounded: with unbounded ones a small model can stay in a run of newlines until
    # max_tokens (seen with SmolLM2 through the server); 20 characters still indent 9 levels deep.
    layout = ({"any_whitespace": False, "separators": (",", ":")} if params.disable_any_whitespace
              else {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE})
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(params.schema()), strict_mode=True, **layout)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **layout)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        if kind == "structural_tag":
            tag = params.structural_tag
            tag = json.loads(tag) if isinstance(tag, str) else tag
            if isinstance(tag, dict) and "format" not in tag and "structures" in tag:
                # vLLM's first structural-tag shape: {"structures": [{"begin", "schema", "end"}], "triggers"}
                items = [xgr.StructuralTagItem(begin=t["begin"], schema=json.dumps(t.get("schema", {})), end=t["end"])
                         for t in tag["structures"]]
                return xgr.Grammar.from_structural_tag(
                    xgr.StructuralTag.from_legacy_structural_tag(items, list(tag.get("triggers", []))))
            return xgr.Grammar.from_structural_tag(json.dumps(tag))
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        what = {"json": "invalid JSON schema", "json_object": "invalid JSON object grammar", "regex": "invalid regex",
                "choice": "invalid choices", "grammar": "invalid EBNF grammar",
                "structural_tag": "invalid structural tag"}[kind]
        why = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else clean_error(e)
        raise params.error(kind, f"{what}: {why}") from None
    raise AssertionError(kind)  # pragma: no cover - KINDS and this function list the same kinds
