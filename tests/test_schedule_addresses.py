"""Every rank's compiled addresses, checked against a reference written from the rule alone.

``compile_rank`` resolves who reads whom over the step's units as runs and expands tokens only for
its own rank. Here, over random forests, ``plan()``'s plans (handoffs and context-parallel
groups on) and the worker's hand-built ones, every rank is compiled and every read of every unit
(each context row, conv halo, replayed token and boundary state) is followed to the rows it
gathers, through its producer's kept rows on its own rank or the block another rank sends it: it
must land on the very token it reads, kept by the unit the rule names (the reading rank's own
unit computing it, else the first by slot, then rank). Each pair is answered for by exactly one
rank that computes it, and every block a unit sends is one its reader receives.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from cross_rank_worker import PLANS, forest_of

from harts_hf import RolloutForest, plan
from harts_hf.ops.conv import ConvHaloTable
from harts_hf.ops.rounds import ReplayTable, RoundsTable, rounds_of
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.memory import MemoryModel
from harts_hf.schedule import compile_rank

TABLES = {  # a GDN and conv model's context subsets and state grids; small chunks put many states on them
    "chunk64": frozenset({RoundsTable(64), ReplayTable(64), ConvHaloTable(4)}),
    "chunks8-16": frozenset({RoundsTable(8), ReplayTable(8), RoundsTable(16), ReplayTable(16), ConvHaloTable(3)}),
    "conv4": frozenset({ConvHaloTable(4)}),  # short convs beside attention (LFM2): the halo's reach alone
}


def _random_forest(rng: np.random.Generator) -> RolloutForest:
    """Trajectories branching off random points of earlier ones (shared prompts, agent turns)."""
    seqs = [list(rng.integers(0, 50, rng.integers(5, 120)))]
    for _ in range(rng.integers(2, 16)):
        base = seqs[rng.integers(len(seqs))]
        seqs.append(base[: rng.integers(0, len(base) + 1)] + list(rng.integers(0, 50, rng.integers(1, 160))))
    return RolloutForest.from_sequences(seqs)


def _cases() -> list:
    cases = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        forest = _random_forest(rng)
        world, budget = int(rng.choice([2, 3, 4, 8])), int(rng.choice([48, 64, 96]))
        cases.append(pytest.param(forest, world, budget, id=f"random{seed}-R{world}-B{budget}"))
    for name in ("chain3", "prompt3", "zigzag2", "cp3", "cp2slots", "cpwave3", "fanned3", "relay3"):
        cases.append(pytest.param(name, None, None, id=name))
    return cases


def _plan(forest, world, budget):
    if world is None:
        _, kind, make = PLANS[forest]
        forest = forest_of(kind)[1]
        return forest, make(forest)
    return forest, plan(
        forest,
        world_size=world,
        max_tokens_per_microbatch=budget,
        memory_model=MemoryModel(token=1.0, context=0.1),  # context at a tenth of an own token, a free link:
        cost_model=dataclasses.replace(DEFAULT_COST_MODEL, byte=0.0, message=0.0),  # handoffs pay
        context_parallel=True,
        handoffs=True,
    )


def _reads(unit, key) -> np.ndarray:
    """The compact tokens ``unit`` reads for ``key``: every context row (None), a context subset's
    rows, or the tokens after which its external states on a chunk grid sit (an int: C)."""
    batch = unit.batch
    if key is None:
        rows = torch.arange(batch.num_context)
    elif isinstance(key, int):
        rows = rounds_of(batch, key).external_tokens
    else:
        rows = batch.cached(key)
    return batch.global_index[rows].numpy()


def _kept(unit, key) -> np.ndarray:
    """The compact tokens ``unit`` keeps for its readers of ``key``, in row order."""
    if isinstance(key, int):
        rows = unit.batch.state_out.get(key, np.zeros(0, dtype=np.int64))
        return unit.batch.global_index[torch.as_tensor(rows, dtype=torch.long)].numpy()
    rows = unit.export_rows.get(key)
    return unit.tokens[rows.numpy()] if rows is not None else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("tables", list(TABLES.values()), ids=list(TABLES))
@pytest.mark.parametrize(("forest", "world", "budget"), _cases())
def test_every_read_lands_on_its_token_from_the_rule_s_producer(forest, world, budget, tables):
    forest, the_plan = _plan(forest, world, budget)
    R = the_plan.world_size
    compiled = [compile_rank([forest], the_plan, r, tables, "cpu") for r in range(R)]
    cross = compiled[0].pair_home is not None
    assert all((c.pair_home is not None) == cross for c in compiled)
    unit_of = {(r if not cross else 0, u.number): (r, u) for r, c in enumerate(compiled) for u in c.units}

    # The rule, token by token: who computes what, where.
    computing: dict[int, list[tuple[int, int, int]]] = {}  # token -> (slot, rank, unit number)
    for r, c in enumerate(compiled):
        for u in c.units:
            for t in u.tokens.tolist():
                computing.setdefault(t, []).append((u.slot, r, u.number))

    def producer(t: int, rank: int) -> int:
        here = [n for _, r, n in computing[t] if r == rank]
        return here[0] if here else min(computing[t])[2]

    keys = [
        None,
        *(t for t in tables if t.context_subset),
        *(t.chunk_size for t in tables if isinstance(t, RoundsTable)),
    ]
    checked = 0
    for r, c in enumerate(compiled):
        for u in c.units:
            for key in keys:
                needed = _reads(u, key)
                gather = (u.states if isinstance(key, int) else u.context).get(key)
                if gather is None:
                    assert needed.size == 0, (r, u.number, key)
                    continue
                held, owner = [], []
                for p in gather.producers:
                    p_rank, p_unit = unit_of[0 if cross else r, p]
                    rows = _kept(p_unit, key)
                    if p_rank != r:  # the block rank p_rank sends here
                        block = p_unit.sends[r][RoundsTable(key) if isinstance(key, int) else key]
                        rows = rows[block.numpy()]
                    held.append(rows)
                    owner.append(np.full(rows.size, p))
                index = gather.index.numpy()
                np.testing.assert_array_equal(
                    np.concatenate(held)[index], needed, err_msg=f"rank {r} unit {u.number} {key}"
                )
                assert np.concatenate(owner)[index].tolist() == [producer(t, r) for t in needed.tolist()]
                checked += needed.size
    assert checked > 0

    pairs = np.flatnonzero(forest.prev >= 0)
    if cross:  # each pair on exactly one rank, one that computes it
        homes = np.stack([c.pair_home[0] for c in compiled])
        assert (homes.sum(axis=0) == 1).all()
        for r, c in enumerate(compiled):
            computed = np.concatenate([np.zeros(0, dtype=np.int64), *(u.pairs for u in c.units)])
            assert np.isin(pairs[homes[r]], computed).all()
    for r, c in enumerate(compiled):  # a block is sent where it is received, and only there
        for u in c.units:
            for to in u.sends:
                received = {
                    pu
                    for entries in (
                        *compiled[to].exchange.receive.values(),
                        *compiled[to].exchange.stream_receive.values(),
                    )
                    for pu in entries
                }
                assert (r, u.number) in received
        for entries in (*c.exchange.receive.values(), *c.exchange.stream_receive.values()):
            for peer, p in entries:
                assert r in unit_of[0, p][1].sends
