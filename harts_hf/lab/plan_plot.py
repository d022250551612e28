"""The plan's PNG: every rank's slots on a lockstep timeline, pieces coloured by tree, and the
baselines' balance beside it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..forest import RolloutForest
from ..planner.cost import cost_origin
from ..planner.plan import Plan, as_forests
from .plan_report import planner_entries

__all__ = ["plot_plan"]

SHARED_GREY = (0.35, 0.35, 0.35, 1.0)


def _first_fork(forest: RolloutForest) -> np.ndarray:
    """First DFS token of every branch at the first fork of a one-root forest (the root if none)."""
    parent = forest.node_parent
    children = np.bincount(parent[parent >= 0], minlength=forest.num_nodes)
    node = 0
    while children[node] == 1:  # DFS pre-order: a node's first child comes right after it
        node += 1
    return forest.node_start[np.flatnonzero(parent == node)] if children[node] else forest.roots


def _piece_trees(plan: Plan, forests: Sequence[RolloutForest]) -> tuple[np.ndarray, int, bool]:
    """[P] tree of every piece (numbered over all forests), the number of trees, and whether they are
    branches: a lone tree (swe-like's system prompt roots everything) is coloured by the branches at
    its first fork, a piece of the chain above them with the first. A piece never spans two trees."""
    lone = len(forests) == 1 and forests[0].roots.size == 1
    starts = [_first_fork(forests[0])] if lone else [f.roots for f in forests]
    offsets = np.cumsum([0] + [s.size for s in starts])
    tree = np.empty(plan.num_pieces, dtype=np.int64)
    for f, s in enumerate(starts):
        mine = plan.piece_forest == f
        tree[mine] = offsets[f] + np.maximum(np.searchsorted(s, plan.piece_start[mine], side="right") - 1, 0)
    return tree, int(offsets[-1]), lone and starts[0].size > 1


def _handed(plan: Plan) -> str:
    """The title's lines on cross-rank handoffs and context-parallel groups (nothing without them)."""
    out = ""
    if plan.handoffs:
        out += (
            f"\n{plan.handoffs} handoffs between ranks moving {plan.handoff_bytes / 1e9:.3g} GB "
            f"({plan.handoff_seconds:.3g} s on the busiest rank)"
        )
    if plan.groups:
        out += (
            f"\n{plan.groups} context-parallel groups of up to {plan.group_ranks} ranks moving "
            f"{plan.group_bytes / 1e9:.3g} GB (wavefronts over {plan.group_layers} layers)"
        )
    return out


def _versus(record: dict) -> str:
    """The title's last line: the planner without handoffs and the lower bound, from ``record``."""
    off, bound = record.get("no_exchange"), record.get("lower_bound")
    words = (
        [] if off is None else [f"no exchange: step {off['step_seconds']:.3g} s, redundancy {off['redundancy']:.4f}"]
    )
    if bound is not None:
        words.append(
            f"lower bound max(unique work / R, longest path) + outside the model calls {bound['seconds']:.3g} s"
        )
    return "; ".join(words)


def _timeline(ax, plan: Plan, forests: Sequence[RolloutForest], workload: str) -> tuple[str, list]:
    """One row per rank; slot s starts when the slowest rank finished slot s - 1 (ranks run in
    lockstep), so idle time shows as gaps. A microbatch's width is its predicted cost, shared among
    its pieces by tokens. Returns the legend's title and handles."""
    from matplotlib import colormaps
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    start = np.concatenate(([0.0], np.cumsum(plan.cost.max(axis=0))))[:-1]  # [S] lockstep slot starts
    mb = plan.piece_rank * plan.num_slots + plan.piece_slot
    size = (plan.piece_end - plan.piece_start).astype(np.float64)
    mb_tokens = np.bincount(mb, weights=size, minlength=plan.cost.size)
    width = plan.cost.ravel()[mb] * size / mb_tokens[mb]
    before = np.cumsum(width) - width  # pieces run in (rank, slot, DFS) order
    first = np.searchsorted(mb, mb)  # first piece of each piece's microbatch
    left = start[plan.piece_slot] + before - before[first]

    tree, num_trees, branches = _piece_trees(plan, forests)
    palette = [colormaps["tab10"](i) for i in range(10) if i != 7]  # tab10's grey marks shared chains
    color = [
        SHARED_GREY if u < 0 else palette[t % len(palette)] for t, u in zip(tree.tolist(), plan.piece_branch.tolist())
    ]
    ax.barh(plan.piece_rank, width, left=left, height=0.8, color=color, edgecolor="white", linewidth=0.2)
    rep = plan.piece_replica
    ax.barh(plan.piece_rank[rep], width[rep], left=left[rep], height=0.8, fill=False, hatch="///", linewidth=0)
    for x in start[1:]:
        ax.axvline(x, color="black", linewidth=0.3, alpha=0.4)
    ax.set_yticks(range(plan.world_size), [f"rank {r}" for r in range(plan.world_size)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds (slots in lockstep)")
    trajectories = sum(f.num_trajectories for f in forests)
    ax.set_title(
        f"{workload}: {trajectories} trajectories, {plan.num_compact_tokens:,} compact tokens, budget "
        f"{plan.budget.tokens:,} tokens per microbatch\n{plan.world_size} ranks x {plan.num_slots} slots, "
        f"{plan.num_pieces} pieces: predicted step "
        f"{plan.step_seconds:.3g} s, slot imbalance {plan.slot_imbalance:.4f}, rank imbalance "
        f"{plan.rank_imbalance:.4f}, redundancy {plan.redundancy:.4f}{_handed(plan)}\n"
        f"seconds from {cost_origin(plan.cost_model)}",
        fontsize=9,
    )
    title = "colour = tree" + (": a branch below the root chain every trajectory shares" if branches else "")
    if num_trees > len(palette):
        title, colours = f"{title}, cycled over {num_trees} trees", []
    else:
        colours = [Patch(color=palette[t], label=f"tree {t}") for t in range(num_trees)]
    return title, colours + [
        Patch(
            color=SHARED_GREY, label="shared chain: recomputed on every rank that needs it, or run once and handed over"
        ),
        Patch(facecolor="white", edgecolor="black", hatch="///", label="replica: tokens owned by another rank"),
        Line2D([], [], color="black", linewidth=0.5, alpha=0.6, label="slot boundary (ranks wait for the slowest)"),
    ]


def _imbalance(over: str) -> Callable[[dict], float | None]:
    """A record entry's imbalance over ``over`` ("slot" or "rank"; None for a skipped baseline)."""
    return lambda entry: None if entry["imbalance"] is None else entry["imbalance"][over]


PANELS: dict[str, tuple[Callable[[dict], float | None], float]] = {
    "predicted step seconds, ranks in lockstep (lower is better)": (lambda entry: entry["step_seconds"], 0.0),
    "slot imbalance (1 = even; lower is better)": (_imbalance("slot"), 1.0),
    "rank imbalance (1 = even; lower is better)": (_imbalance("rank"), 1.0),
    "redundancy: extra tokens per token (lower is better)": (lambda entry: entry["redundancy"], 0.0),
}
"""The baselines' panels: title -> (the number of a planner's record entry, its best value)."""


def _panel(ax, record: dict, title: str) -> None:
    """Horizontal bars of every planner's number, from its best value (a skipped baseline says so)."""
    value_of, best = PANELS[title]
    entries = planner_entries(record)
    names, values = list(entries), [value_of(e) for e in entries.values()]
    y = np.arange(len(names))
    shown = [i for i, v in enumerate(values) if v is not None]
    ax.barh(
        y[shown],
        [values[i] - best for i in shown],
        left=best,
        height=0.6,
        color=["#dd8452" if names[i] == "harts" else "#4c72b0" for i in shown],
    )
    for i, v in enumerate(values):
        ax.annotate(
            "skipped" if v is None else f"{v:.4f}",
            (best if v is None else v, i),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(best, best + 1.3 * max((values[i] - best for i in shown), default=0) + 1e-3)  # room for labels
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=8)


def plot_plan(
    plan: Plan,
    forests: RolloutForest | Sequence[RolloutForest],
    path: str | Path,
    record: dict | None = None,
    workload: str = "forest",
) -> None:
    """Draw ``plan`` of ``forests`` (named ``workload`` in the title, with its size and the budget)
    to ``path``: the lockstep timeline per rank with a legend of what colours, grey and hatching
    mean; with ``record`` (:func:`~harts_hf.planner.plan_record`), every
    planner's imbalances and redundancy beside it, so the plan is read against the baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = max(0.5 * plan.world_size + 2.6, 4.8 if record is None else 6.0)
    if record is None:
        fig, ax = plt.subplots(figsize=(11, height), dpi=120)
    else:
        fig, axes = plt.subplot_mosaic(
            [["plan", title] for title in PANELS], figsize=(14, height), dpi=120, width_ratios=[3.2, 1]
        )
        ax = axes["plan"]
        for title in PANELS:
            _panel(axes[title], record, title)
    colour_title, handles = _timeline(ax, plan, as_forests(forests), workload)
    if record is not None and (versus := _versus(record)):
        ax.set_title(f"{ax.get_title()}\n{versus}", fontsize=9)
    fig.legend(
        handles=handles, title=colour_title, loc="lower center", ncol=4, fontsize=8, title_fontsize=8, frameon=False
    )
    rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, (0.3 + 0.2 * rows) / height, 1, 1))  # room for the legend (inches / height)
    fig.savefig(path)
    plt.close(fig)
