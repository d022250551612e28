"""The compiled schedule: every unit (model call) of a step, device-ready before the model runs.

- ``schedule.py``: :class:`Schedule`, one rank's pass over a plan (its units, padding calls,
  owned trajectories and the gathers back to forest order and TRL's rows): what the engine runs.
- ``units.py``: :class:`Unit` (token ids, tree tables, log-prob pairs, handoff addresses) and
  the compilers: :func:`rank_units` (a rank's row of a plan) and :func:`forest_unit` (a whole
  forest, what ``tree_logprobs`` runs).
- ``coverage.py``: who computes each token of a step, as runs (:class:`StepUnits`, the step's units;
  :class:`Coverage`, a read resolved per segment): the step-wide answer every rank checks alike.
- ``crossrank.py``: the handoffs that cross ranks, seen from one rank: the blocks its units send
  and receive (:class:`Transfers`, the typed table; :class:`Exchange`, by call).
- ``tables.py``: builds the tree tables a model's layers declare on a host batch and moves them once.
- ``rows.py``: :class:`TrajectoryRows`, pair values -> TRL's ``[B, max_len - 1]`` rows.
"""

from .crossrank import Exchange, Transfers
from .rows import TrajectoryRows
from .schedule import Schedule
from .tables import Tables, build_tables, chunk_sizes
from .units import Gather, Unit, compile_rank, forest_unit, rank_units

__all__ = [
    "Exchange",
    "Gather",
    "Schedule",
    "Tables",
    "TrajectoryRows",
    "Transfers",
    "Unit",
    "build_tables",
    "chunk_sizes",
    "compile_rank",
    "forest_unit",
    "rank_units",
]
