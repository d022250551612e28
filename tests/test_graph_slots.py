"""The plan's kept graphs (``planner/graphs.py``): the last slots keep their graphs while the byte
budget holds them alive together, the predicted step charges a rerun only to the slots that keep
none (at the cost model's forward share, which a cost model written before it was measured lacks),
and the planner cuts more, smaller slots where they keep more graphs and that lowers the step; no
plan within the budget predicts a step below the lower bound with the reruns the budget forces."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from test_planner_invariants import case_plan, cases

from harts_hf.lab.plan_report import lower_bound
from harts_hf.planner import Budget, CostModel, MemoryModel, plan
from harts_hf.planner.balance import FORWARD_SHARE, rank_seconds, step_seconds
from harts_hf.planner.cost import cost_origin
from harts_hf.planner.graphs import graph_excess, graph_slots, host_seconds, host_slots
from harts_hf.sources import grpo_group
from harts_hf.trainers.config import HARTSGRPOConfig

# Saved activations cheap next to one layer's backward (as under gradient checkpointing): graphs
# alive together hold more own tokens than one full microbatch.
CHECKPOINTED = MemoryModel(token=1.0, context=0.1, layer=3.0)
COST = CostModel(token=1e-4, pair=0.0, round=0.0, microbatch=1e-3, forward_share=0.4, step=0.01)


def _held(memory: MemoryModel, tokens: np.ndarray, context: np.ndarray, kept: int) -> float:
    """Bytes the last ``kept`` slots' graphs hold alive together: what they save, and the largest of
    their transient phases on top (one call at a time)."""
    n, c = tokens[-kept:], context[-kept:]
    saved = memory.token * n + memory.context * c
    phases = [float(memory(a, b)) - s for a, b, s in zip(n, c, saved) if a > 0]
    return float(saved.sum()) + max(phases, default=0.0)


@pytest.mark.parametrize(
    "memory", [CHECKPOINTED, MemoryModel(token=5.0, context=1.0, head=2.0, head_chunk=40, fixed=300)]
)
def test_graph_slots_are_the_most_last_slots_the_byte_budget_holds(memory, rng):
    """Every rank keeps the longest run of last slots whose graphs fit the budget's bytes together
    (the last whatever the budget); FSDP2's rule keeps the last only."""
    tokens = rng.integers(0, 120, (6, 5))
    context = rng.integers(0, 300, (6, 5)) * (tokens > 0)
    budget = memory.budget(max_tokens=100)
    kept = graph_slots(memory, budget, tokens, context)
    limit = float(memory(budget.tokens))
    for r, k in enumerate(kept.tolist()):
        assert 1 <= k <= 5
        assert k == 1 or _held(memory, tokens[r], context[r], k) <= limit
        assert k == 5 or _held(memory, tokens[r], context[r], k + 1) > limit
    assert (kept > 1).any() and (kept < 5).any()  # the draw exercises both sides
    np.testing.assert_array_equal(graph_slots(memory, budget, tokens, context, "last"), np.ones(6))
    # the excess of keeping every graph (what the relay takes off a rank's token cap): <= 0 exactly where all fit
    excess = graph_excess(memory, budget, tokens, context)
    np.testing.assert_allclose(excess, [_held(memory, tokens[r], context[r], 5) - limit for r in range(6)])
    np.testing.assert_array_equal(excess <= 0, kept == 5)
    with pytest.raises(ValueError, match="unknown graph rule 'all'; valid: budget, last"):
        graph_slots(memory, budget, tokens, context, "all")


def test_step_seconds_charge_a_rerun_only_to_the_slots_rerun():
    """Lockstep: per slot the slowest rank, and per slot the slowest rank's rerun (its forward share);
    by default every slot but the last is rerun."""
    cost = np.array([[0.6, 0.7, 0.2], [0.5, 0.2, 0.4]])
    rerun = np.array([[True, False, False], [True, True, False]])
    assert step_seconds(cost, rerun, 0.4) == pytest.approx(0.6 + 0.7 + 0.4 + 0.4 * (0.6 + 0.2))
    np.testing.assert_allclose(rank_seconds(cost, rerun, 0.4), [1.5 + 0.4 * 0.6, 1.1 + 0.4 * 0.7])
    assert step_seconds(cost) == pytest.approx(1.7 + FORWARD_SHARE * (0.6 + 0.7))
    assert step_seconds(cost, np.zeros_like(rerun)) == pytest.approx(1.7)


