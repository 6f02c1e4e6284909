"""Structured output and tools on the server: every grammar is built and compiled off the event loop.

Reading a request's constraint (``StructuredOutputsParams`` builds its grammar to validate it), checking
its tools and compiling against the vocabulary all run on a grammar worker thread
(turnout/structured/workers.py) under the server's deadline (``--grammar-timeout``), and stop being
waited for when the client leaves. The event loop keeps answering every other request meanwhile.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from turnout.entrypoints.openai.errors import APIError, bad_request, from_value_error
from turnout.entrypoints.openai.serving_exchange import _watch_disconnect

# The request fields that ask for structured output (turnout/structured/request.py reads them).
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "guided_whitespace_pattern", "structural_tag")
_LANE_FIELDS = (*_CONSTRAINT_FIELDS, "tools", "tool_choice")  # what the grammar work reads
DEFAULT_GRAMMAR_TIMEOUT = 10.0  # seconds to build and compile a request's grammars (--grammar-timeout)
_workers = None


def grammar_workers():
    """The process's grammar worker threads (turnout/structured/workers.py says why threads)."""
    global _workers
    if _workers is None:
        from turnout.structured.workers import GrammarWorkers

        _workers = GrammarWorkers()
    return _workers


def constraint_field(req) -> str:
    """The request field a structured-output constraint comes from, for an error raised before it is known."""
    rf = getattr(req, "response_format", None)
    if rf is not None:
        return "response_format.json_schema.schema" if rf.get("type") == "json_schema" else "response_format"
    so = getattr(req, "structured_outputs", None)
    if isinstance(so, dict):
        kind = next((k for k in ("json", "regex", "choice", "grammar", "structural_tag") if so.get(k) is not None),
                    None)
        return f"structured_outputs.{kind}" if kind else "structured_outputs"
    return next((f for f in _CONSTRAINT_FIELDS if getattr(req, f, None) is not None), "tools")


async def off_loop(state, request: Request, req, fn, field_of):
    """``fn()``, which builds or compiles ``req``'s grammars, on a grammar worker thread, never on the event loop; a
    400 naming ``field_of()`` when it outlasts the server's grammar deadline, a 499 when the client leaves
    first (a job not yet started is then dropped)."""
    from turnout.structured.limits import is_light
    from turnout.structured.workers import LIGHT_BODY_BYTES, Disconnected, GrammarTimeout

    timeout = getattr(state.options, "grammar_timeout", DEFAULT_GRAMMAR_TIMEOUT)
    body = await request.body()
    light = len(body) <= LIGHT_BODY_BYTES and is_light([getattr(req, f, None) for f in _LANE_FIELDS])
    gone = asyncio.ensure_future(_watch_disconnect(request, lambda: None))
    try:
        return await grammar_workers().run(fn, light=light, timeout=timeout, gone=gone)
    except GrammarTimeout:
        field = field_of()
        raise bad_request(f"{field}: its grammar took longer than {timeout:g} s to build and compile (the "
                          "server's --grammar-timeout); simplify the schema", param=field,
                          code="grammar_timeout") from None
    except Disconnected:
        raise APIError(499, "client disconnected") from None
    finally:
        gone.cancel()


async def _structured_outputs(state, request: Request, req, tools_constraint=None):
    """The request's structured-output constraint (response_format, structured_outputs, guided_*, or the
    one ``tool_choice`` "required" / named makes), read and compiled off the event loop (``off_loop``), so
    admission finds it compiled; None when it asks for none. A bad spec is a 400 naming the request field
    (``param``)."""
    if tools_constraint is None and all(getattr(req, f, None) is None for f in _CONSTRAINT_FIELDS):
        return None
    from turnout.structured import StructuredOutputsError, from_request

    ip = getattr(state.engine, "input_processor", None)  # the real engine (a fake one has none)
    where = []  # the field being worked on, once known (for a deadline's 400)

    def work():
        so = from_request(req)
        if so is not None and tools_constraint is not None:
            raise StructuredOutputsError("tool_choice", "a required or named tool call cannot be combined with "
                                                        "another structured-output constraint")
        so = so if so is not None else tools_constraint
        if so is not None:
            where.append(so.field_name(so.kind))
            if ip is not None:
                ip.grammar_compiler().compile(so)  # kept on ``so``: the engine does not compile it again
        return so

    try:
        return await off_loop(state, request, req, work, lambda: where[-1] if where else constraint_field(req))
    except StructuredOutputsError as e:
        raise bad_request(str(e), param=e.field) from None
    except ValueError as e:  # the model has no tokenizer
        raise from_value_error(e) from None
