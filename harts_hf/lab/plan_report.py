"""What ``harts-hf plan`` reports: the plan's numbers next to every baseline's, as JSON and a table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..forest import RolloutForest
from ..planner.plan import Plan
from .baselines import EXACT_SECONDS, run_baselines

__all__ = ["PLANNERS", "bench_memory_model", "legend", "plan_record", "planner_entries", "record_table"]

PLANNERS = {
    "harts": "ours: subtrees to ranks on the cost model, shared chains recomputed, lockstep slots",
    "per_trajectory": "no sharing (trajectory-wise training): trajectories spread over ranks",
    "trie_packing": "AReaL: tries of trajectories up to the budget; a prefix shared by two tries runs twice",
    "dfs_kcut": "AReaL-DTA: the DFS order cut into one contiguous range per rank",
    "exact": "Tree Training: CP-SAT's optimal rank assignment of our finest branches (small instances)",
}
"""One line per planner of the table and the plot (``baselines.py`` says more)."""

COLUMNS = {
    "step s": "predicted step seconds, ranks in lockstep: the sum over slots of the slowest rank, every slot but "
    "the last again at a third (its replay; lower is better)",
    "slot imb": "worst slot's slowest rank / its mean rank: lockstep waiting (1 = none; lower is better)",
    "rank imb": "slowest rank's total / mean rank total (1 = even; lower is better)",
    "redundancy": "extra tokens computed per compact token: recomputed chains, replays (lower is better)",
    "plan s": "time taken to plan (lower is better)",
}
GAP = {"gap": "harts' largest rank cost above the exact solver's proven lower bound (0% = optimal)"}


def legend(meanings: Mapping[str, str]) -> str:
    """Aligned ``name  meaning`` lines printed under a table, so its columns explain themselves."""
    width = max(map(len, meanings))
    return "\n".join(f"  {name:<{width}}  {meaning}" for name, meaning in meanings.items())


def plan_record(forests: Sequence[RolloutForest], plan: Plan, *, exact_seconds: float = EXACT_SECONDS) -> dict:
    """``{"world_size", "slots", "pieces", "imbalance": {"slot", "rank"}, "redundancy",
    "plan_seconds", "baselines": {name: {"imbalance", "redundancy", "plan_seconds", ...}}}``."""
    return {**plan.summary(), "baselines": run_baselines(forests, plan, exact_seconds)}


def planner_entries(record: dict) -> dict[str, dict]:
    """harts' entry first, then every baseline's: the rows of the table and the bars of the plot."""
    return {"harts": record, **record["baselines"]}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def record_table(record: dict) -> str:
    """One aligned row per planner (step time, slot and rank imbalance, redundancy, planning seconds), why a
    baseline was skipped and the exact solver's gap, then the legend of columns and planners."""
    rows = [("planner", "step s", "slot imb", "rank imb", "redundancy", "plan s")]
    for name, e in planner_entries(record).items():
        imb = e["imbalance"] or {}
        rows.append(
            (
                name,
                _fmt(e["step_seconds"], ".4f"),
                _fmt(imb.get("slot"), ".4f"),
                _fmt(imb.get("rank"), ".4f"),
                _fmt(e["redundancy"], ".4f"),
                _fmt(e["plan_seconds"], ".3f"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    head = f"world size {record['world_size']}: {record['slots']} slots, {record['pieces']} pieces"
    head += f"; step s from {record['step_seconds_from']}"
    notes = [f"{name}: {e['skipped']}" for name, e in record["baselines"].items() if "skipped" in e]
    gap = record["baselines"]["exact"].get("gap")
    if gap is not None:
        notes.append(f"gap to the exact solver's bound on the largest rank cost: {gap:.4%}")
    meanings = COLUMNS | PLANNERS | (GAP if gap is not None else {})
    return "\n".join([head, *lines, *notes, "", legend(meanings)])


def bench_memory_model(family: str, size: str = "default"):
    """The memory model of a freshly built bench model (``harts_hf.lab.models``), patched: what prices
    the context of ``harts-hf plan --model`` and the planner grid (``scripts/planner_grid.py``)."""
    from ..engine import memory_model
    from ..modeling import patch_model
    from .models import build_model

    return memory_model(patch_model(build_model(family, size).model))
