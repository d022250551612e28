"""The relay (``harts_hf/planner/relay.py``): every token once, the tops first as a group, the branches
packed over groups of ranks, a branch cut between two ranks handed from one's early slot to the next's
late slot.

Its parts (the packing evens groups within their token caps; a sequence's ranges keep the caps and cover
it), its invariants on random forests of every workload shape (every compact token owned once, no
replica, the budget holds, every same-slot read from a lower rank, every rank's units compile) and
its choice (an agentic batch at 32 ranks: kept by ``plan()``, no recomputed chain, lower than the
rank-wise plan). Exactness under ``torchrun`` is in ``test_cross_rank.py`` (``relay2``, ``relay3``:
heads handed on between slots under DDP-free, checkpointed and FSDP2 runs; ``kept2``: only the last
slot keeps its graph, under DDP and FSDP2).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from cross_rank_worker import fanned_plan, forest_of, relay_plan
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_handoffs import _owner_counts
from test_planner_invariants import cases

from harts_hf import RolloutForest, plan
from harts_hf.lab.plan_report import bench_memory_model
from harts_hf.ops.rounds import RoundsTable
from harts_hf.planner import relay, sequences
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.memory import MemoryModel
from harts_hf.planner.plan import build_plan
from harts_hf.planner.relay import GROUP_RANKS, _chained_tops, _even_tops, _fanned_tops, _pack, relay_cut
from harts_hf.planner.sequences import ORDER_MARGIN, Branches, Sequences, _count_up_to, ordered_cuts, slotted
from harts_hf.schedule import rank_units
from harts_hf.sources import get_workload


def _segments() -> tuple[RolloutForest, Geometry, Branches]:
    """The relay forest, its geometry and its six segments under the prompt as branches."""
    _, forest = forest_of("relay")
    geo = Geometry.of([forest], DEFAULT_COST_MODEL)
    roots = np.flatnonzero(geo.parent == 0)
    lo, hi = geo.start[roots], geo.end[roots]
    return forest, geo, Branches(lo, hi, geo.prefix(hi) - geo.prefix(lo), hi - lo)


def _swe_like(world_size: int, max_tokens: int) -> dict:
    """``plan`` keywords for SWE-like batches: the Qwen3.5 bench memory model, context parallel."""
    return {
        "world_size": world_size,
        "max_tokens_per_microbatch": max_tokens,
        "memory_model": bench_memory_model("qwen3_5", "default"),
        "context_parallel": True,
    }


def test_packing_evens_the_groups_within_their_caps():
    """Twelve branches over a group of 2 ranks and one of 3: the load per rank evens out to within
    the smallest branch, and no group holds more tokens than its cap."""
    rng = np.random.default_rng(0)
    cost = rng.uniform(1, 10, 12)
    tokens = rng.integers(50, 150, 12)
    b = Branches(np.arange(12) * 200, np.arange(12) * 200 + tokens, cost, tokens)
    widths = np.array([2, 3])
    cap = np.array([2, 3]) * tokens.sum() / 4.6
    where = _pack(b, widths, np.zeros(2), cap)
    load = np.bincount(where, weights=cost, minlength=2) / widths
    assert load.max() - load.min() <= cost.min()
    assert (np.bincount(where, weights=tokens, minlength=2) <= cap).all()


def test_ranges_keep_the_caps_and_cover_the_sequence():
    """A sequence of the relay forest's six segments cut over three ranks: every range within its cap,
    the ranges end to end over the whole sequence; uncapped, the costs even out (to the chunk grid). Cut
    beside other groups' sequences (the segments in other orders, over two ranks), a group's cuts are
    what they are alone."""
    _, geo, b = _segments()
    seq = Sequences.of(geo, b, [np.arange(b.lo.size)], 4)  # cuts on a 4-token grid
    total, three = int(seq.end[0]), np.array([3])
    free = seq.ranges(np.zeros((1, 3)), np.full((1, 3), np.inf), three)
    costs = np.diff(seq.cost_to(free))
    assert free[0, 0] == 0 and free[0, -1] == total and costs.max() < 1.1 * costs.min()
    cap = np.array([[80, 200, 200]])
    capped = seq.ranges(np.zeros((1, 3)), cap, three)
    assert capped[0, 0] == 0 and capped[0, -1] == total and (np.diff(capped) <= cap).all()
    orders = [np.arange(b.lo.size), np.arange(b.lo.size)[::-1], np.arange(3)]
    sequences = Sequences.of(geo, b, orders, 4)
    side = sequences.ranges(np.zeros((3, 3)), np.repeat(cap, 3, axis=0), np.array([3, 2, 2]))
    assert np.array_equal(side[0], capped[0])
    for g, order in enumerate(orders[1:], 1):
        alone = Sequences.of(geo, b, [order], 4).ranges(np.zeros((1, 2)), cap[:, :2], np.array([2]))
        assert np.array_equal(side[g], np.r_[alone[0], alone[0, -1]])


@pytest.mark.parametrize("seed", range(6))
def test_orders_keep_the_least_spilling_then_the_least_loaded(seed, monkeypatch):
    """Groups of three of the relay forest's segments cut over two or three ranks under token caps that
    bind: each group's order is the best of all six (spilling least, then loading its busiest rank
    least); under some caps that is not the DFS order (the order decides how far the uncapped ranks
    fill)."""
    _, geo, b = _segments()
    rng = np.random.default_rng(seed)
    members = [np.sort(rng.choice(b.lo.size, 3, replace=False)) for _ in range(6)]
    width = rng.integers(2, 4, len(members))
    extra = rng.uniform(0, 0.3, (len(members), 3)) * b.cost.mean()
    cap = np.stack([rng.uniform(1.02, 1.4, 3) * b.tokens[m].sum() / w for m, w in zip(members, width)])
    ends = np.array([b.cost.mean() * 0.7])
    seq, cuts, orders = ordered_cuts(geo, b, members, extra, cap, width, ends, 4, list(range(len(members))))

    def score(order, g):
        one, (e, c, w) = Sequences.of(geo, b, [order], 4), (x[g : g + 1] for x in (extra, cap, width))
        cut = one.ranges(e, c, w)
        return np.inf if one.inside(cut)[0] else one.spill(cut, ends)[0], one.load(cut, e, w)[0]

    lighter = 0
    for g, m in enumerate(members):
        assert np.array_equal(orders[g], np.searchsorted(b.lo, seq.lo[g, : m.size]))
        spill, load = score(orders[g], g)  # the order kept
        assert (spill, load) == min(score(np.array(order), g) for order in itertools.permutations(m))
        assert (np.diff(cuts[g, : width[g] + 1]) <= cap[g, : width[g]] + 1e-9).all()
        lighter += load < score(m, g)[1]
    assert lighter > 0

    # a group's last order stays unless another spills less or loads the margin less; another
    # group's branches leave the choice as it was
    others = lambda g: (np.array(o) for o in itertools.permutations(members[g]) if list(o) != orders[g].tolist())
    spills_as = lambda o, g: score(o, g)[0] == score(orders[g], g)[0]
    last = [min(others(g), key=lambda o: (not spills_as(o, g), score(o, g)[1])) for g in range(len(members))]
    last[-1] = np.r_[last[-1], np.setdiff1d(np.arange(b.lo.size), members[-1])[:1]]
    stayed = 0
    for margin in (ORDER_MARGIN, 0.5):
        monkeypatch.setattr(sequences, "ORDER_MARGIN", margin)
        _, _, again = ordered_cuts(geo, b, members, extra, cap, width, ends, 4, list(range(len(members))), last)
        assert np.array_equal(again[-1], orders[-1])
        for g in range(len(members) - 1):
            (spill, load), best = score(last[g], g), score(orders[g], g)
            stays = spill <= best[0] and load <= best[1] * (1 + margin)
            assert np.array_equal(again[g], last[g] if stays else orders[g])
            stayed += stays and not np.array_equal(last[g], orders[g])
    assert stayed > 0


def test_a_rank_runs_its_densest_branches_last():
    """Six segments in a sequence cut over two ranks inside the fourth: each rank runs the head it
    hands on first and the tail it reads last, between them its whole branches in sequence order,
    or ``densest_last`` by cost per token (where only the last slot keeps its graph, it then holds
    the most cost its bytes allow)."""
    _, geo, b = _segments()
    order = np.array([4, 0, 2, 3, 5, 1])
    seq = Sequences.of(geo, b, [order], 4)
    cuts = np.array([[0, seq.at[0, 3] + b.tokens[3] // 2, seq.end[0]]])  # inside branch 3
    by_density = lambda whole: sorted(whole, key=lambda u: b.cost[u] / b.tokens[u])
    assert by_density([4, 0, 2]) != [4, 0, 2] and by_density([5, 1]) != [5, 1]
    for densest_last in (False, True):
        _, rank, piece_lo, _ = seq.parts(cuts, np.array([2]), densest_last)
        branch = (np.searchsorted(b.lo, piece_lo, side="right") - 1).tolist()
        runs = [[4, 0, 2], [5, 1]]
        if densest_last:
            runs = [by_density(run) for run in runs]
        assert branch == [3, *runs[0], *runs[1], 3] and rank.tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_the_kept_footprint_is_the_built_last_slot():
    """Six segments in two orders, each cut over three ranks and each rank's run into two slots
    (whole branches densest last): the footprint ``kept_footprint`` gives each order's fullest last
    slot is the one its built plan prices (own tokens and context), and the orders differ in it."""
    forest, geo, b = _segments()
    memory = MemoryModel(token=1.0, context=0.1)
    budget = memory.budget(max_tokens=4096)
    orders, width = [np.arange(6), np.array([4, 0, 2, 3, 5, 1])], np.array([3, 3])
    seq = Sequences.of(geo, b, orders, 4)
    cuts = seq.ranges(np.zeros((2, 3)), np.full((2, 3), np.inf), width)
    ends = np.array([0.55 * b.cost.sum() / 3])
    footprint = seq.kept_footprint(cuts, width, ends, budget)
    prompt = (np.array([0]), np.array([0]), geo.start[:1], geo.start[:1] + geo.length[:1])  # the tops, slot 0
    for g in range(2):
        _, rank, piece_lo, piece_hi = seq.select(np.array([g])).parts(cuts[g : g + 1], width[g : g + 1], True)
        rank, slot, piece_lo, piece_hi = slotted(geo, rank, piece_lo, piece_hi, ends, 4)
        branch = np.searchsorted(b.lo, piece_lo, side="right") - 1
        pieces = relay._pieces(geo, (rank, slot, piece_lo, piece_hi, branch), prompt, 2)
        built = build_plan(geo, [forest], pieces, DEFAULT_COST_MODEL, budget, memory, 4, time.perf_counter(), 3)
        assert footprint[g] == budget.footprint(built.tokens[:, -1], built.context[:, -1]).max()
    assert footprint[0] != footprint[1]


def test_the_kept_last_slot_fills_the_budget():
    """SWE-like rollouts on 16 ranks, 32K-token microbatches: every rank holds far more than its
    graphs can keep, so only its last slot keeps its graph and every earlier slot reruns. The
    relay's last slot fills the budget on its fullest rank (its shares follow the room each slot
    leaves), and it predicts a lower step than with slots of equal cost or with whole branches
    in sequence order."""
    forest = get_workload("swe-like").forest()
    kw = _swe_like(16, 32_768)
    kept = plan(forest, **kw)
    assert (kept.piece_branch >= 0).any() and (kept.graph_slots == 1).all() and kept.num_slots > 3
    footprint = kept.budget.footprint(kept.tokens[:, -1], kept.context[:, -1])
    assert 0.99 * kept.budget.tokens <= footprint.max() <= kept.budget.tokens
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(relay, "_kept_shares", lambda made, shares, first: shares)
        assert plan(forest, **kw).step_seconds > kept.step_seconds
    with pytest.MonkeyPatch.context() as patch:
        parts = Sequences.parts
        patch.setattr(Sequences, "parts", lambda self, cuts, width, densest_last: parts(self, cuts, width))
        assert plan(forest, **kw).step_seconds > kept.step_seconds


def test_a_group_is_cut_on_its_own():
    """SWE-like rollouts of two tasks on 16 ranks (four groups): lowering the caps of one group's
    ranks and cutting again changes that group's pieces alone, and cutting only that group gives
    the same pieces and order (the relay re-cuts only the groups whose caps a repair lowers, the
    others kept as cut: a group's pieces depend on its own branches, ranks, caps and order)."""
    forest = get_workload("swe-like", num_tasks=2, scale=0.25).forest()
    world, chunk = 16, 64
    geo = Geometry.of([forest], DEFAULT_COST_MODEL)
    budget = bench_memory_model("qwen3_5", "default").budget(max_tokens=forest.num_compact_tokens // world)
    b, _ = relay._split(geo, world, budget)
    widths = relay._widths(world)
    cap = np.full(world, budget.tokens * 1.0)
    where = _pack(b, widths, np.zeros(widths.size), np.full(widths.size, np.inf))
    cut = lambda cap, last, redo=None: relay._branch_rows(
        geo, b, widths, where, np.zeros(world), cap, np.full(2, 0.5), chunk, last, None, redo
    )
    (rows, orders), group = cut(cap, {}), lambda rows: rows[0] // GROUP_RANKS
    lowered = np.where(np.arange(world) // GROUP_RANKS == 1, 0.8 * cap, cap)
    again, again_orders = cut(lowered, orders)
    alone, alone_orders = cut(lowered, orders, np.arange(widths.size) == 1)
    pick = lambda rows, g: np.stack([column[group(rows) == g] for column in rows])
    assert not np.array_equal(pick(rows, 1), pick(again, 1)) and np.array_equal(pick(again, 1), np.stack(alone))
    assert list(alone_orders) == [1] and np.array_equal(alone_orders[1], again_orders[1])
    for g in (0, 2, 3):
        assert np.array_equal(pick(rows, g), pick(again, g)) and np.array_equal(orders[g], again_orders[g])


@pytest.mark.parametrize("seed", range(5))
def test_rows_are_searched_on_their_own(seed):
    """Every row of a sorted table (repeats, a padded tail, ints and floats) searched at once, each
    query against its own row only: numpy's searchsorted row by row."""
    rng = np.random.default_rng(seed)
    for table in (np.sort(rng.integers(0, 30, (7, 12)), axis=1), np.sort(rng.random((7, 12)).round(1), axis=1)):
        y = np.concatenate((table[:, rng.integers(0, 12, 5)], rng.uniform(-1, 31, (7, 5))), axis=1)
        for strict, side in ((False, "right"), (True, "left")):
            rowwise = np.stack([np.searchsorted(row, q, side=side) for row, q in zip(table, y)])
            assert np.array_equal(_count_up_to(table, y, strict), rowwise)


@pytest.mark.parametrize("layout", [_even_tops, _fanned_tops, _chained_tops])
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_relays_hold_on_random_forests(layout, case):
    """Wherever it makes a plan, with either layout of the tops: every compact token owned once by
    one piece (no replica), every microbatch within the budget, every rank's units compile (each
    read from an earlier slot or from a lower rank of its own slot: ``compile_rank`` refuses any
    other)."""
    forests, world, budget, chunk, cost, memory = case
    world = max(world, 2)
    geo = Geometry.of(forests, cost)
    budget = memory.budget(max_tokens=budget)
    build = lambda pieces: build_plan(geo, forests, pieces, cost, budget, memory, chunk, time.perf_counter(), world)
    _assert_holds(relay_cut(geo, budget, memory, world, chunk, build, 4, cost, layouts=(layout,)), forests, chunk)


def _assert_holds(p, forests, chunk: int) -> None:
    """A relay, where ``relay_cut`` made one: every compact token of ``forests`` owned once by one
    piece (no replica), every microbatch within the budget, every rank's units compile."""
    if p is None:
        return
    assert not p.piece_replica.any() and p.fits_budget
    assert all((_owner_counts(p, forest, f) == 1).all() for f, forest in enumerate(forests))
    for r in range(p.world_size):
        assert len(rank_units(forests, p, r, frozenset({RoundsTable(chunk)}), "cpu")) == p.unit_counts[r]


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    tasks=st.integers(1, 6),
    world=st.integers(3, 16),
    budget=st.sampled_from([512, 1024, 2048]),
    scale=st.sampled_from([0.01, 0.02, 0.04]),
)
def test_fanned_relays_hold_on_agentic_batches(seed, tasks, world, budget, scale):
    """The fanned layout over every rank on small SWE-like batches (the random forests above seldom
    have tops in two levels; these mostly do): wherever the relay makes a plan, every compact token
    owned once, no replica, the budget holds, every rank's units compile."""
    forest = get_workload(
        "swe-like", scale=scale, seed=seed, num_tasks=tasks, group_size=4, turns_mean=16, turns_max=30
    ).forest()
    memory, chunk = MemoryModel(token=1.0, context=0.1), 64
    geo, budget = Geometry.of([forest], DEFAULT_COST_MODEL), memory.budget(max_tokens=budget)
    build = lambda pieces: build_plan(
        geo, [forest], pieces, DEFAULT_COST_MODEL, budget, memory, chunk, time.perf_counter(), world
    )
    p = relay_cut(
        geo, budget, memory, world, chunk, build, 4, DEFAULT_COST_MODEL, layouts=(_fanned_tops,), top_ranks=(world,)
    )
    _assert_holds(p, [forest], chunk)


def test_fanned_tops_spread_the_prompt_every_rank_reads():
    """A 4,096-token system prompt above 32 task prompts of 256 tokens, each above two segments, on
    64 ranks, the tops over 16: every top token once; the system prompt, which all 64 ranks read,
    split in slot 0 over more ranks than the even cut gives it; each task prompt, read by a few,
    whole on one rank in slot 1."""
    rng = np.random.default_rng(0)
    tokens = lambda n: rng.integers(3, 30_000, n).tolist()
    system, rows = tokens(4096), []
    for _ in range(32):
        task = system + tokens(256)
        rows += [task + tokens(int(n)) for n in rng.integers(1_000, 3_000, 2)]
    forest = RolloutForest.from_sequences(rows)
    geo = Geometry.of([forest], DEFAULT_COST_MODEL)
    tops = np.flatnonzero(geo.level <= 1)  # the system prompt, then the tasks
    rank, slot, lo, hi = _fanned_tops(geo, tops, 16, 64, 64, DEFAULT_COST_MODEL, 4)
    order = np.argsort(lo)
    assert (hi[order][:-1] <= lo[order][1:]).all() and (hi - lo).sum() == geo.length[tops].sum()
    assert np.isin(geo.node_of(lo), tops).all()
    in_system = hi <= 4096
    assert (slot[in_system] == 0).all() and (slot[~in_system] == 1).all()
    even_rank, _, _, even_hi = _even_tops(geo, tops, 16, 64, 64, DEFAULT_COST_MODEL, 4)
    assert np.unique(rank[in_system]).size > np.unique(even_rank[even_hi <= 4096]).size
    task_of = geo.node_of(lo[~in_system])
    assert np.unique(task_of).size == 32 and all(np.unique(rank[~in_system][task_of == t]).size == 1 for t in task_of)


@pytest.mark.parametrize("ranks", [16, 4])
def test_chained_tops_run_each_task_on_ranks_of_its_own(ranks):
    """A 4,096-token system prompt above six tasks, each a 256-token prompt and a trunk of 512-4,096
    tokens its three segments share, on 64 ranks: every top token once; the system prompt in slot
    0 over as many spans as the model has layers; in slot 1 each task (prompt and trunk) on ranks
    of its own in DFS order, the longest on the most (over 16 ranks), or each whole on one rank
    where the tasks outnumber the ranks (over 4)."""
    rng = np.random.default_rng(1)
    tokens = lambda n: rng.integers(3, 30_000, n).tolist()
    system, rows, trunks = tokens(4096), [], [512, 4096, 1024, 2048, 768, 3072]
    for n in trunks:
        trunk = system + tokens(256) + tokens(n)
        rows += [trunk + tokens(int(k)) for k in rng.integers(500, 1_500, 3)]
    forest = RolloutForest.from_sequences(rows)
    geo = Geometry.of([forest], DEFAULT_COST_MODEL)
    tops = np.flatnonzero(geo.level <= 1)  # the system prompt, then each task's prompt and trunk
    assert tops.size == 7
    rank, slot, lo, hi = _chained_tops(geo, tops, ranks, 64, 64, DEFAULT_COST_MODEL, 4)
    order = np.argsort(lo)
    assert (hi[order][:-1] <= lo[order][1:]).all() and (hi - lo).sum() == geo.length[tops].sum()
    in_system = hi <= 4096
    assert (slot[in_system] == 0).all() and (slot[~in_system] == 1).all()
    assert np.unique(rank[in_system]).size == 4
    task = geo.node_of(lo[~in_system])
    held = {int(t): np.unique(rank[~in_system][task == t]) for t in np.unique(task)}
    if ranks == 4:
        assert all(h.size == 1 for h in held.values()) and np.unique(np.concatenate(list(held.values()))).size == 4
        return
    assert np.unique(np.concatenate(list(held.values()))).size == 16 == sum(h.size for h in held.values())
    by_length = sorted(held, key=lambda t: geo.length[t])
    assert held[by_length[-1]].size == max(h.size for h in held.values()) > held[by_length[0]].size
    for t in held:  # along the DFS order, up the ranks: each span reads lower ranks only
        mine = task == t
        assert (np.diff(rank[~in_system][mine][np.argsort(lo[~in_system][mine])]) >= 0).all()


@pytest.mark.slow
def test_each_tops_layout_runs_its_own_passes(monkeypatch):
    """SWE-like rollouts of 16 tasks on 256 ranks: ``plan()`` predicts the lowest step any one tops
    layout reaches alone (each runs its passes with the extra its own holders' sends price), here
    the chained layout's, its tasks' tops in slot 1 on more ranks than there are tasks."""
    forest = get_workload("swe-like", num_tasks=16).forest()
    kw = _swe_like(256, 65_536)
    both = plan(forest, **kw)
    alone = {}
    for layout in relay.TOP_LAYOUTS:
        monkeypatch.setattr(relay, "TOP_LAYOUTS", (layout,))
        alone[layout.__name__] = plan(forest, **kw).step_seconds
    assert both.step_seconds == alone["_chained_tops"] < min(alone["_even_tops"], alone["_fanned_tops"])
    in_slot1 = (both.piece_branch < 0) & (both.piece_slot == 1)
    assert np.unique(both.piece_rank[in_slot1]).size > 16


@pytest.mark.slow
def test_the_relay_tries_slot_counts_side_by_side(monkeypatch):
    """SWE-like rollouts of 16 tasks on 256 ranks: ``plan()`` predicts the lowest step any one count
    of branch slots reaches alone, here three, not the fewest the budget allows (two): with more
    slots, more of the branches cut between two ranks hand their heads on between slots rather
    than stream them within one."""
    forest = get_workload("swe-like", num_tasks=16).forest()
    kw = _swe_like(256, 65_536)
    kept, passes, alone = plan(forest, **kw), relay._passes, {}
    for count in range(2, 2 + relay.SLOT_TRIES):
        monkeypatch.setattr(relay, "_passes", lambda *a, n=count: passes(*a[:4], range(n, n + 1), *a[5:]))
        alone[count] = plan(forest, **kw).step_seconds
    branch_slots = kept.num_slots - kept.piece_slot[kept.piece_branch < 0].max() - 1
    assert branch_slots == 3 and kept.step_seconds == alone[3] < min(alone[2], alone[4])


def test_plan_keeps_the_relay_on_an_agentic_batch():
    """SWE-like rollouts (5 tasks, 40 episodes) at half length on 32 ranks: the rank-wise plan
    recomputes the task prompts and split segments (redundancy > 0.1); ``plan()`` keeps the relay,
    which computes every token once (its tops, the system and task prompts, in the first slots, on
    ranks spread over the groups: no group holds two) and predicts a lower step."""
    forest = get_workload("swe-like", scale=0.5).forest()
    kw = {
        "world_size": 32,
        "max_tokens_per_microbatch": 32_768,
        "memory_model": bench_memory_model("qwen3_5", "default"),
    }
    rank_wise, kept = plan(forest, **kw), plan(forest, context_parallel=True, **kw)
    assert rank_wise.redundancy > 0.1
    assert kept.step_seconds < rank_wise.step_seconds
    assert not kept.piece_replica.any() and kept.redundancy < 0.01  # replays only
    tops = kept.piece_branch < 0
    assert kept.piece_slot[tops].max() < kept.piece_slot[~tops].min()
    holders = np.unique(kept.piece_rank[tops])
    assert holders.size > 1 and np.unique(holders // GROUP_RANKS).size == holders.size
    assert kept.handoffs > 0


def test_the_worker_fans_the_tops():
    """The cross-rank worker's fanned relay on three ranks: the system prompt over all three in slot
    0, each task prompt over two ranks in slot 1, the segments in slots 2 and 3, every token once."""
    _, forest = forest_of("fanned")
    p = fanned_plan(forest, 3)
    system = p.piece_end <= 60
    assert p.num_slots == 4 and (p.piece_slot[system] == 0).all() and (p.piece_slot[~system] > 0).all()
    assert sorted(p.piece_rank[system].tolist()) == [0, 1, 2]
    tasks = (p.piece_branch < 0) & ~system
    assert (p.piece_slot[tasks] == 1).all() and (p.piece_slot[p.piece_branch >= 0] >= 2).all()
    node = Geometry.of([forest], DEFAULT_COST_MODEL).node_of(p.piece_start[tasks])
    assert [np.unique(p.piece_rank[tasks][node == v]).size for v in np.unique(node)] == [2, 2]
    assert (p.piece_end - p.piece_start).sum() == forest.num_compact_tokens


def test_the_worker_relays_hand_heads_on():
    """The cross-rank worker's relays: every segment cut between two ranks has its head in slot 1 and
    its tail, on the next rank, in slot 2; the prompt alone in slot 0 on rank 0."""
    _, forest = forest_of("relay")
    for world in (2, 3):
        p = relay_plan(forest, world)
        assert p.num_slots == 3 and p.groups == 0
        assert p.piece_start[p.piece_slot == 0].tolist() == [0] and p.piece_rank[p.piece_slot == 0].tolist() == [0]
        branch = p.piece_branch
        for u in np.unique(branch[branch >= 0]):
            ranks = np.unique(p.piece_rank[branch == u])
            if ranks.size == 2:  # cut between two ranks: the first's head before the next's tail
                head = (branch == u) & (p.piece_rank == ranks[0])
                tail = (branch == u) & (p.piece_rank == ranks[1])
                assert ranks[1] == ranks[0] + 1 and p.piece_slot[head].max() < p.piece_slot[tail].min()
        assert (np.bincount(branch[branch >= 0]) > 0).all()


def test_the_worker_keeps_the_last_slot():
    """The worker's relay under a 100-token budget (``kept2``: a rank holds twice what it keeps):
    three branch slots after the prompt's, only the last keeps its graph, filled to the budget on
    its fullest rank, and every earlier one that holds tokens reruns."""
    _, forest = forest_of("relay")
    p = relay_plan(forest, 2, 100)
    assert p.num_slots == 4 and (p.graph_slots == 1).all() and p.rerun[:, 1:-1].all()
    assert 0.99 * p.budget.tokens <= p.budget.footprint(p.tokens[:, -1], p.context[:, -1]).max() <= p.budget.tokens
