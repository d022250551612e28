"""The compiled schedule's mechanics: tables built on the host move to the device once, as one
graph of objects (a table reached twice is moved once), keeping what must stay on the host (fla's
``*_cpu`` fields, numpy arrays); a batch that already lives there shares its tables; a new
``state_out`` rebuilds the tables that depend on it; a batch built ahead refuses to build more."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trees import NASTY_TREES

from harts_hf.forest import RolloutForest
from harts_hf.ops.attention import AttentionBlocksTable, tree_attention
from harts_hf.ops.conv import ConvHaloTable
from harts_hf.ops.fla.waves import WavesTable, waves_of
from harts_hf.ops.rounds import ReplayTable, RoundsTable, rounds_of
from harts_hf.ops.tree_batch import MissingTable, TreeBatch
from harts_hf.planner import plan
from harts_hf.schedule import Schedule, build_tables

META = torch.device("meta")


def piece_batch() -> TreeBatch:
    forest = RolloutForest.from_sequences(NASTY_TREES["branch_at_65"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest, np.flatnonzero(forest.position >= 40))  # context: depths 0-39
    out = np.flatnonzero((batch.position.numpy() + 1) % 64 == 0)
    return batch.with_state_out({64: out[out >= batch.num_context]})


def test_to_moves_every_table_once_and_keeps_host_fields() -> None:
    batch = piece_batch()
    waves = waves_of(batch, 64, cut=True)
    q, ctx = torch.randn(batch.num_tokens, 2, 8), torch.randn(batch.num_context, 2, 8)
    tree_attention(q, q, q, batch, context_kv=(ctx, ctx), scale=1.0)  # builds its blocks, as a layer would
    moved = batch.to(META)
    assert moved.tables == batch.tables
    assert moved.position.device == META and batch.position.device.type == "cpu"
    got = moved._cache[WavesTable(64, True)]
    assert got.rounds is moved._cache[RoundsTable(64)], "an object reached twice is moved once"
    assert got.own_index.device == META and got.waves[0].gather.device == META
    assert got.waves[0].cu_seqlens.device == META and got.waves[0].cu_seqlens_cpu.device.type == "cpu"
    assert got.waves[0].h0.order.device == META and got.state_out is not None
    assert isinstance(got.state_source, np.ndarray) and got.state_source is waves.state_source
    blocks = next(v for k, v in moved._cache.items() if isinstance(k, AttentionBlocksTable))
    assert all(b.keys.device == META and b.keys.dtype == torch.int32 for b in blocks.buckets)


def test_to_the_same_device_shares_the_tables() -> None:
    batch = piece_batch()
    rounds = rounds_of(batch, 64)
    same = batch.to("cpu")
    assert same is not batch and same._cache[RoundsTable(64)] is rounds


def test_with_state_out_keeps_only_the_tables_that_do_not_depend_on_it() -> None:
    batch = piece_batch()
    rounds = rounds_of(batch, 64)
    waves_of(batch, 64, cut=True)
    again = batch.with_state_out({64: np.zeros(0, dtype=np.int64)})
    assert again.tables == {RoundsTable(64)} and again._cache[RoundsTable(64)] is rounds
    assert again.state_out[64].size == 0 and batch.state_out[64].size


def test_a_batch_built_ahead_builds_no_other_table() -> None:
    """``build_tables`` builds the declared tables (and those their builders read) and seals the
    batch: a layer reading an undeclared table fails, naming it, instead of building it mid-model."""
    built = build_tables(piece_batch(), frozenset({ReplayTable(64), ConvHaloTable(4)}), "cpu")
    assert built.tables == {RoundsTable(64), ReplayTable(64), ConvHaloTable(4)}
    assert rounds_of(built, 64) is built._cache[RoundsTable(64)]
    with pytest.raises(MissingTable, match=r"RoundsTable\(chunk_size=16\).*not built before the model ran"):
        rounds_of(built, 16)


def test_a_schedule_serves_only_its_plan_rank_tables_and_calls() -> None:
    """Another pass over the same plan reuses a schedule (``TreeEngine(schedule=...)``); anything
    that would make it another schedule compiles afresh."""
    forest = RolloutForest.from_sequences(NASTY_TREES["branch_at_65"](np.random.default_rng(0)))
    the_plan = plan(forest, world_size=2, max_tokens_per_microbatch=160)
    tables = frozenset({RoundsTable(64)})
    cpu = torch.device("cpu")
    schedule = Schedule.compile([forest], the_plan, 1, tables, cpu, calls=the_plan.unit_counts.max())
    assert schedule.serves(the_plan, 1, frozenset({RoundsTable(64)}), 0, cpu)
    replanned = plan(forest, world_size=2, max_tokens_per_microbatch=160)
    assert not schedule.serves(replanned, 1, tables, 0, cpu)  # equal, but not the plan it was compiled from
    assert not schedule.serves(the_plan, 0, tables, 0, cpu)
    assert not schedule.serves(the_plan, 1, tables | {ConvHaloTable(4)}, 0, cpu)
    assert not schedule.serves(the_plan, 1, tables, schedule.calls + 1, cpu)
    assert not schedule.serves(the_plan, 1, tables, 0, META)
    whole = Schedule.whole(forest, tables, cpu)
    assert len(whole.units) == 1 and bool(whole.owned[0].all()) and whole.calls == 1
    assert whole.pair_index[0].tolist() == list(range(whole.num_pairs[0]))
