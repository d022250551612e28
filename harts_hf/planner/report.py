"""What ``harts-hf plan`` reports: the plan's numbers next to every baseline's, as JSON and a table."""

from __future__ import annotations

from collections.abc import Sequence

from ..forest import RolloutForest
from .baselines import EXACT_SECONDS, run_baselines
from .plan import Plan

__all__ = ["plan_record", "record_table"]


def plan_record(forests: Sequence[RolloutForest], plan: Plan, *, exact_seconds: float = EXACT_SECONDS) -> dict:
    """``{"world_size", "slots", "pieces", "imbalance": {"slot", "rank"}, "redundancy",
    "plan_seconds", "baselines": {name: {"imbalance", "redundancy", "plan_seconds", ...}}}``."""
    return {**plan.summary(), "baselines": run_baselines(forests, plan, exact_seconds)}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def record_table(record: dict) -> str:
    """One aligned row per planner: slot and rank imbalance, redundancy, planning seconds."""
    rows = [("planner", "slot imb", "rank imb", "redundancy", "seconds")]
    entries = {"harts": record, **record["baselines"]}
    for name, e in entries.items():
        imb = e["imbalance"] or {}
        rows.append((
            name, _fmt(imb.get("slot"), ".4f"), _fmt(imb.get("rank"), ".4f"),
            _fmt(e["redundancy"], ".4f"), _fmt(e["plan_seconds"], ".3f"),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    head = f"world size {record['world_size']}: {record['slots']} slots, {record['pieces']} pieces"
    notes = [f"{name}: {e['skipped']}" for name, e in record["baselines"].items() if "skipped" in e]
    gap = record["baselines"]["exact"].get("gap")
    if gap is not None:
        notes.append(f"gap to the exact solver's bound on the largest rank cost: {gap:.4%}")
    return "\n".join([head, *lines, *notes])
