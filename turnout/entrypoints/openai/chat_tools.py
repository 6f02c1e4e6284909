"""Tool calls and reasoning on /v1/chat/completions: what a request's ``tools`` / ``tool_choice`` ask of
the engine (``plan_tools``), the conversation the chat template sees (``template_messages``), and how a
choice's text becomes ``reasoning_content``, ``content`` and ``tool_calls`` (``ChoiceParser``), complete
or streamed, so that the streamed deltas assemble to the complete answer.

Which parser reads the text:

- ``tool_choice`` "required" or a named function: structured output makes the model write plain JSON
  (tool_parsers/constrained.py), so the arguments always validate, whatever the model's own syntax;
- "auto" (the default when ``tools`` are given, as in OpenAI's API): the model's own syntax, read by
  ``--tool-call-parser``; without ``--enable-auto-tool-choice`` it is a 400, as in vLLM;
- "none", or no tools: the text is content.

``--reasoning-parser`` runs first and the tool parser reads the content it leaves. Under a constraint the
grammar holds from the first token (the engine does not yet wait for the reasoning to end), so there is
no reasoning to split off and the reasoning parser is not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnout.entrypoints.openai.errors import bad_request
from turnout.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from turnout.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from turnout.entrypoints.openai.tool_parsers.constrained import (
    check_tools,
    constrained_tool_parser,
    structured_outputs_for_tools,
)
from turnout.structured.limits import SpecTooLarge, loads_json
from turnout.structured.params import StructuredOutputsError, StructuredOutputsParams


@dataclass
class ToolPlan:
    constraint: StructuredOutputsParams | None = None  # what the engine enforces ("required" / named)
    parser: ToolParser | None = None  # what reads the output's tool calls (None: all content)
    template_tools: list[dict] | None = None  # what the chat template is given
    parallel: bool = True  # False: only the first call is answered
    keep_special_tokens: bool = False  # the parser's markers are special tokens (mistral's [TOOL_CALLS])


def plan_tools(req, options) -> ToolPlan:
    """The request's tool handling; a 400 naming the field for bad tools / tool_choice."""
    tools, choice = req.tools, req.tool_choice
    explicit = choice is not None
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = req.parallel_tool_calls is not False
    try:
        constraint = structured_outputs_for_tools(tools, choice, parallel_tool_calls=parallel)
    except StructuredOutputsError as e:
        raise bad_request(str(e), param=e.field, code="invalid_value") from None
    # structured_outputs_for_tools has checked every tool (each schema's grammar built once)
    plan = ToolPlan(constraint=constraint, template_tools=list(tools) if tools else None, parallel=parallel)
    if not tools or choice == "none":
        return plan
    if constraint is not None:
        plan.parser = constrained_tool_parser(choice)
        return plan
    # "auto" with tools: the model's own syntax
    if not options.auto_tools:
        param = "tool_choice" if explicit else "tools"
        raise bad_request(f'{param}: tool_choice "auto" (the default with tools) needs the server started with '
                          "--enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice \"required\", "
                          'a named function, or "none"', param=param, code="unsupported")
    plan.parser = get_tool_parser(options.tool_call_parser)
    plan.keep_special_tokens = options.tool_call_parser in ("mistral", "openai")
    return plan


def keeps_special_tokens(options, plan: ToolPlan, structured: bool) -> bool:
    """Whether a request's text keeps the special tokens: its tool parser's markers are special tokens (mistral's
    ``[TOOL_CALLS]``, harmony's), or its reasoning parser's are (harmony's channels; not under a constraint,
    where that parser is not used)."""
    if plan.keep_special_tokens:
        return True
    name = options.reasoning_parser
    return (name is not None and not structured and plan.constraint is None
            and REASONING_PARSERS[name].keeps_special_tokens)


