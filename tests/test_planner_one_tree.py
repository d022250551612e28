"""One tree, several ranks: the planner divides a tree that fits one microbatch when that lowers
the predicted step time (a shared prefix recomputed on a second rank beats an idle rank).

A generation batch whose rows all share a system prompt is one tree; before this rule it ran on one
rank while the others idled. Oracles: the plan the planner makes when trees stay whole (its own
rule before), and the longest trajectory computed alone (no plan of any rank count is faster).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_invariants import check_plan

from harts_hf import RolloutForest
from harts_hf.planner import plan
from harts_hf.sources import caterpillar, grpo_group, random_tree, swe_like

BUDGET = 65_536
WORLDS = (2, 4, 8)


def agentic_rows(tasks: int, *, system_len: int, seed: int, episodes: int = 4, turns: int = 3) -> list[list[int]]:
    """The recipe's rows: a system prompt, tasks, and per-turn samples (history + this turn's
    reasoning and call; later turns drop the reasoning), so the whole batch is one tree."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(10, 30_000, n).tolist()

    system, rows = tokens(system_len), []
    for _ in range(tasks):
        task = system + tokens(int(rng.integers(10, 60)))
        for _ in range(episodes):
            history = list(task)
            for _ in range(turns):
                reasoning, call, result = tokens(16), tokens(int(rng.integers(5, 15))), tokens(int(rng.integers(5, 40)))
                rows.append(history + reasoning + call)
                history = history + call + result
    return rows


def one_tree(shape: str, world: int, seed: int) -> RolloutForest:
    """A one-tree forest of at least 4 trajectories per rank."""
    rng = np.random.default_rng([seed, world])
    n = 4 * world + int(rng.integers(0, 3 * world))
    if shape == "agentic":
        return RolloutForest.from_sequences(
            agentic_rows(-(-n // 12), system_len=int(rng.integers(20, 2000)), seed=seed)
        )
    if shape == "grpo":
        return grpo_group(
            prompt_len=int(rng.integers(5, 3000)), G=n, max_completion=int(rng.integers(5, 500)), seed=seed
        ).forest()
    if shape == "random":
        longest, nodes = int(rng.integers(5, 400)), int(1.5 * n) + 2
        while (
            forest := random_tree(num_nodes=nodes, roots=1, max_node_len=longest, seed=seed).forest()
        ).num_trajectories < n:
            nodes += world
        return forest
    if shape == "swe-task":
        return swe_like(scale=0.01, num_tasks=1, seed=seed).forest()
    if shape == "caterpillar":
        return caterpillar(n, int(rng.integers(5, 300)), int(rng.integers(5, 300)), seed=seed).forest()
    raise ValueError(shape)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shape", ["agentic", "grpo", "random", "swe-task"])
def test_one_tree_is_divided_between_ranks(shape, world):
    for seed in range(6):
        forest = one_tree(shape, world, seed)
        assert forest.num_trajectories >= 4 * world and forest.num_compact_tokens <= BUDGET  # fits one microbatch
        p = plan(forest, world_size=world, max_tokens_per_microbatch=BUDGET)
        check_plan([forest], p, BUDGET)
        rows = np.bincount(p.traj_rank[0], minlength=world)
        assert (rows > 0).all(), f"{shape} seed {seed}: rows per rank {rows.tolist()}"
        assert p.rank_imbalance <= 1.15, f"{shape} seed {seed}: rank imbalance {p.rank_imbalance:.3f}"
        alone = plan(forest, world_size=1, max_tokens_per_microbatch=BUDGET)
        assert p.step_seconds < alone.step_seconds


def _step_alone(rows: list[np.ndarray]) -> float:
    return (
        plan(RolloutForest.from_sequences(rows), world_size=1, max_tokens_per_microbatch=BUDGET).step_seconds
        if rows
        else 0.0
    )


def test_a_caterpillar_on_two_ranks_gets_the_best_split_of_its_rows():
    """A rank holding a deep leaf computes the trunk above it, so a caterpillar cannot be balanced
    (rank imbalance is no goal here); on two ranks the plan's step equals the best of every split of
    the rows into two sets (brute force, each set's step predicted alone)."""
    for seed in range(4):
        forest = caterpillar(9, 10 + 40 * seed, 30 + 20 * seed, seed=seed).forest()
        rows = [forest.trajectory(i) for i in range(forest.num_trajectories)]
        n = len(rows)
        best = min(
            max(
                _step_alone([r for i, r in enumerate(rows) if m >> i & 1]),
                _step_alone([r for i, r in enumerate(rows) if not m >> i & 1]),
            )
            for m in range(2 ** (n - 1))
        )
        p = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET)
        assert p.step_seconds <= best * 1.02, f"seed {seed}: {p.step_seconds} vs the best split {best}"


@pytest.mark.parametrize("world", WORLDS[1:])
def test_a_caterpillar_on_more_ranks_is_near_its_lower_bound(world):
    """No plan beats the deepest trajectory alone or the whole tree's work spread evenly."""
    for seed in range(6):
        forest = one_tree("caterpillar", world, seed)
        p = plan(forest, world_size=world, max_tokens_per_microbatch=BUDGET)
        check_plan([forest], p, BUDGET)
        deepest = int(np.argmax(np.diff(forest.traj_offsets)))
        whole = _step_alone([forest.trajectory(i) for i in range(forest.num_trajectories)])
        bound = max(_step_alone([forest.trajectory(deepest)]), whole / world)
        assert p.step_seconds <= min(1.25 * bound, whole), f"seed {seed}: {p.step_seconds} vs bound {bound}"


def test_a_long_prompt_is_recomputed_only_when_that_pays():
    """Two ranks, a prompt far longer than the completions: the cost model compares recomputing the
    prompt on the second rank with leaving it idle, and the predicted step is the better of the two."""
    forest = grpo_group(prompt_len=5000, completion_lens=[3] * 8, seed=0).forest()
    p = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET)
    alone = plan(forest, world_size=1, max_tokens_per_microbatch=BUDGET)
    assert p.step_seconds <= alone.step_seconds
    short = grpo_group(prompt_len=20, completion_lens=[300] * 8, seed=0).forest()
    q = plan(short, world_size=2, max_tokens_per_microbatch=BUDGET)
    assert q.replicated_tokens == 20 and np.bincount(q.traj_rank[0]).tolist() == [4, 4]
