"""What ``harts-hf plan`` reports: the plan's numbers next to every baseline's, as JSON and a table.

Beside the baselines: the same planner with cross-rank handoffs off ("no exchange": every shared
chain recomputed on the ranks that read it) and the lower bound ``max(unique work / R, longest
path)`` (every compact token once, spread evenly; the longest trajectory alone on one rank), both
under the plan's cost model. With context-parallel groups the longest path may run as a wavefront
over every rank: that term becomes ``longest / R * (L + R - 1) / L`` over L decoder layers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..forest import RolloutForest
from ..planner.geometry import Geometry
from ..planner.plan import Plan, plan
from .baselines import EXACT_SECONDS, run_baselines

__all__ = [
    "NO_EXCHANGE",
    "PLANNERS",
    "bench_memory_model",
    "legend",
    "lower_bound",
    "no_exchange",
    "plan_record",
    "planner_entries",
    "record_table",
]

PLANNERS = {
    "harts": "ours: subtrees to ranks on the cost model, shared chains recomputed or handed over, lockstep slots",
    "per_trajectory": "no sharing (trajectory-wise training): trajectories spread over ranks",
    "trie_packing": "AReaL: tries of trajectories up to the budget; a prefix shared by two tries runs twice",
    "dfs_kcut": "AReaL-DTA: the DFS order cut into one contiguous range per rank",
    "exact": "Tree Training: CP-SAT's optimal rank assignment of our finest branches (small instances)",
}
"""One line per planner of the table and the plot (``baselines.py`` says more)."""

COLUMNS = {
    "step s": "predicted step seconds, ranks in lockstep: the sum over slots of the slowest rank, a slot whose "
    "graph the budget cannot keep again at the forward share (its replay), plus the per-step term (lower is better)",
    "slot imb": "worst slot's slowest rank / its mean rank: lockstep waiting (1 = none; lower is better)",
    "rank imb": "slowest rank's total / mean rank total (1 = even; lower is better)",
    "redundancy": "extra tokens computed per compact token: recomputed chains, replays (lower is better)",
    "plan s": "time taken to plan (lower is better)",
    "handoffs": "messages between ranks carrying handed chains (context rows and states)",
    "GB moved": "bytes those messages move, values there and gradients back",
    "xfer s": "predicted seconds the busiest rank spends on them (in step s)",
    "cp groups": "context-parallel groups: spans of one slot on several ranks (a trajectory's pieces, a shared prompt, the DFS order cut over every rank, or the relay's prompts), one slot each",
    "cp ranks": "ranks in the largest group",
}
NO_EXCHANGE = {
    "no_exchange": "harts with cross-rank handoffs and context-parallel groups off: every shared chain recomputed "
    "where it is read, every piece of a trajectory on one rank"
}
SLOTS_SHOWN = 12  # slots of harts' step printed one by one
GAP = {"gap": "harts' largest rank cost above the exact solver's proven lower bound (0% = optimal)"}


def legend(meanings: Mapping[str, str]) -> str:
    """Aligned ``name  meaning`` lines printed under a table, so its columns explain themselves."""
    width = max(map(len, meanings))
    return "\n".join(f"  {name:<{width}}  {meaning}" for name, meaning in meanings.items())


def lower_bound(forests: Sequence[RolloutForest], ours: Plan) -> dict:
    """``{"seconds", "unique_work_per_rank", "longest_path", "outside", "rerun", "with_reruns"}`` under
    ``ours``' cost model: no plan on its world size predicts a shorter step than ``seconds``, the larger
    of the two work terms plus what every step spends outside its model calls (with context-parallel
    groups the longest path's term is its wavefront over every rank, ``ours.group_layers`` layers).

    Nor, within ``ours``' budget and without graphs in host memory (``graphs.GRAPH_RULES``), than
    ``with_reruns``: a rank's kept graphs hold at most the own
    tokens of the budget's bytes less its fixed phase, so where the forests hold more than every rank
    can keep, the rest is recorded and rerun in the backward; ``rerun`` is the least that costs a
    rank (the cost model's forward share of the cheapest such tokens, the shallowest, spread evenly)."""
    geo = Geometry.of(list(forests), ours.cost_model)
    per_rank = geo.total_cost / ours.world_size
    longest = float(geo.path_cost(max(f.max_length for f in forests)))
    if ours.group_layers:
        layers, world = ours.group_layers, ours.world_size
        longest *= (layers + world - 1) / (layers * world)
    outside = ours.cost_model.outside(ours.world_size)
    memory = ours.memory_model
    kept = (float(memory(ours.budget.tokens)) - memory.fixed) / memory.token  # own tokens one rank's graphs hold
    rerun = ours.cost_model.forward_share * _cheapest(geo, geo.num_tokens - ours.world_size * kept) / ours.world_size
    return {
        "seconds": max(per_rank, longest) + outside,
        "unique_work_per_rank": per_rank,
        "longest_path": longest,
        "outside": outside,
        "rerun": rerun,
        "with_reruns": max(per_rank + rerun, longest) + outside,
    }


def _cheapest(geo: Geometry, count: float) -> float:
    """The cost of the ``count`` cheapest tokens of the forests: the shallowest (a token at depth d
    costs ``a + b (d + 1)``), counted per depth."""
    if count <= 0:
        return 0.0
    ends = geo.depth + geo.length
    per_depth = np.cumsum(
        np.bincount(geo.depth, minlength=ends.max() + 1) - np.bincount(ends, minlength=ends.max() + 1)
    )
    depth = np.arange(per_depth.size)
    taken = np.clip(count - (np.cumsum(per_depth) - per_depth), 0, per_depth)  # [D] tokens taken at each depth
    return float((taken * (geo.a + geo.b * (depth + 1))).sum())


def no_exchange(forests: Sequence[RolloutForest], ours: Plan) -> dict:
    """The record entry of ``ours``' planner with handoffs and groups off (``ours`` itself if it has none)."""
    other = ours
    if ours.handoffs or ours.groups:
        other = plan(
            forests,
            world_size=ours.world_size,
            max_tokens_per_microbatch=ours.budget.tokens,
            memory_model=ours.memory_model,
            cost_model=ours.cost_model,
            chunk_size=ours.chunk_size,
            graphs=ours.graph_rule,
            max_host_bytes=ours.budget.host_bytes,
        )
    summary = other.summary()
    keys = ("imbalance", "redundancy", "step_seconds", "plan_seconds", "handoffs", "context_parallel")
    return {k: summary[k] for k in keys}


def plan_record(forests: Sequence[RolloutForest], plan: Plan, *, exact_seconds: float = EXACT_SECONDS) -> dict:
    """``{"world_size", "slots", "pieces", "imbalance": {"slot", "rank"}, "redundancy",
    "plan_seconds", "handoffs": {"messages", "bytes", "seconds"}, "context_parallel": {"groups",
    "ranks", "bytes", "layers"}, "graphs": {"rule", "rerun", "host", "host_bytes"}, "lower_bound": {...},
    "no_exchange": {...}, "baselines": {name: {"imbalance", "redundancy", "plan_seconds", ...}}}``."""
    return {
        **plan.summary(),
        "lower_bound": lower_bound(forests, plan),
        "no_exchange": no_exchange(forests, plan),
        "baselines": run_baselines(forests, plan, exact_seconds),
    }


def planner_entries(record: dict) -> dict[str, dict]:
    """harts' entry first, then every baseline's: the rows of the table and the bars of the plot."""
    return {"harts": record, **record["baselines"]}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _by_slot(seconds: dict, shown: int = SLOTS_SHOWN) -> str:
    """Where harts' step goes: each slot's slowest rank (what the lockstep step sums) beside its mean
    rank, the first ``shown`` slots."""
    pairs = [f"{a:.3f}/{b:.3f}" for a, b in zip(seconds["slowest"], seconds["mean"])]
    more = f" ... ({len(pairs) - shown} more)" if len(pairs) > shown else ""
    return f"step by slot, slowest/mean rank (s): {' '.join(pairs[:shown])}{more}"


def record_table(record: dict) -> str:
    """One aligned row per planner (step time, slot and rank imbalance, redundancy, planning seconds), why a
    baseline was skipped and the exact solver's gap, then the legend of columns and planners."""
    rows = [
        ("planner", "step s", "slot imb", "rank imb", "redundancy", "plan s", "handoffs", "GB moved", "xfer s")
        + ("cp groups", "cp ranks")
    ]
    entries = planner_entries(record)
    if "no_exchange" in record:
        entries = {"harts": entries.pop("harts"), "no_exchange": record["no_exchange"], **entries}
    for name, e in entries.items():
        imb = e["imbalance"] or {}
        sent = e.get("handoffs") or {}
        cp = e.get("context_parallel") or {}
        rows.append(
            (
                name,
                _fmt(e["step_seconds"], ".4f"),
                _fmt(imb.get("slot"), ".4f"),
                _fmt(imb.get("rank"), ".4f"),
                _fmt(e["redundancy"], ".4f"),
                _fmt(e["plan_seconds"], ".3f"),
                _fmt(sent.get("messages"), "d"),
                _fmt(None if "bytes" not in sent else sent["bytes"] / 1e9, ".3f"),
                _fmt(sent.get("seconds"), ".4f"),
                _fmt(cp.get("groups"), "d"),
                _fmt(cp.get("ranks"), "d"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    head = f"world size {record['world_size']}: {record['slots']} slots, {record['pieces']} pieces"
    head += f"; step s from {record['step_seconds_from']}"
    bound = record.get("lower_bound")
    if bound:
        head += (
            f"\nlower bound {bound['seconds']:.4f} s = max(unique work / R {bound['unique_work_per_rank']:.4f}, "
            f"longest path {bound['longest_path']:.4f})"
            + (f" + outside the model calls {bound['outside']:.4f}" if bound.get("outside") else "")
            + f": harts at {record['step_seconds'] / bound['seconds']:.3f}x"
        )
        graphs = record.get("graphs") or {}
        if graphs.get("host"):
            head += (
                f"\ngraphs in host memory: {graphs['host']} microbatches (up to {graphs['host_bytes'] / 1e9:.1f} GB "
                f"a rank), {graphs['rerun']} rerun"
            )
        elif bound.get("rerun"):
            head += (
                f"\nwithin the budget {bound['with_reruns']:.4f} s (every rank reruns at least "
                f"{bound['rerun']:.4f} s: its kept graphs hold one budget): harts at "
                f"{record['step_seconds'] / bound['with_reruns']:.3f}x"
            )
    if "slot_seconds" in record:
        head += "\n" + _by_slot(record["slot_seconds"])
    notes = [f"{name}: {e['skipped']}" for name, e in record["baselines"].items() if "skipped" in e]
    gap = record["baselines"]["exact"].get("gap")
    if gap is not None:
        notes.append(f"gap to the exact solver's bound on the largest rank cost: {gap:.4%}")
    if "gap_skipped" in record["baselines"]["exact"]:
        notes.append(f"gap to the exact solver's bound: not shown ({record['baselines']['exact']['gap_skipped']})")
    meanings = COLUMNS | PLANNERS | (NO_EXCHANGE if "no_exchange" in record else {}) | (GAP if gap is not None else {})
    return "\n".join([head, *lines, *notes, "", legend(meanings)])


def bench_memory_model(family: str, size: str = "default"):
    """The memory model of a freshly built bench model (``harts_hf.lab.models``), patched: what prices
    the context of ``harts-hf plan --model`` and the planner grid (``scripts/planner_grid.py``)."""
    from ..engine import memory_model
    from ..modeling import patch_model
    from .models import build_model

    return memory_model(patch_model(build_model(family, size).model))