def checked_tools(tools) -> list | None:
    """``tools`` for the chat template, each checked (also under "none": a malformed tool is the client's
    mistake); a 400 naming ``tools[i]...``."""
    if not tools:
        return None
    try:
        check_tools(tools)
    except StructuredOutputsError as e:
        raise bad_request(str(e), param=e.field, code="invalid_value") from None
    return list(tools)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's ``tool_calls[].function.arguments`` as an
    object (HF templates write it with ``tojson``), not OpenAI's JSON text. Bad JSON there is a 400."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for j, call in enumerate(calls):
                fn = dict(call["function"])
                where = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    fn["arguments"] = loads_json(fn["arguments"]) if fn["arguments"].strip() else {}
                except SpecTooLarge as e:
                    raise bad_request(f"{where}: {e}", param=where, code="invalid_value") from None
                except ValueError as e:
                    raise bad_request(f"{where}: not valid JSON ({e})", param=where, code="invalid_value") from None
                fixed.append({**call, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out


def reasoning_parser(options, prompt_tail: str, plan: ToolPlan, structured: bool) -> ReasoningParser | None:
    """The ``--reasoning-parser`` for one request, told whether the prompt left the model inside its
    reasoning; None without the flag or under a structured-output constraint (see the module doc)."""
    if options.reasoning_parser is None or structured or plan.constraint is not None:
        return None
    rp = get_reasoning_parser(options.reasoning_parser)
    return get_reasoning_parser(options.reasoning_parser, True) if rp.opened_by_prompt(prompt_tail) else rp


class ChoiceParser:
    """One choice's text -> the message (``complete``) or its deltas (``feed`` / ``finish``)."""

    def __init__(self, reasoning: ReasoningParser | None, plan: ToolPlan):
        self.plan = plan
        self.reasoning = reasoning
        self._rs = reasoning.streaming() if reasoning is not None else None
        self._ts = plan.parser.streaming() if plan.parser is not None else None
        self.called = False  # a tool call was sent (the stream's finish_reason becomes "tool_calls")

    # ---------------------------------------------------------------- complete
    def complete(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(message fields: content, reasoning_content, tool_calls, finish_reason)."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        calls: list[dict] = []
        if self.plan.parser is not None:
            ext = self.plan.parser.extract_tool_calls(content or "")
            calls = [c.to_openai() for c in ext.tool_calls]
            content = ext.content
            if not self.plan.parallel:
                calls = calls[:1]
        msg = {"content": content or (None if calls or reasoning else ""), "reasoning_content": reasoning,
               "tool_calls": calls}
        return msg, _finish(finish_reason, bool(calls))

    # ---------------------------------------------------------------- streamed
    def feed(self, delta: str) -> dict:
        """The delta fields (content, reasoning_content, tool_calls) for new text; {} for nothing yet."""
        if not delta:
            return {}
        return self._split(delta, final=False)

    def finish(self, delta: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last new text and what the end of the text releases, and the choice's finish_reason."""
        out = self._split(delta, final=True)
        return out, _finish(finish_reason, self.called)

    def _split(self, delta: str, final: bool) -> dict:
        out: dict[str, Any] = {}
        content = delta
        if self._rs is not None:
            parts = [self._rs.feed(delta)] + ([self._rs.finish()] if final else [])
            content = "".join(p.content or "" for p in parts if p is not None)
            reasoning = "".join(p.reasoning_content or "" for p in parts if p is not None)
            if reasoning:
                out["reasoning_content"] = reasoning
        if self._ts is None:
            if content:
                out["content"] = content
            return out
        parts = [self._ts.feed(content)] + ([self._ts.finish()] if final else [])
        text = "".join(p.content or "" for p in parts if p is not None and p.content is not None)
        if text:
            out["content"] = text
        calls = _merge([tc for p in parts if p is not None for tc in p.tool_calls])
        if not self.plan.parallel:
            calls = [tc for tc in calls if tc["index"] == 0]
        if calls:
            out["tool_calls"] = calls
            self.called = True
        return out


def _merge(calls: list[dict]) -> list[dict]:
    """Tool-call deltas of one chunk, one entry per index (arguments fragments joined)."""
    by_index: dict[int, dict] = {}
    for tc in calls:
        slot = by_index.get(tc["index"])
        if slot is None:
            by_index[tc["index"]] = {**tc, "function": dict(tc.get("function", {}))}
            continue
        fn = slot.setdefault("function", {})
        fn["arguments"] = fn.get("arguments", "") + (tc.get("function", {}).get("arguments") or "")
    return [by_index[i] for i in sorted(by_index)]


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
