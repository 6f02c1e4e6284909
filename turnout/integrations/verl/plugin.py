"""The ``verl.plugins`` entry point (pyproject.toml): verl imports this module at ``import verl``, which
registers turnout's rollout (turnout/integrations/verl/__init__.py)."""

from turnout.integrations.verl import register

REGISTERED = register()
