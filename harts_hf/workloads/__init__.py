"""Synthetic rollout workloads: the SWE-like agentic benchmark and small tree shapes for tests."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .shapes import caterpillar, deep_chain, grpo_group, random_tree
from .stats import forest_stats
from .swe_like import CPU_SCALE, swe_like
from .workload import Workload

__all__ = [
    "CPU_SCALE",
    "WORKLOADS",
    "Workload",
    "caterpillar",
    "deep_chain",
    "forest_stats",
    "get_workload",
    "grpo_group",
    "random_tree",
    "swe_like",
]

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "swe-like": swe_like,
    "grpo-group": grpo_group,
    "caterpillar": caterpillar,
    "random-tree": random_tree,
    "deep-chain": deep_chain,
}


def get_workload(name: str, **kwargs) -> Workload:
    """Generate the workload registered as ``name`` with the generator's keyword arguments."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(sorted(WORKLOADS))}")
    params = inspect.signature(WORKLOADS[name]).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(f"workload {name!r} takes no {', '.join(unknown)}; it takes {', '.join(params)}")
    return WORKLOADS[name](**kwargs)