def test_a_plan_prices_the_reruns_of_the_slots_that_keep_no_graph():
    """``Plan.graph_slots`` is the rule over the plan's own microbatches, and its predicted step is
    its slots plus the forward share of every non-empty slot not kept, as each rank's seconds are,
    and the step's work outside its model calls."""
    forest = grpo_group(prompt_len=40, G=8, max_completion=40, seed=3).forest()
    for memory, graphs in ((CHECKPOINTED, "budget"), (CHECKPOINTED, "last"), (MemoryModel(1.0, 1.0), "budget")):
        p = plan(
            forest, world_size=2, max_tokens_per_microbatch=100, memory_model=memory, cost_model=COST, graphs=graphs
        )
        assert p.num_slots > 1
        np.testing.assert_array_equal(p.graph_slots, graph_slots(memory, p.budget, p.tokens, p.context, graphs))
        rerun = (np.arange(p.num_slots) < p.num_slots - p.graph_slots[:, None]) & (p.tokens > 0)
        np.testing.assert_array_equal(p.rerun, rerun)
        slowest = p.cost.max(axis=0).sum() + (0.4 * p.cost * rerun).max(axis=0).sum()
        assert p.step_seconds == pytest.approx(slowest + 0.01)
        np.testing.assert_allclose(p.rank_seconds, p.cost.sum(axis=1) + 0.4 * (p.cost * rerun).sum(axis=1) + 0.01)
        if graphs == "last":
            assert (p.graph_slots == 1).all()


def test_host_copies_add_what_their_passes_do_not_hide():
    """A graph in host memory moves what its microbatch saves there in its forward and back in its
    backward, each way at ``host_byte`` a byte: the step pays what outlasts each pass."""
    memory = MemoryModel(token=10.0, context=2.0)
    cost = dataclasses.replace(COST, host_byte=0.01)  # forward 0.4 of the seconds, backward 0.6
    tokens, context, seconds = np.array([[5, 10, 20]]), np.array([[0, 50, 0]]), np.array([[2.0, 1.0, 1.0]])
    copies = 0.01 * np.array([50.0, 200.0, 200.0])  # 0.5, 2.0 and 2.0 s each way
    want = np.maximum(copies - 0.4 * seconds, 0) + np.maximum(copies - 0.6 * seconds, 0)
    np.testing.assert_allclose(host_seconds(memory, cost, tokens, context, seconds), want)
    assert want[0, 0] == 0  # hidden by both passes
    # kept in host memory where that adds less than the rerun (0.4 of the seconds): only slot 0;
    # never the kept last slot, an empty slot, without host memory or under FSDP2's rule
    kept, host = np.array([1]), Budget(100, host_bytes=1e6)
    np.testing.assert_array_equal(host_slots(memory, cost, host, tokens, context, seconds, kept, "budget"), [[1, 0, 0]])
    assert not host_slots(memory, cost, host, tokens * [[0, 1, 1]], context, seconds, kept, "budget").any()
    assert not host_slots(memory, cost, Budget(100), tokens, context, seconds, kept, "budget").any()
    assert not host_slots(memory, cost, host, tokens, context, seconds, kept, "last").any()


