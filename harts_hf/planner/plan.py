"""``plan(forests, world_size=..., max_tokens_per_microbatch=...)``: who computes which tokens when.

A pure, deterministic function of token-id structure, world size, budget and cost model (no
torch, no torch.distributed): every rank computes the same plan and runs its own row.

1. Ranks (``assign.py``): whole subtrees to ranks, balanced on the cost model; each rank also
   recomputes the shared chains above its subtrees (the plans made here exchange only gradients
   between ranks, though the engine can hand context over: see :class:`Plan`), which is the
   plan's redundancy besides the bounded replay. Whether a tree that fits one microbatch is
   divided between ranks is the cost model's call: the plan is made under each rule of
   ``assign.BRANCH_RULES`` and the lowest predicted step time wins (an idle rank loses to a shared
   prompt recomputed on it as soon as the prompt costs less than the work it takes over).
2. Slots (``slots.py``): each rank's whole trees packed into S microbatches (``pack.py``), the
   rest of its DFS sequence cut at the cost quantiles that fill every slot (``split.py``), the
   same S on every rank (the smallest S whose microbatches all fit the budget), cuts on
   chunk-aligned depths where possible. Slot s then costs about total_r / S on every rank r.
3. Dependencies (``node_parts.py``): per microbatch, the entries (paths whose parent token ran in
   an earlier slot), the replay they add and the pieces holding their attention
   context (counted against the budget at the weight the memory model gives it: ``memory.py``).
   The handoff addresses themselves (which unit keeps each context row and boundary state) are
   compiled from the plan by ``harts_hf.schedule``.
4. Handoffs (``handoffs.py``, with ``handoffs=True``): the top chains of one rule's branches (the
   rule whose handoffs promise the lowest step) run once, in a first slot, and are handed to the
   ranks reading them where that is cheaper than recomputing them (communication priced by the
   cost model); the plan is kept if its predicted step is lower.
5. Graphs (``graphs.py``): how many last slots of each rank keep their graphs from the recording
   to their backward within the byte budget, and so are not rerun: what the predicted step charges
   a rerun for, and what the engine keeps.
6. Context-parallel groups (``groups.py``, with ``context_parallel=True``): a rank's serial pieces
   (a trajectory longer than the budget) run at once over idle ranks, or spread over the free time
   other ranks have in their slots, one slot per group, a wavefront over ``layers`` decoder layers;
   kept if its predicted step is lower. Then the root chain most ranks recompute (a system prompt)
   runs once, split over the ranks as a group in a new first slot, and is read across ranks
   (``shared_root.py``); kept if its predicted step is lower. Last, the forests' whole DFS order
   cut into one equal-cost span per (slot, rank), every slot a group over branching ranges and no
   chain recomputed (``wavefront.py``: a tree far deeper than the budget); kept if lower still. And
   the relay (``relay.py``: an agentic batch), every token once, the tops first as a group, the
   branches packed over groups of ranks and a branch cut between two ranks handed from one's early
   slot to the next's late slot; kept if lower still.

Legend: R ranks, S slots, P pieces, D dependencies, F forests, C chunk size.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..checks import require_positive_ints
from ..chunking import CHUNK_SIZE
from ..forest import RolloutForest
from ..trees import min_rounds, replay_length
from .assign import BRANCH_RULES, assign_ranks, find_branches, rank_intervals
from .balance import step_seconds
from .cost import DEFAULT_COST_MODEL, CostModel
from .geometry import Geometry
from .graphs import graph_slots
from .groups import DEFAULT_LAYERS, grouped
from .handoffs import Handed, handoff_pieces, transfers
from .memory import TOKEN_MEMORY, Budget, MemoryModel
from .node_parts import NodeParts, find_in
from .pieces import Pieces
from .planned import Plan
from .planners import ALONE, Planners
from .relay import relay_cut
from .shared_root import root_grouped
from .slots import slot_costs, slot_pieces
from .wavefront import wavefront_cut

__all__ = ["DEFAULT_MAX_TOKENS", "Plan", "as_forests", "build_plan", "plan"]

DEFAULT_MAX_TOKENS = 65_536
"""Default microbatch budget: the memory of one 64K-token sequence, what a 1-8B hybrid model
trains per H100/H200-class GPU with activation checkpointing; even with context priced as full
tokens it holds the deepest SWE-like context (32K) with room for as many own tokens."""


def as_forests(forests: RolloutForest | Sequence[RolloutForest]) -> list[RolloutForest]:
    out = [forests] if isinstance(forests, RolloutForest) else list(forests) if isinstance(forests, Iterable) else []
    if not out or not all(isinstance(f, RolloutForest) for f in out):
        raise TypeError("plan() takes a RolloutForest or a non-empty sequence of them")
    return out


def _own_on_paths(geo: Geometry, parts: NodeParts, num_mb: int) -> np.ndarray:
    """[num_mb] tokens every microbatch computes itself on its entries' root paths, which its call reads
    as its own, not as context: where a context-parallel span lands in a microbatch that computes an
    ancestor of it (its tree's root, shared with a branch the rank owns). A node part's tokens below
    the last entry of its microbatch in its subtree (``[t + 1, end of t's node)`` holds t's
    descendants) are the part's tokens on a path."""
    ext = parts.external
    stride = geo.num_tokens + 1
    entries = np.r_[-1, np.sort(parts.mb[ext] * stride + parts.lo[ext])]  # keyed by microbatch, after a sentinel
    below = parts.mb * stride + geo.end[geo.node_of(parts.lo)]  # [Q] each part's subtree end, keyed
    last = entries[np.searchsorted(entries, below) - 1] - parts.mb * stride  # < 0: none in the microbatch
    on_path = np.clip(np.minimum(parts.hi, last) - parts.lo, 0, None)
    return np.bincount(parts.mb, weights=on_path, minlength=num_mb).astype(np.int64)


def _replay(
    geo: Geometry, pieces: Pieces, parts: NodeParts, entry_parent: np.ndarray, entry_rank: np.ndarray, chunk: int
) -> int:
    """Replay the cuts add: a parent token whose microbatch holds none of its children makes one
    more path start off the chunk grid than in the unsplit rank (see ``ops/rounds.py``)."""
    stride = geo.num_tokens + 1
    key = np.unique(entry_rank * stride + entry_parent)
    rank, pt = key // stride, key % stride
    piece = pieces.locate(rank, pt)
    missing = piece < 0  # a parent another rank computes (a cross-rank handoff)
    piece[missing] = pieces.lowest_holder(pt[missing])
    mb = pieces.microbatch[piece]
    s = find_in(parts.mb * stride + parts.lo, parts.mb * stride + parts.hi, mb * stride + pt)
    has_child = np.bincount(parts.parent[parts.parent >= 0], minlength=parts.lo.size) > 0
    lonely = ~has_child[s]
    return int(replay_length(geo.token_depth(pt[lonely]) + 1, chunk).sum())


ROUNDS_WORTH_TRYING = 0.01
"""The share of the predicted step the slowest ranks' linear-attention rounds must reach before ``plan``
tries the round-charged assignment with every rank busy: below it, evening them out cannot pay for
another assignment."""


def _rounds_share(p: Plan) -> float:
    """What the slowest rank's rounds cost, summed over slots (replays counted), per predicted step."""
    rounds = step_seconds(p.cost_model.round * p.rounds, p.rerun, p.cost_model.forward_share)
    return rounds / p.step_seconds if p.step_seconds > 0 else 0.0


def _traj_rank(geo: Geometry, forests: list[RolloutForest], pieces: Pieces) -> list[np.ndarray]:
    owned = np.flatnonzero(~pieces.replica)
    order = owned[np.argsort(pieces.lo[owned], kind="stable")]
    out = []
    for f, forest in enumerate(forests):
        last = forest.restore[forest.traj_offsets[1:] - 1] + geo.forest_tokens[f]
        out.append(pieces.rank[order[find_in(pieces.lo[order], pieces.hi[order], last)]])
    return out


def plan(
    forests: RolloutForest | Sequence[RolloutForest],
    *,
    world_size: int,
    max_tokens_per_microbatch: int | None = None,
    max_bytes_per_microbatch: float | None = None,
    memory_model: MemoryModel | None = None,
    cost_model: CostModel | None = None,
    chunk_size: int = CHUNK_SIZE,
    graphs: str = "budget",
    max_host_bytes: float = 0.0,
    handoffs: bool = False,
    context_parallel: bool = False,
    layers: int = DEFAULT_LAYERS,
    planners: Planners = ALONE,
) -> Plan:
    """Plan one training step of ``forests`` (one forest or one per group; every root is a tree)
    on ``world_size`` data-parallel ranks; see the module docstring and :class:`Plan`.

    The microbatch budget is ``max_tokens_per_microbatch`` (the memory of that many own tokens)
    or ``max_bytes_per_microbatch`` (which needs ``memory_model``), not both. ``memory_model``
    prices the ancestor context a microbatch reads against its own tokens; the default,
    :data:`~.memory.TOKEN_MEMORY`, prices a context token as an own token (safe for any model:
    pass the model's, ``harts_hf.modeling.memory_model(model)``, to train trajectories longer
    than the budget). ``cost_model`` defaults to :data:`DEFAULT_COST_MODEL`. ``graphs``: which slots
    may keep their graphs besides the byte budget (``graphs.GRAPH_RULES``: the trainer's wrapper);
    ``max_host_bytes``: host memory a rank's graphs may take where the budget cannot keep them and
    the copies cost less than their rerun (``graphs.host_slots``: a GPU's host; 0, none). ``handoffs``: shared
    chains may run once and be handed to other ranks (``handoffs.py``) instead of recomputed there;
    such a plan runs only with one process per rank under torch.distributed (``harts_hf.engine``).
    ``context_parallel``: a trajectory's serial pieces may run at once over ranks with time to spare
    (``groups.py``, a wavefront over ``layers`` decoder layers; the same condition to run).
    ``planners``: the processes planning this step together (every rank of the step, each calling
    ``plan`` with the same arguments: ``planners.py``); each gets the plan one would make alone.
    """
    began = time.perf_counter()
    forests = as_forests(forests)
    require_positive_ints("plan", world_size=world_size, chunk_size=chunk_size, layers=layers)
    if max_tokens_per_microbatch is not None:
        require_positive_ints("plan", max_tokens_per_microbatch=max_tokens_per_microbatch)
    if max_bytes_per_microbatch is not None and memory_model is None:
        raise ValueError("max_bytes_per_microbatch needs the model's memory model (harts_hf.modeling.memory_model)")
    for name, value, expected in (("cost_model", cost_model, CostModel), ("memory_model", memory_model, MemoryModel)):
        if value is not None and not isinstance(value, expected):
            raise TypeError(f"{name} must be a {expected.__name__}, got {type(value).__name__}")
    cost = cost_model or DEFAULT_COST_MODEL
    memory = memory_model or TOKEN_MEMORY
    budget = memory.budget(
        max_tokens=max_tokens_per_microbatch, max_bytes=max_bytes_per_microbatch, host_bytes=max_host_bytes
    )
    digests = tuple(forest.shape_digest for forest in forests)
    planners.check_same(
        (digests, world_size, budget, memory, cost, chunk_size, graphs, handoffs, context_parallel, layers)
    )
    geo = Geometry.of(forests, cost)
    longest = int((geo.depth + geo.length).max())
    if budget.room(longest - 1) < 1:
        given = (
            f"max_tokens_per_microbatch={budget.tokens}"
            if max_bytes_per_microbatch is None
            else f"max_bytes_per_microbatch={max_bytes_per_microbatch:,.0f} ({budget.tokens} own tokens)"
        )
        raise ValueError(
            f"{given} is below the longest trajectory's need ({longest} tokens: its last token reads "
            f"{longest - 1} ancestors as context, {budget.context_weight:.3g} own-token equivalents each under "
            f"this memory model; it holds trajectories of up to {budget.longest_trajectory:,} tokens): raise the "
            "budget"
            + (
                ""
                if memory_model is not None
                else ", or pass the model's memory_model (harts_hf.engine.memory_model(model): context at its K/V)"
            )
        )

    def candidate(branches, node_extra=None) -> Plan:
        asg = assign_ranks(geo, world_size, branches, node_extra)
        iv = rank_intervals(geo, asg, world_size, budget.tokens)
        pieces = slot_pieces(geo, iv, world_size, budget, chunk_size, cost, memory, graphs)
        return build_plan(geo, forests, pieces, cost, budget, memory, chunk_size, began, world_size, graphs)

    best, tried = None, []
    for rule in BRANCH_RULES if world_size > 1 else BRANCH_RULES[:1]:
        branches = find_branches(geo, world_size, budget.tokens, rule)
        if any(np.array_equal(branches[0], seen[0]) for seen in tried):
            continue
        tried.append(branches)
        made = candidate(branches)
        if best is None or made.step_seconds < best.step_seconds:
            best, best_branches, best_extra = made, branches, None
    idle = (best.tokens.sum(axis=1) == 0).any()
    if world_size > 1 and cost.round > 0 and (idle or _rounds_share(best) >= ROUNDS_WORTH_TRYING):
        # Ranks run their branches' rounds side by side, so the balance on tokens alone fills ranks with
        # several branchy subtrees, each a round deeper than one path; charging every branch its rounds
        # spreads them over idle ranks or evens them out. Tried on the best rule's branches where a rank
        # idles or rounds weigh in the step (an assignment is most of a plan's time); kept if faster.
        node_rounds, _ = min_rounds(geo.parent)
        made = candidate(best_branches, cost.round * node_rounds)
        if made.step_seconds < best.step_seconds:
            best, best_extra = made, cost.round * node_rounds
    if context_parallel and world_size > 1:
        build = lambda pieces: build_plan(
            geo, forests, pieces, cost, budget, memory, chunk_size, began, world_size, graphs
        )
        best = grouped(best, geo, build, layers) or best
        best = root_grouped(best, geo, build, layers) or best
        cut = wavefront_cut(geo, budget, world_size, chunk_size, build, layers)
        best = cut if cut is not None and cut.step_seconds < best.step_seconds else best
        cut = relay_cut(
            geo, budget, memory, world_size, chunk_size, build, layers, cost, best.step_seconds, planners=planners
        )
        best = cut if cut is not None and cut.step_seconds < best.step_seconds else best
    if handoffs and world_size > 1:  # the best rule may differ with handoffs: every rule's branches are options
        options = [(branches, best_extra if branches is best_branches else None) for branches in tried]
        cuts = handoff_pieces(geo, options, world_size, budget, chunk_size, cost, best.step_seconds, memory, graphs)
        for pieces, handed in cuts:  # the fewest slots first; the next cut only if that one overflows
            made = build_plan(geo, forests, pieces, cost, budget, memory, chunk_size, began, world_size, graphs)
            if (made := with_transfers(made, geo, pieces, handed)) is not None:
                best = made if made.step_seconds < best.step_seconds else best
                break
    return dataclasses.replace(best, plan_seconds=time.perf_counter() - began)


def with_transfers(p: Plan, geo: Geometry, pieces: Pieces, handed: Handed) -> Plan | None:
    """``p`` (built from ``pieces``) with its cross-rank handoffs (``handoffs.transfers``) priced into
    the last slot's costs (sent once, not replayed: the slot the step counts once) and counted; None
    if a microbatch's footprint, received context included, exceeds the budget."""
    if not p.fits_budget:
        return None
    return transfers(geo, pieces, handed, p.num_slots, p.world_size, p.cost_model).onto(p)


def build_plan(
    geo: Geometry,
    forests: list[RolloutForest],
    pieces: Pieces,
    cost: CostModel,
    budget: Budget,
    memory: MemoryModel,
    chunk_size: int,
    began: float,
    world_size: int,
    graphs: str = "budget",
) -> Plan:
    """The :class:`Plan` of ``pieces`` (any rank-closed cut of the forests: ours or a baseline's):
    costs, handoffs, trajectory owners, the slots that keep their graphs under ``graphs``
    (``graphs.GRAPH_RULES``); ``plan_seconds`` counts from ``began``."""
    num_mb = world_size * pieces.num_slots
    cost_table, tokens, parts = slot_costs(geo, pieces, world_size, cost)

    ext = parts.external
    entry, entry_mb = parts.lo[ext], parts.mb[ext]
    entry_rank = entry_mb // pieces.num_slots
    context = geo.paths_union(entry, entry_mb, num_mb) - _own_on_paths(geo, parts, num_mb)

    forest_of = geo.forest_of(pieces.lo)
    shape = (world_size, pieces.num_slots)
    tokens, context = tokens.reshape(shape), context.reshape(shape)
    return Plan(
        world_size=world_size,
        num_slots=pieces.num_slots,
        budget=budget,
        memory_model=memory,
        chunk_size=chunk_size,
        cost_model=cost,
        piece_rank=pieces.rank,
        piece_slot=pieces.slot,
        piece_forest=forest_of,
        piece_start=pieces.lo - geo.forest_tokens[forest_of],
        piece_end=pieces.hi - geo.forest_tokens[forest_of],
        piece_replica=pieces.replica,
        piece_branch=pieces.branch,
        cost=cost_table.reshape(shape),
        tokens=tokens,
        context=context,
        rounds=parts.rounds.reshape(shape),
        graph_slots=graph_slots(memory, budget, tokens, context, graphs),
        traj_rank=_traj_rank(geo, forests, pieces),
        forest_digests=tuple(forest.shape_digest for forest in forests),
        num_compact_tokens=geo.num_tokens,
        replicated_tokens=int((pieces.hi - pieces.lo)[pieces.replica].sum()),
        replay_tokens=_replay(geo, pieces, parts, parts.parent_token[ext], entry_rank, chunk_size),
        plan_seconds=time.perf_counter() - began,
        graph_rule=graphs,
    )
