"""Small shared helpers that are not part of the engine's hot path (measuring, formatting)."""
