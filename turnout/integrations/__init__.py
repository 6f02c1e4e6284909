"""Adapters that let other projects drive turnout through their own interfaces (verl/: turnout as verl's
rollout engine, a plugin of verl's registries).

Nothing here is imported by the engine, and no adapter imports its project at the package's top level: each
package imports fine without the other project installed.
"""
