"""Argument checks shared by the planner and the workload generators: one message per kind of
mistake, naming the argument, before a bad value reaches numpy (where NaN budgets loop forever and
empty arrays fail with messages about arrays, not arguments)."""

from __future__ import annotations

import numpy as np

__all__ = ["is_integer", "require_positive_ints", "require_probabilities"]


def is_integer(value: object) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def require_positive_ints(where: str, **values: object) -> None:
    """Refuse counts that are not positive integers (floats, NaN, bools, strings included)."""
    for name, value in values.items():
        if not is_integer(value) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")


def require_probabilities(where: str, **values: float) -> None:
    """Refuse probabilities outside [0, 1] (NaN included)."""
    for name, value in values.items():
        if not 0 <= value <= 1:
            raise ValueError(f"{where}: {name} must be a probability in [0, 1], got {value!r}")
