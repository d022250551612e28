"""The compiled schedule: every unit (model call) of a step, device-ready before the model runs."""

from .rows import TrajectoryRows
from .tables import Builders, build_tables, chunk_sizes
from .units import Gather, Unit, forest_unit, handoff_rows, rank_units

__all__ = [
    "Builders",
    "Gather",
    "TrajectoryRows",
    "Unit",
    "build_tables",
    "chunk_sizes",
    "forest_unit",
    "handoff_rows",
    "rank_units",
]
