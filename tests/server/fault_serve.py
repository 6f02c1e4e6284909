"""`turnout serve` with a fault injected into the real engine, for tests of what happens when it dies.

Run as ``python tests/server/fault_serve.py serve ...`` (the same arguments as ``turnout serve``). A
request with the stop string ``KILL-ENGINE`` (the server tokenises prompts, so the engine never sees
their text) makes the next engine step raise an error that no request owns, as a lost device would,
from inside the engine thread; everything else is the real server.
"""

from __future__ import annotations

import sys

from turnout.engine import llm_engine
from turnout.entrypoints import cli

MAGIC = "KILL-ENGINE"


class InjectedDeviceLoss(RuntimeError):
    pass


def _patch() -> None:
    engine_cls = llm_engine.LLMEngine
    add_request, step = engine_cls.add_request, engine_cls.step

    def add(self, request_id, prompt, params=None, *args, **kwargs):
        if params is not None and MAGIC in params.stop_strings:
            self._test_doomed = True
        return add_request(self, request_id, prompt, params, *args, **kwargs)

    def doomed_step(self, *args, **kwargs):
        if getattr(self, "_test_doomed", False):
            raise InjectedDeviceLoss("injected fault: the device was lost")
        return step(self, *args, **kwargs)

    engine_cls.add_request, engine_cls.step = add, doomed_step


if __name__ == "__main__":
    _patch()
    sys.exit(cli.main(sys.argv[1:]))
