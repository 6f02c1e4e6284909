"""turnout as verl's rollout engine, through verl's own plugin registries (verl 0.9).

``import verl`` loads every ``verl.plugins`` entry point; turnout's (pyproject.toml) is
``turnout.integrations.verl.plugin``, which calls ``register()``:

- ``("turnout", "async")`` in verl's rollout registry -> ``rollout.TurnoutRollout`` (a ``BaseRollout``);
- ``"turnout"`` in ``RolloutReplicaRegistry`` -> ``rollout.TurnoutReplica`` (a ``RolloutReplica`` launching
  ``server.TurnoutServer`` Ray actors).

So ``actor_rollout_ref.rollout.name=turnout`` selects it. Nothing here imports verl at module level: turnout
without verl imports this package fine, and the classes above are imported by verl's registries only when
verl asks for them. Each registry is probed, not assumed: a verl that renamed one loses that entry with a
WARNING naming what is missing, and keeps the other.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAME = "turnout"
ROLLOUT_CLASS = "turnout.integrations.verl.rollout.TurnoutRollout"


def _load_replica():
    from turnout.integrations.verl.rollout import TurnoutReplica

    return TurnoutReplica


def register() -> dict[str, str | None]:
    """Add turnout to verl's registries; idempotent. Returns, per registry, None where it was added, else
    why not (also logged as a WARNING)."""
    status: dict[str, str | None] = {}
    try:
        from verl.workers.rollout import base

        registry = getattr(base, "_ROLLOUT_REGISTRY", None)
        if not isinstance(registry, dict):
            raise ImportError("verl.workers.rollout.base._ROLLOUT_REGISTRY is gone")
        registry[(NAME, "async")] = ROLLOUT_CLASS
        status["rollout"] = None
    except Exception as e:  # noqa: BLE001 - a verl without the registry: this entry is off, said once
        status["rollout"] = f"{type(e).__name__}: {e}"
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        RolloutReplicaRegistry.register(NAME, _load_replica)
        status["replica"] = None
    except Exception as e:  # noqa: BLE001
        status["replica"] = f"{type(e).__name__}: {e}"
    for what, why in status.items():
        if why is not None:
            logger.warning("turnout's verl plugin: the %s registry could not take turnout (%s); "
                           "rollout.name=turnout will not find it", what, why)
    return status
