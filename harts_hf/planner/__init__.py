"""Planner: rollout forests -> per-rank microbatch slots (a pure function, no torch.distributed).

``plan(forests, world_size=..., max_tokens_per_microbatch=...)`` returns a :class:`Plan`;
``plan_record`` adds the baselines (``baselines.py``) for ``harts-hf plan``; ``calibrate``
(``harts_hf.bench.calibrate``: it runs models, so it lives with the benchmarks) fits the :class:`CostModel`.
"""

from ..chunking import CHUNK_SIZE
from .balance import rank_imbalance, slot_imbalance, step_seconds
from .baselines import BASELINES, run_baselines
from .cost import DEFAULT_COST_MODEL, CostModel, fit_cost_model
from .memory import TOKEN_MEMORY, Budget, MemoryModel
from .plan import DEFAULT_MAX_TOKENS, Plan, plan
from .plot import plot_plan
from .report import plan_record, record_table

__all__ = [
    "BASELINES",
    "CHUNK_SIZE",
    "DEFAULT_COST_MODEL",
    "DEFAULT_MAX_TOKENS",
    "TOKEN_MEMORY",
    "Budget",
    "CostModel",
    "MemoryModel",
    "Plan",
    "fit_cost_model",
    "plan",
    "plan_record",
    "plot_plan",
    "rank_imbalance",
    "record_table",
    "run_baselines",
    "slot_imbalance",
    "step_seconds",
]
