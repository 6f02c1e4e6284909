"""The RL control endpoints (``turnout serve --enable-rl-endpoints``; without the flag they do not exist:
404), behind the API key (http_guard's KEYED_PATHS): what an RL framework's rollout server calls between
training steps. Each runs on the engine thread between two steps (turnout/engine/async_rl.py).

POST /sleep {level}, /wake_up {tags}, /reset_prefix_cache, /pause {mode}, /resume,
/update_weights_from_disk {path}, /init_weight_update_group {master_address, master_port, rank_offset,
world_size, backend, timeout}, /update_weights_from_distributed {names, dtypes, shapes, timeout}; GET
/is_sleeping, /is_paused. A bad value is a 400 naming the field (a malformed checkpoint: its file and
tensor); a state that forbids the call (sleeping with requests in flight, updating asleep weights) a 409; a
trainer that does not answer within ``timeout`` seconds (default 60) a 504, with nothing joined or written
and the engine generating throughout the wait for the trainer's store.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse

from turnout.entrypoints.openai.errors import APIError, bad_request, from_value_error

RL_PATHS = frozenset({"/sleep", "/wake_up", "/reset_prefix_cache", "/pause", "/resume", "/update_weights_from_disk",
                      "/init_weight_update_group", "/update_weights_from_distributed", "/is_sleeping", "/is_paused"})


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_request_body")
    return body


def _field(body: dict, name: str, kind, default=None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise bad_request(f"{name}: field required", param=name, code="missing_field")
        return default
    v = body[name]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise bad_request(f"{name}: must be a {names}", param=name, code="invalid_type")
    return v


def _list_of(body: dict, name: str, kind) -> list:
    v = _field(body, name, list, required=True)
    if not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise bad_request(f"{name}: must be a list of {kind.__name__}", param=name, code="invalid_type")
    return v


async def _run(state, coro_fn):
    state.require_ready()
    try:
        return await coro_fn()
    except ValueError as e:
        raise from_value_error(e) from None
    except TimeoutError as e:  # the trainer's side did not answer in time (weight_broadcast.WeightGroupTimeout)
        raise APIError(504, str(e), type="timeout", param=str(e).split(":", 1)[0] if ":" in str(e) else None,
                       code="trainer_timeout") from None
    except RuntimeError as e:  # the engine's state forbids it now (asleep, requests in flight)
        raise APIError(409, str(e), type="invalid_state", code="invalid_state") from None


def register_rl_routes(app, state) -> None:
    """Add the endpoints when ``state.enable_rl_endpoints``; otherwise nothing (they are 404)."""
    if not getattr(state, "enable_rl_endpoints", False):
        return

    def eng():
        return state.async_engine

    @app.post("/sleep")
    async def sleep(request: Request):
        level = _field(await _body(request), "level", int, 1)
        await _run(state, lambda: eng().sleep(level))
        return JSONResponse({"is_sleeping": eng().is_sleeping()})

    @app.post("/wake_up")
    async def wake_up(request: Request):
        body = await _body(request)
        tags = _field(body, "tags", list)
        if tags is not None and not all(isinstance(t, str) for t in tags):
            raise bad_request("tags: must be a list of strings", param="tags", code="invalid_type")
        await _run(state, lambda: eng().wake_up(tags))
        return JSONResponse({"is_sleeping": eng().is_sleeping()})

    @app.get("/is_sleeping")
    async def is_sleeping():
        state.require_ready()
        return JSONResponse({"is_sleeping": eng().is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        forgotten = await _run(state, lambda: eng().reset_prefix_cache())
        return JSONResponse({"blocks_forgotten": forgotten})

    @app.post("/pause")
    async def pause(request: Request):
        mode = _field(await _body(request), "mode", str, "abort")
        outs = await _run(state, lambda: eng().pause_generation(mode))
        return JSONResponse({"is_paused": True, "aborted": [o.request_id for o in outs]})

    @app.post("/resume")
    async def resume(request: Request):
        await _run(state, lambda: eng().resume_generation())
        return JSONResponse({"is_paused": False})

    @app.get("/is_paused")
    async def is_paused():
        state.require_ready()
        return JSONResponse({"is_paused": eng().is_paused()})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        path = _field(await _body(request), "path", str, required=True)
        written = await _run(state, lambda: eng().update_weights_from_disk(path))
        return JSONResponse({"updated": len(written)})

    @app.post("/init_weight_update_group")
    async def init_weight_update_group(request: Request):
        b = await _body(request)
        args = (_field(b, "master_address", str, required=True), _field(b, "master_port", int, required=True),
                _field(b, "rank_offset", int, required=True), _field(b, "world_size", int, required=True),
                _field(b, "backend", str, "gloo"), _field(b, "timeout", (int, float)))
        ranks = await _run(state, lambda: eng().init_weight_update_group(*args))
        return JSONResponse({"ranks": ranks})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        b = await _body(request)
        names, dtypes = _list_of(b, "names", str), _list_of(b, "dtypes", str)
        shapes = _field(b, "shapes", list, required=True)
        if not all(isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
                   for s in shapes):
            raise bad_request("shapes: must be a list of lists of integers", param="shapes", code="invalid_type")
        if not len(names) == len(dtypes) == len(shapes):
            raise bad_request("names: names, dtypes and shapes must have the same length", param="names",
                              code="invalid_value")
        timeout = _field(b, "timeout", (int, float))
        written = await _run(state, lambda: eng().update_weights_from_distributed(names, dtypes, shapes, timeout))
        return JSONResponse({"updated": len(written)})
