"""Adapters that let other projects drive turnout through their own interfaces (verl.py: verl's rollout).

Nothing here is imported by the engine, and no adapter imports its project at module level: each is
usable (and testable) without the other project installed.
"""
