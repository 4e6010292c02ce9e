"""The models room's error: what loading a model raises when the configuration cannot work (its own module so the
tiny builders, the dummy builder and the loader can all raise it without importing each other)."""

from __future__ import annotations

from shardgen.errors import UserError


class ModelLoadError(UserError, RuntimeError):
    """The model cannot be loaded as configured; the message says what to change."""
