"""``tool_choice`` "required" or a named function, enforced with structured output (vLLM's approach).

The constrained output is plain JSON, not the model's own tool-call syntax, so it parses the same for
every model:

- a named function: the output is that function's arguments, a JSON object valid for its ``parameters``
  schema;
- "required": a non-empty JSON array of ``{"name": <one of the tools>, "parameters": {...}}``, each
  ``parameters`` valid for that tool's schema (parallel calls are several items).

``structured_outputs_for_tools`` builds the StructuredOutputsParams; ``constrained_tool_parser`` gives the
ToolParser (complete and streaming) for its output. "none" and "auto" return None: nothing to enforce
("auto" is parsed with the model's own parser, ``--tool-call-parser``).
"""

from __future__ import annotations

from typing import Any

from turnout.entrypoints.openai.tool_parsers.base import ParseState, PartialCall, ToolParser
from turnout.entrypoints.openai.tool_parsers.json_scan import is_json_object, skip_ws
from turnout.entrypoints.openai.tool_parsers.mistral import parse_array
from turnout.structured.params import StructuredOutputsError, StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


def _plain(value):
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def check_tools(tools) -> dict[str, dict]:
    """``tools`` (OpenAI's list of ``{"type": "function", "function": {"name", "description", "parameters"}}``)
    -> {name: parameters schema}. Errors name the field (``tools[1].function.name``); each schema is
    checked by building its grammar."""
    tools = _plain(tools)
    if not isinstance(tools, list):
        raise StructuredOutputsError("tools", "must be a list of tools")
    out: dict[str, dict] = {}
    for n, tool in enumerate(tools):
        tool = _plain(tool)
        where = f"tools[{n}]"
        if not isinstance(tool, dict):
            raise StructuredOutputsError(where, "must be an object")
        if tool.get("type", "function") != "function":
            raise StructuredOutputsError(f"{where}.type", f"unsupported tool type {tool.get('type')!r} (function)")
        fn = _plain(tool.get("function"))
        if not isinstance(fn, dict):
            raise StructuredOutputsError(f"{where}.function", "missing or not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise StructuredOutputsError(f"{where}.function.name", "must be a non-empty string")
        if name in out:
            raise StructuredOutputsError(f"{where}.function.name", f"duplicate tool name {name!r}")
        params = fn.get("parameters")
        if params is None:
            params = ANY_OBJECT
        StructuredOutputsParams(json=params, field_names={"json": f"{where}.function.parameters"})
        out[name] = params
    return out


def chosen_function(tool_choice) -> str | None:
    """The function name of a named tool_choice, None for the string choices; errors name ``tool_choice``."""
    tool_choice = _plain(tool_choice)
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return None
    if isinstance(tool_choice, str):
        raise StructuredOutputsError("tool_choice", f"unknown value {tool_choice!r} (none, auto, required or "
                                                    '{"type": "function", "function": {"name": ...}})')
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function":
        raise StructuredOutputsError("tool_choice", 'must be none, auto, required or {"type": "function", '
                                                    '"function": {"name": ...}}')
    fn = _plain(tool_choice.get("function"))
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise StructuredOutputsError("tool_choice.function.name", "must be a non-empty string")
    return name


def structured_outputs_for_tools(tools, tool_choice, *, parallel_tool_calls: bool = True
                                 ) -> StructuredOutputsParams | None:
    """The constraint that makes the output a valid call: None for "none" / "auto" / no tool_choice."""
    name = chosen_function(tool_choice)
    if _plain(tool_choice) in (None, "none", "auto"):
        if tools is not None:
            check_tools(tools)
        return None
    if tools is None or not _plain(tools):
        raise StructuredOutputsError("tools", f"tool_choice {_plain(tool_choice)!r} needs at least one tool")
    schemas = check_tools(tools)
    if name is not None:
        if name not in schemas:
            raise StructuredOutputsError("tool_choice.function.name", f"no tool named {name!r} (tools: "
                                                                      f"{', '.join(schemas)})")
        return StructuredOutputsParams(json=schemas[name], field_names={"json": "tools"})
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": s},
              "required": ["name", "parameters"]} for n, s in schemas.items()]
    array: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                             "minItems": 1}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, field_names={"json": "tools"})


class NamedFunctionParser(ToolParser):
    """The output is the arguments of one known function."""

    name = "named_function"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> ParseState:
        args = text.strip()  # trailing whitespace is held back while streaming, dropped at the end
        if final and not is_json_object(args):
            return ParseState(content=text)
        return ParseState(calls=[PartialCall(self.function, args)] if args or final else [])


class RequiredToolsParser(ToolParser):
    """The output is a JSON array of ``{"name", "parameters"}``."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParseState:
        state = ParseState()
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParseState(content=text) if final else state
        if text[i] != "[" or not parse_array(text, i, final, state.calls):
            return ParseState(content=text) if final else state
        return state


def constrained_tool_parser(tool_choice) -> ToolParser | None:
    """The parser of what ``structured_outputs_for_tools`` makes the model write (None: unconstrained)."""
    name = chosen_function(tool_choice)
    if name is not None:
        return NamedFunctionParser(name)
    return RequiredToolsParser() if _plain(tool_choice) == "required" else None