def test_host_memory_takes_the_graphs_that_save_the_most_per_byte():
    """Where host memory holds only some of the graphs that would pay, a rank takes those saving the
    most seconds per byte first, while they fit together."""
    memory, cost = MemoryModel(token=10.0, context=0.0), dataclasses.replace(COST, host_byte=0.0)  # free copies
    tokens, seconds = np.array([[10, 20, 10, 30, 5]]), np.array([[1.0, 1.0, 3.0, 1.0, 1.0]])  # bytes 100 200 100 300
    pick = lambda host_bytes: host_slots(
        memory, cost, Budget(100, host_bytes=host_bytes), tokens, 0 * tokens, seconds, np.array([1]), "budget"
    )
    # saved per byte: 0.4 s a slot over 100, 200, 100 and 300 bytes; slot 2 saves 1.2 s over 100
    np.testing.assert_array_equal(pick(100.0), [[0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(pick(250.0), [[1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(pick(1000.0), [[1, 1, 1, 1, 0]])


def test_a_plan_keeps_in_host_memory_what_costs_less_than_its_rerun():
    """With host memory a plan charges its host graphs their copies instead of a rerun (a step below
    the plan without, where the copies hide); where the host link is too slow to pay, it reruns
    exactly as without. Either way no other slot changes."""
    forest = grpo_group(prompt_len=40, G=8, max_completion=40, seed=3).forest()
    options = {"world_size": 2, "max_tokens_per_microbatch": 100, "memory_model": MemoryModel(1.0, 1.0)}
    reruns = plan(forest, cost_model=COST, **options)
    assert reruns.rerun.any()
    host = plan(forest, cost_model=COST, max_host_bytes=1e6, **options)
    np.testing.assert_array_equal(host.host_graphs, reruns.rerun)
    assert not host.rerun.any() and host.host_bytes.max() > 0
    assert host.step_seconds == pytest.approx(host.cost.max(axis=0).sum() + 0.01)  # every copy hidden
    assert host.step_seconds < reruns.step_seconds
    slow = dataclasses.replace(COST, host_byte=1.0)
    too_slow = plan(forest, cost_model=slow, max_host_bytes=1e6, **options)
    assert not too_slow.host_graphs.any()
    assert too_slow.step_seconds == pytest.approx(plan(forest, cost_model=slow, **options).step_seconds)


def test_more_slots_where_they_keep_more_graphs_and_only_where_that_lowers_the_step():
    """Under a memory model whose graphs hold more than one microbatch's tokens together, the plan
    takes more, smaller slots that keep every graph (no rerun) over the fewest slots that rerun all
    but one; where a microbatch's launch costs more than the reruns it saves, the fewest slots."""
    forest = grpo_group(prompt_len=16, G=8, max_completion=40, seed=5).forest()
    options = {"world_size": 1, "max_tokens_per_microbatch": 100, "memory_model": CHECKPOINTED}
    kept = plan(forest, cost_model=COST, **options)
    fewest = plan(forest, cost_model=COST, graphs="last", **options)  # one graph whatever the slots
    assert kept.num_slots > fewest.num_slots > 1
    assert kept.graph_slots[0] > 1 and kept.step_seconds < fewest.step_seconds
    launches = CostModel(token=1e-4, pair=0.0, round=0.0, microbatch=1.0, forward_share=0.4)
    assert plan(forest, cost_model=launches, **options).num_slots == fewest.num_slots


def test_cost_model_json_round_trips_with_and_without_its_forward_share():
    """A cost model's JSON keeps its forward share and step; one written before they were measured
    reads as 1/3 (and says so) and 0; the trainer config takes the keys; a share outside (0, 1] is
    refused."""
    assert CostModel(**json.loads(json.dumps(COST.as_dict()))) == COST
    old = {"token": 1e-4, "pair": 0.0, "round": 1e-3, "microbatch": 1e-2}
    read = CostModel(**json.loads(json.dumps(old)))
    assert read.forward_share == FORWARD_SHARE and "assumed forward share of 1/3" in cost_origin(read)
    assert read.step == 0.0
    assert "forward share" not in cost_origin(COST)
    config = HARTSGRPOConfig(output_dir="unused", use_cpu=True, harts_cost_model=json.dumps(COST.as_dict()))
    assert config.harts_planner_cost_model == COST
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="forward_share"):
            CostModel(token=1e-4, pair=0.0, round=0.0, microbatch=0.0, forward_share=share)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_no_plan_within_the_budget_beats_the_bound_with_its_reruns(case):
    """``lab.plan_report.lower_bound``'s ``with_reruns`` (a rank's kept graphs hold one budget's bytes,
    so the tokens past every rank's share of them rerun a forward) stays below every plan's predicted
    step, on forests of every workload shape and budgets far below them; it is the plain bound where
    the ranks can keep everything."""
    p = case_plan(case)
    bound = lower_bound(case[0], p)
    assert bound["seconds"] <= bound["with_reruns"] <= p.step_seconds * (1 + 1e-9)
    held = (float(p.memory_model(p.budget.tokens)) - p.memory_model.fixed) / p.memory_model.token
    assert (bound["rerun"] > 0) == (p.num_compact_tokens > p.world_size * held)
