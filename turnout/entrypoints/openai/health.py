"""``GET /health``: whether this server can answer a generation request now, and if not, why.

- 200, empty body: the engine is loaded and its thread is stepping (or idle with nothing to do).
- 200 with ``{"status": "asleep" | "paused", "reason"}``: the RL control plane put it to sleep or paused
  it. The process is sound and the trainer that did it will wake it, so the status stays 200 (as vLLM's
  /health while sleeping) for liveness probes; the body says plainly that a generation now gets 503.
- 503 ``{"status": "loading" | "failed" | "draining" | "dead"}``: as the phase says.
- 503 ``{"status": "stalled", "reason"}``: requests are in flight and the engine thread has not come
  round its loop for ``ServerState.stall_after_s`` seconds (a step or a control call that hangs). An idle
  engine comes round at least every half second, so only real work can go stale.
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse, Response


def health_response(state) -> Response:
    if not state.healthy:
        return JSONResponse({"status": state.phase if state.phase != "ready" else "dead"}, status_code=503)
    eng = state.async_engine
    idle_for = time.monotonic() - getattr(eng, "last_loop", time.monotonic())
    in_flight = eng.num_in_flight
    if in_flight and idle_for > state.stall_after_s:
        return JSONResponse({"status": "stalled", "reason": f"the engine has not stepped for {idle_for:.0f}s "
                             f"with {in_flight} request(s) in flight"}, status_code=503)
    rl = getattr(state.engine, "rl", None)
    if rl is not None and rl.is_sleeping():
        return JSONResponse({"status": "asleep", "reason": "the engine is sleeping (POST /wake_up); generation "
                             "requests get 503 until then"})
    if rl is not None and rl.paused is not None:
        return JSONResponse({"status": "paused", "reason": f"generation is paused (mode {rl.paused!r}; POST "
                             "/resume); generation requests get 503 until then"})
    return Response(status_code=200)
