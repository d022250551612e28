"""The planner's targets on the SWE-like workload at scale 1 (~985 trajectories, ~4M compact
tokens in one tree: every trajectory shares the 10K-token system prompt), ranks 1/2/4/8, the
default budget: slot imbalance <= 1.05, rank imbalance <= 1.03, redundancy <= 0.02, and better
slot balance than every baseline at equal or lower redundancy. Planning time is a benchmark
(``harts-hf plan`` prints it, ``scripts/compile_time.py``), not an assertion: a loaded machine
failed it (2.3 s against 1 s) with nothing wrong."""

from __future__ import annotations

import pytest

from harts_hf.lab.baselines import dfs_kcut, exact, per_trajectory, trie_packing
from harts_hf.planner import DEFAULT_COST_MODEL, DEFAULT_MAX_TOKENS, plan
from harts_hf.sources import get_workload


@pytest.fixture(scope="module")
def swe():
    return [get_workload("swe-like", scale=1.0).forest()]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_targets_at_scale_one(swe, world):
    assert 900 <= swe[0].num_trajectories <= 1100 and swe[0].num_compact_tokens > 3_000_000
    p = plan(swe, world_size=world, max_tokens_per_microbatch=DEFAULT_MAX_TOKENS)
    assert p.slot_imbalance <= 1.05 and p.rank_imbalance <= 1.03
    assert p.redundancy <= 0.02
    assert (p.tokens + p.context).max() <= DEFAULT_MAX_TOKENS
    args = (swe, world, p.budget, DEFAULT_COST_MODEL)
    for name, b in {
        "per_trajectory": per_trajectory(*args),
        "trie_packing": trie_packing(*args),
        "dfs_kcut": dfs_kcut(*args, p.chunk_size, p.memory_model),
    }.items():
        record = b.record()
        assert p.redundancy <= record["redundancy"], name
        if world > 1:
            assert p.slot_imbalance < record["imbalance"]["slot"], name


@pytest.mark.slow
def test_rank_balance_is_near_the_proven_optimum(swe):
    """Two ranks: CP-SAT proves its assignment optimal; ours is within 0.01% of it."""
    p = plan(swe, world_size=2, max_tokens_per_microbatch=DEFAULT_MAX_TOKENS)
    b = exact(swe, 2, p.budget, DEFAULT_COST_MODEL, p.chunk_size, p.memory_model, seconds=30)
    assert b.extra["optimal"]
    cm = p.cost_model
    ours = (p.cost - cm.round * p.rounds - cm.microbatch * (p.tokens > 0)).sum(axis=1).max()
    assert ours <= b.extra["rank_cost_bound"] * 1.0001
