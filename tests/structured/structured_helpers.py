"""Helpers shared by the structured-output tests: a constrained random walk and a small JSON-schema checker."""

from __future__ import annotations

import re

import torch

from turnout.structured.matcher import allocate_bitmask, fill_batch_bitmask


def constrained_walk(tok, compiler, walk_tools, params_list, seed=0, max_steps=400):
    """Texts generated under each params (None: unconstrained, stopped at max_steps / 8)."""
    bias, table = walk_tools
    v = compiler.vocab_size
    states = [None if p is None else compiler.new_state(p) for p in params_list]
    tokens = [[] for _ in params_list]
    done = [False] * len(params_list)
    g = torch.Generator().manual_seed(seed)
    mask = allocate_bitmask(len(params_list), v)
    for _ in range(max_steps):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        rows = fill_batch_bitmask(states, mask)
        logits = torch.randn(len(params_list), v, generator=g) * 2.0 + bias  # [B, V] f32
        table.apply_token_bitmask(logits, mask, torch.tensor(rows, dtype=torch.int64))
        drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0].tolist()
        for i in live:
            t = drawn[i]
            if states[i] is None:
                assert t < v
                tokens[i].append(t)
                done[i] = len(tokens[i]) >= max_steps // 8
                continue
            assert t < len(tok), f"row {i} drew padding id {t}"
            assert states[i].accept_token(t), f"row {i}: the grammar refused token {t} that its mask allowed"
            if states[i].is_terminated():
                done[i] = True
            else:
                tokens[i].append(t)
    assert all(done), f"walks unfinished after {max_steps} steps: {[i for i, d in enumerate(done) if not d]}"
    return [tok.decode(t) for t in tokens]


# A small JSON-schema checker for the keywords these tests use (jsonschema is not a dependency here).
def check_schema(value, schema, path="$"):
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != const"
    if t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} not an integer"
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: {value!r} not a number"
    elif t in types:
        assert isinstance(value, types[t]), f"{path}: {value!r} not {t}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert value >= schema.get("minimum", value) and value <= schema.get("maximum", value), f"{path}: {value} out of bounds"
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), f"{path}: length"
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), f"{path}: {value!r} does not match {schema['pattern']}"
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{path}: items"
        for n, item in enumerate(value):
            check_schema(item, schema.get("items", {}), f"{path}[{n}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: required {key!r} missing"
        for key, item in value.items():
            if key in props:
                check_schema(item, props[key], f"{path}.{key}")
            else:
                assert schema.get("additionalProperties", not props) is not False, f"{path}: extra key {key!r}"
    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                check_schema(value, sub, path)
                break
            except AssertionError as e:
                errors.append(str(e))
        else:
            raise AssertionError(f"{path}: no anyOf branch matches: {errors}")
