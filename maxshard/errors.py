"""The user-facing error of every layer of maxshard, in a module that imports nothing.

A layer, the mesh builder or a data reader can refuse a layout or a value without importing the run config: they
raise `ConfigError` from here, and every entry point prints it as one line (`maxshard.cli`).
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A user mistake in the configuration: one line that names the key and what is allowed."""
