"""The weight-loading walk, which lives with the models (turnout/models/weight_map.py: models import nothing
of the loader); re-exported here for the loaders."""

from turnout.models.weight_map import ALWAYS_IGNORED, _checkpoint_name, _compile_rules, load_weights, map_weight_name  # noqa: F401
