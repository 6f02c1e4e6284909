"""One HTTP request's time with the engine: admission (the engine's refusals as 503s and 400s), the wait
for its outputs, and the abort when the client goes away. Apart from serving.py, which validates
requests before they get here, because this is the one part that talks to the async engine.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from turnout.engine.async_engine import EngineDeadError, EngineDraining, EngineUnavailable, QueueFull, RequestStream
from turnout.entrypoints.openai.errors import APIError, from_value_error

logger = logging.getLogger(__name__)


async def _admit(state, items) -> list[RequestStream]:
    try:
        return await state.async_engine.add_requests(items)
    except QueueFull as e:
        state.metrics.rejected.labels(reason="queue_full").inc()
        raise APIError(503, f"The server is overloaded: {e}", type="server_overloaded", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineDraining:
        state.metrics.rejected.labels(reason="draining").inc()
        raise APIError(503, "The server is shutting down.", type="service_unavailable", code="shutting_down",
                       headers={"Retry-After": "5", "Connection": "close"}) from None
    except EngineDeadError as e:
        raise APIError(503, f"The engine is not available: {e}", type="service_unavailable",
                       code="engine_dead") from None
    except EngineUnavailable as e:  # asleep or paused (the RL endpoints)
        raise APIError(503, str(e), type="service_unavailable", code="engine_unavailable",
                       headers={"Retry-After": "1"}) from None
    except ValueError as e:
        if getattr(e, "prompt_len", None) is not None:  # the engine's ContextLengthError
            raise APIError(400, f"This model's maximum context length is {e.max_model_len} tokens, but the "
                           f"prompt has {e.prompt_len} tokens.", param="prompt",
                           code="context_length_exceeded") from None
        raise from_value_error(e) from None


def _request_failed(out) -> APIError | None:
    """A fault the engine traced to this request (RequestOutput.error): it failed alone, the engine lives.
    Not the client's mistake as far as the server can tell (validation let it through): a 500 naming it."""
    err = getattr(out, "error", None)
    if err is None:
        return None
    logger.error("request %s failed inside the engine: %s", out.request_id, err)
    return APIError(500, f"The request failed inside the engine: {err}", type="internal_server_error",
                    code="request_failed")


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDraining):
        return APIError(503, str(e), type="service_unavailable", code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(500, str(e), type="internal_server_error", code="engine_dead")
    logger.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", type="internal_server_error", code="internal_error")


async def _watch_disconnect(request: Request, on_disconnect) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a broken transport is a disconnect too
        pass
    on_disconnect()


class _Exchange:
    """One HTTP request's engine requests: watches the client and aborts them all if it goes away."""

    def __init__(self, state, request: Request, streams: list[RequestStream]):
        self.state, self.streams = state, streams
        self.disconnected = False
        self._watcher = asyncio.ensure_future(_watch_disconnect(request, self._on_disconnect))

    def _on_disconnect(self) -> None:
        self.disconnected = True
        self.close()

    def close(self) -> None:
        self._watcher.cancel()
        for s in self.streams:
            self.state.async_engine.abort(s.request_id)

    async def final_outputs(self):
        async def last(s):
            out = None
            async for out in s:  # noqa: B007 - the stream's last output is the answer
                pass
            return out

        try:
            results = await asyncio.gather(*(last(s) for s in self.streams), return_exceptions=True)
        finally:
            self.close()
        if self.disconnected:
            raise APIError(499, "client disconnected")
        for r in results:
            if isinstance(r, BaseException):
                raise _engine_error(r)
            failed = _request_failed(r)
            if failed is not None:
                raise failed
        return results

    async def merged(self):
        """(prompt index, cumulative output) as they arrive, over all streams."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                if (failed := _request_failed(out)) is not None:
                    raise failed
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for out in s:
                    q.put_nowait((i, out, None))
                q.put_nowait((i, None, None))
            except BaseException as e:  # noqa: BLE001
                q.put_nowait((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                i, out, err = await q.get()
                if err is not None:
                    raise err
                if out is None:
                    left -= 1
                elif (failed := _request_failed(out)) is not None:
                    raise failed
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
