"""The one error harts-hf raises for a model it cannot run on trees."""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model's family is not supported, or its modeling code no longer matches the adapter."""
