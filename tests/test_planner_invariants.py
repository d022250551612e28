"""Plan invariants, checked against code the planner does not use: the forest's own token arrays
(prev, subtree_end, restore), ``TreeBatch.from_forest`` (context of a microbatch),
``ops.rounds.build_rounds`` (rounds) and a walk up each path (the boundary states the compiled
schedule hands between units).

Invariants: every compact token owned exactly once (copies on other ranks are replicas of
ancestors their rank needs, counted as redundancy; replays bounded by the chunk); a rank's tokens
closed under ancestors with every parent in the same or an earlier slot of that rank; equal slot
counts; every microbatch within the budget (tokens + weighted context, as TreeBatch sees it); dependencies
and boundary states from earlier slots; every trajectory whole on its loss rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_handoffs import _owner_counts
from trees import nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.ops.rounds import RoundsTable, build_rounds
from harts_hf.ops.tree_batch import TreeBatch
from harts_hf.planner import CostModel, MemoryModel, Plan, plan
from harts_hf.schedule import Unit, rank_units
from harts_hf.sources import caterpillar, deep_chain, grpo_group, random_tree


def _rank_slots(forests: list[RolloutForest], p: Plan) -> list[list[np.ndarray]]:
    """[rank][forest] -> [N] slot of each token on that rank, -1 where the rank lacks it."""
    out = [[np.full(f.num_compact_tokens, -1) for f in forests] for _ in range(p.world_size)]
    for r, s, f, a, b in zip(p.piece_rank, p.piece_slot, p.piece_forest, p.piece_start, p.piece_end):
        assert (out[r][f][a:b] == -1).all(), "pieces of one rank overlap"
        out[r][f][a:b] = s
    return out


def check_plan(forests: list[RolloutForest], p: Plan, max_tokens: int) -> None:
    R, S, C = p.world_size, p.num_slots, p.chunk_size
    assert p.cost.shape == p.tokens.shape == p.context.shape == p.rounds.shape == (R, S)
    assert ((p.piece_slot >= 0) & (p.piece_slot < S) & (p.piece_rank >= 0) & (p.piece_rank < R)).all()
    assert (p.piece_end > p.piece_start).all()
    slots = _rank_slots(forests, p)
    total_on_ranks = 0
    for f, forest in enumerate(forests):
        tree = np.cumsum(forest.prev < 0) - 1
        mine = p.piece_forest == f
        assert (tree[p.piece_start[mine]] == tree[p.piece_end[mine] - 1]).all(), "a piece spans two trees"
        assert (_owner_counts(p, forest, f) == 1).all(), "every compact token is owned exactly once"
        for r in range(R):
            slot = slots[r][f]
            on = np.flatnonzero(slot >= 0)
            total_on_ranks += on.size
            par = forest.prev[on]
            ok = (par < 0) | ((slot[np.maximum(par, 0)] >= 0) & (slot[np.maximum(par, 0)] <= slot[on]))
            assert ok.all(), "a parent is missing on its rank or runs in a later slot"
            own_r = np.zeros(forest.num_compact_tokens + 1, dtype=np.int64)
            own_r[1:] = np.cumsum(_owned_on(p, f, r, forest))
            needed = own_r[forest.subtree_end[on]] - own_r[on] > 0
            assert needed.all(), "a rank holds a token none of its owned tokens needs"
            for i in np.flatnonzero(p.traj_rank[f] == r):
                assert (slot[forest.trajectory_index(i)] >= 0).all(), "a trajectory is not whole on its loss rank"
    assert p.replicated_tokens == total_on_ranks - sum(f.num_compact_tokens for f in forests)

    entries = 0
    for r in range(R):
        units = rank_units(forests, p, r, frozenset({RoundsTable(C)}), "cpu")
        assert len(units) == p.unit_counts[r]
        entries += check_states(forests, units, C)
    assert 0 <= p.replay_tokens <= (C - 1) * entries
    for r in range(R):
        for s in range(S):
            parts = p.microbatch(r, s)
            if not parts:
                assert p.tokens[r, s] == 0 and p.cost[r, s] == 0
                continue
            own = context = rounds = 0
            for f, idx in parts:
                batch = TreeBatch.from_forest(forests[f], tokens=idx)
                nc = batch.num_context
                own += batch.position.numel() - nc
                context += nc
                ctx = batch.global_index[:nc].numpy()
                assert (slots[r][f][ctx] >= 0).all() and (slots[r][f][ctx] < s).all(), "context not from earlier slots"
                rounds = max(rounds, build_rounds(batch, C).num_rounds)
            assert p.budget.footprint(own, context) <= max_tokens, "microbatch over budget"
            assert own == p.tokens[r, s]
            assert context == p.context[r, s]
            assert rounds == p.rounds[r, s]


def check_states(forests: list[RolloutForest], units: list[Unit], C: int) -> int:
    """Every path of a unit that hangs under a context token starts on the chunk grid (depth a =
    depth - depth % C) from the state after its ancestor at depth a - 1, which the schedule takes
    from an earlier unit of the rank that returns it. Returns the number of such paths."""
    entries = 0
    by_number = {unit.number: unit for unit in units}  # producers go by their number among the step's units
    for unit in units:
        batch, nc = unit.batch, unit.batch.num_context
        prev, depth, index = batch.prev.numpy(), batch.position.numpy(), batch.global_index.numpy()
        expected = set()
        for e in np.flatnonzero((prev[nc:] >= 0) & (prev[nc:] < nc)) + nc:
            entries += 1
            aligned, x = depth[e] - depth[e] % C, e
            while aligned and depth[x] > aligned - 1:
                x = prev[x]
            if aligned:
                expected.add(int(index[x]))
        source = unit.states.get(C)
        got = set()
        if source is not None:
            assert all(q < unit.number for q in source.producers), "a state from a later unit"
            kept = np.concatenate(
                [index[:0]]
                + [by_number[q].batch.global_index.numpy()[by_number[q].batch.state_out[C]] for q in source.producers]
            )
            got = set(kept[source.index.numpy()].tolist())
            assert len(got) == source.index.numel()
        assert got == expected, f"unit {unit.index}: boundary states {sorted(got)} != {sorted(expected)}"
    return entries


def _owned_on(p: Plan, f: int, r: int, forest: RolloutForest) -> np.ndarray:
    """[N] tokens owned (not replicas) by rank r in forest f."""
    out = np.zeros(forest.num_compact_tokens, dtype=bool)
    sel = (p.piece_forest == f) & (p.piece_rank == r) & ~p.piece_replica
    for a, b in zip(p.piece_start[sel], p.piece_end[sel]):
        out[a:b] = True
    return out


@st.composite
def cases(draw) -> tuple[list[RolloutForest], int, int, int, CostModel, MemoryModel]:
    """1-3 forests of the workload shapes (random recursive trees with several roots, strict
    prefixes and duplicates; caterpillars; deep branch chains; GRPO groups), a world size, chunk,
    memory model (context from full price to free), budget just above what the longest trajectory
    needs or roomier, and cost coefficients (zeros included)."""
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    forests = []
    for k in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["random", "caterpillar", "deep", "grpo"]))
        s = seed + k
        if kind == "random":
            nodes, roots, longest = int(rng.integers(2, 40)), int(rng.integers(1, 3)), int(rng.integers(1, 90))
            w = random_tree(nodes, roots=roots, max_node_len=longest, seed=s)
        elif kind == "caterpillar":
            w = caterpillar(int(rng.integers(2, 14)), int(rng.integers(1, 70)), int(rng.integers(1, 20)), seed=s)
        elif kind == "deep":
            w = deep_chain(int(rng.integers(2, 45)), fanout=int(rng.integers(2, 4)), seed=s)
        else:
            w = grpo_group(int(rng.integers(1, 130)), G=int(rng.integers(1, 10)), seed=s)
        forests.append(w.forest())
    world = draw(st.integers(1, 5))
    chunk = draw(st.sampled_from([4, 8, 64]))
    deepest = max(f.max_length for f in forests)
    memory = MemoryModel(token=4.0, context=4.0 * draw(st.sampled_from([1.0, 0.25, 0.03, 0.0, 2.5])))
    need = int(np.ceil(memory.context / memory.token * (deepest - 1))) + 1
    budget = need + draw(st.sampled_from([0, 1, 17, deepest, 5 * deepest]))
    token, pair = draw(st.sampled_from([(1.0, 0.0), (0.0, 1.0), (1.0, 1e-3), (2e-5, 1e-9)]))
    cost = CostModel(token, pair, draw(st.sampled_from([0.0, 10.0])), draw(st.sampled_from([0.0, 5.0])))
    return forests, world, budget, chunk, cost, memory


def case_plan(case, *, world_size: int | None = None, **options) -> Plan:
    """``plan()`` of a :func:`cases` draw (on ``world_size`` ranks instead of its own, if given)."""
    forests, world, budget, chunk, cost, memory = case
    return plan(
        forests,
        world_size=world_size or world,
        max_tokens_per_microbatch=budget,
        memory_model=memory,
        cost_model=cost,
        chunk_size=chunk,
        **options,
    )


@settings(max_examples=60)
@given(cases())
def test_plan_invariants_hold_on_random_forests(case):
    check_plan(case[0], case_plan(case), case[2])


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("build", nasty_tree_params())
def test_plan_invariants_on_nasty_trees(build, chunk, world, rng):
    forest = RolloutForest.from_sequences(build(rng))
    budget = forest.max_length + 3
    p = plan(forest, world_size=world, max_tokens_per_microbatch=budget, chunk_size=chunk)
    check_plan([forest], p, budget)


def test_plan_is_deterministic():
    forests = [random_tree(60, roots=3, seed=s).forest() for s in range(3)]
    budget = max(f.max_length for f in forests) + 100
    a, b = (plan(forests, world_size=4, max_tokens_per_microbatch=budget) for _ in range(2))
    assert a.num_slots > 1 and a.context.sum() > 0
    names = ("piece_rank", "piece_slot", "piece_forest", "piece_start", "piece_end", "cost", "context")
    for name in names:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_small_trees_stay_whole():
    """Many GRPO groups, each a small part of a slot: nearly every group whole, and a cut one (the
    last to fit its slot) stays on its rank: the slots come out balanced."""
    forests = [grpo_group(int(40 + 7 * s % 50), G=4, max_completion=30, seed=s).forest() for s in range(150)]
    budget = 20 * max(f.num_compact_tokens for f in forests)
    p = plan(forests, world_size=3, max_tokens_per_microbatch=budget)
    check_plan(forests, p, budget)
    pieces = np.bincount(p.piece_forest, minlength=len(forests))
    assert p.num_slots > 1 and (pieces > 1).mean() <= 0.05
    assert all(np.unique(p.piece_rank[p.piece_forest == f]).size == 1 for f in range(len(forests)))
    assert not p.piece_replica.any() and p.redundancy == 0.0 and p.slot_imbalance < 1.02


def test_trees_as_large_as_a_slot_are_cut_only_for_balance():
    """Groups about half a slot each: most stay whole, the ones that would overflow their slot are
    cut on the chunk grid (same rank, earlier slots first); no group is spread over ranks."""
    rng = np.random.default_rng(1)
    sizes = [(int(rng.integers(50, 300)), rng.integers(20, 400, 6)) for _ in range(40)]
    forests = [grpo_group(prompt, completion_lens=done, seed=s).forest() for s, (prompt, done) in enumerate(sizes)]
    budget = 2 * max(f.num_compact_tokens for f in forests)
    p = plan(forests, world_size=4, max_tokens_per_microbatch=budget, chunk_size=16)
    check_plan(forests, p, budget)
    per_forest = np.bincount(p.piece_forest, minlength=len(forests))
    assert (per_forest == 1).mean() >= 0.3 and p.redundancy < 0.01
    assert all(np.unique(p.piece_rank[p.piece_forest == f]).size == 1 for f in range(len(forests)))
    assert p.slot_imbalance < 1.05


def test_oversize_tree_is_cut_into_ordered_pieces():
    """A caterpillar larger than the budget on one rank: cut into slots whose boundary states and
    replays come from earlier slots."""
    forest = caterpillar(40, 200, 30, seed=1).forest()
    budget = forest.max_length + 300
    p = plan(forest, world_size=1, max_tokens_per_microbatch=budget, chunk_size=64)
    check_plan([forest], p, budget)
    assert p.num_slots >= 2 and any(u.states for u in rank_units([forest], p, 0, frozenset({RoundsTable(64)}), "cpu"))
    assert p.replicated_tokens == 0 and p.redundancy < 0.01


def test_shared_prompt_is_recomputed_not_exchanged():
    """Two big groups under one prompt on two ranks: each rank computes the prompt itself."""
    w = grpo_group(prompt_len=50, completion_lens=[400, 380, 420, 390], seed=3)
    forest = w.forest()
    p = plan(forest, world_size=2, max_tokens_per_microbatch=forest.max_length + 10)
    check_plan([forest], p, forest.max_length + 10)
    assert p.replicated_tokens == 50 and p.rank_imbalance < 1.1


def test_budget_below_the_longest_trajectory_is_refused():
    forest = caterpillar(4, 30, 5).forest()
    with pytest.raises(ValueError, match="longest trajectory"):
        plan(forest, world_size=2, max_tokens_per_microbatch=forest.max_length - 1)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"world_size": 0, "max_tokens_per_microbatch": 10}, id="no-ranks"),
        pytest.param({"world_size": 1, "max_tokens_per_microbatch": 0}, id="no-budget"),
        pytest.param({"world_size": 1, "max_tokens_per_microbatch": float("nan")}, id="nan-budget"),  # never fills
        pytest.param({"world_size": 1, "max_tokens_per_microbatch": 100.5}, id="fractional-budget"),
        pytest.param({"world_size": 1.5, "max_tokens_per_microbatch": 100}, id="fractional-ranks"),
        pytest.param({"world_size": True, "max_tokens_per_microbatch": 100}, id="bool-ranks"),
        pytest.param({"world_size": "2", "max_tokens_per_microbatch": 100}, id="text-ranks"),
        pytest.param({"world_size": 1, "max_tokens_per_microbatch": 100, "chunk_size": 2.5}, id="fractional-chunk"),
    ],
)
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError, match="positive integer"):
        plan(grpo_group().forest(), **bad)


def test_plan_refuses_what_is_not_a_forest_or_a_cost_model():
    with pytest.raises(TypeError, match="RolloutForest"):
        plan([[1, 2, 3]], world_size=1, max_tokens_per_microbatch=10)
    with pytest.raises(TypeError, match="RolloutForest"):
        plan(None, world_size=1, max_tokens_per_microbatch=10)
    with pytest.raises(TypeError, match="CostModel"):
        plan(grpo_group().forest(), world_size=1, max_tokens_per_microbatch=100, cost_model={"token": 1.0})
    with pytest.raises(ValueError, match="numbers"):
        CostModel(token="1e-5", pair=0.0, round=0.0, microbatch=0.0)


@pytest.mark.parametrize(
    ("seqs", "budget", "slots"),
    [
        pytest.param([list(range(100, 112)), [*range(100, 111), 7, 8, 9, 10]], 15, 2, id="sibling-past-the-budget"),
        pytest.param([[1, 2, 3], [1, 2, 4], [5]], 3, 3, id="budget-of-the-longest"),
    ],
)
def test_no_idle_slots_and_no_more_than_greedy_when_quantiles_never_fit(seqs, budget, slots):
    """Where no quantile cut fits the budget the plan takes the greedy count of slots (capped cuts
    used to add slots one at a time, 6 for 2 here), and no slot is empty on every rank."""
    forest = RolloutForest.from_sequences(seqs)
    p = plan(forest, world_size=1, max_tokens_per_microbatch=budget)
    check_plan([forest], p, budget)
    assert p.num_slots == slots
    assert (p.tokens.sum(axis=0) > 0).all()


@settings(max_examples=200)
@given(
    st.floats(1.0, 1e3),
    st.one_of(st.just(0.0), st.floats(1e-6, 1e3)),
    st.floats(0.0, 1e3),
    st.integers(0, 400),
    st.floats(0.0, 1e5),
    st.floats(0.0, 1e3),
    st.integers(1, 500),
    st.floats(0.0, 1.0),
)
def test_a_microbatch_within_the_budget_is_within_its_bytes(token, context, head, chunk, fixed, layer, tokens, share):
    """Any (own, context) the Budget admits peaks at most at the bytes of the full budget without
    context, whichever phase (LM head chunk or layers' backward) holds the peak where."""
    memory = MemoryModel(token, context, head, chunk, fixed, layer)
    budget = memory.budget(max_tokens=tokens)
    own = np.arange(1, tokens + 1)
    ctx = np.floor((tokens - own) * share / max(budget.context_weight, 1e-12)) if budget.context_weight else own * 0
    assert (budget.footprint(own, ctx) <= tokens + 1e-9).all()
    assert (memory(own, ctx) <= memory(tokens) * (1 + 1e-9) + 1e-6).all()
    assert memory.budget(max_bytes=float(memory(tokens))).tokens == tokens
    if (longest := budget.longest_trajectory) is not None:  # the last token of the longest still fits
        assert budget.room(longest - 1) >= 1 > budget.room(longest)
