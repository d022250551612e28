"""Planner: rollout forests -> per-rank microbatch slots (a pure function, no torch.distributed).

``plan(forests, world_size=..., max_tokens_per_microbatch=...)`` returns a :class:`Plan`. The
baselines it is compared with, its report and plot (``harts-hf plan``) and ``calibrate`` (which
runs models and fits the :class:`CostModel`) live in the lab, ``harts_hf.lab``.
"""

from ..chunking import CHUNK_SIZE
from .balance import rank_imbalance, slot_imbalance, step_seconds
from .cost import DEFAULT_COST_MODEL, CostModel, fit_cost_model
from .memory import TOKEN_MEMORY, Budget, MemoryModel
from .plan import DEFAULT_MAX_TOKENS, Plan, plan
from .planners import Planners

__all__ = [
    "CHUNK_SIZE",
    "DEFAULT_COST_MODEL",
    "DEFAULT_MAX_TOKENS",
    "TOKEN_MEMORY",
    "Budget",
    "CostModel",
    "MemoryModel",
    "Plan",
    "Planners",
    "fit_cost_model",
    "plan",
    "rank_imbalance",
    "slot_imbalance",
    "step_seconds",
]
