"""The errors the server's engine (``AsyncLLMEngine``) gives its callers, each a distinct answer the
server maps to its own HTTP status: a full queue, a dead engine, a shutdown, a paused or sleeping engine.

Separate from engine/async_engine.py because both of its sides raise them: the callers' (admission) and
the engine thread's (engine/engine_loop.py).
"""

from __future__ import annotations


class QueueFull(RuntimeError):
    """More requests are waiting than --max-queue allows; nothing of the request was admitted."""


class EngineDeadError(RuntimeError):
    """The engine failed; every in-flight request gets this, and so does every new one."""


class EngineDraining(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class EngineUnavailable(RuntimeError):
    """The engine is asleep or its generation is paused (the RL control plane): retry after wake_up /
    resume. Nothing of the request was admitted."""
