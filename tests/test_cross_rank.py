"""Cross-rank handoffs: a unit reads its context (ancestor K/V, conv halos, recurrent states,
replay inputs) from units of other ranks, sent point to point and their gradients sent back.

The schedule names every handoff (producer rank/slot/unit -> consumer rank/slot/unit, subset,
rows); spans of one slot on several ranks form a context-parallel group, whose handoffs stream
inside the call (refused where it would wait on itself). Under ``torchrun``
(gloo, CPU; ``cross_rank_worker.py``), the log-probs and parameter gradients summed over ranks
equal the single-process engine's and the unpatched model's run trajectory by trajectory, for
hand-built plans (a chain in pieces over 2 and 3 ranks, a shared prompt computed once and its
subtrees on other ranks, a chain and a tree's trunk split into same-slot spans over 2 and 3
ranks), under gradient checkpointing, through DDP (``forward=`` / ``no_sync=``, its sync in
the last backward) and, for handoffs between slots, through FSDP2 (parameters sharded, gathered in
each call between the exchange points); under bf16 autocast they equal the same units run on one
rank. The groups run every layer kind of the families (GDN, KDA, Mamba1 and 2, lightning, conv,
full / sliding / MLA attention, Zamba2's shared block) and every recurrent kind under checkpointing.
Beside the hand-built plans, ``plan()``'s own plans of random agentic forests on 2 and 3 ranks
(``random_plan_worker.py``), a family and wrapper in turn.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from cross_rank_worker import PLANS, forest_of, piece_plan
from launch import torchrun
from random_plan_worker import cases
from tiny_models import tiny_model

from harts_hf import patch_model
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.ops.conv import ConvHaloTable
from harts_hf.ops.rounds import ReplayTable, RoundsTable
from harts_hf.schedule import Schedule

TOL = 2e-5  # fp32, as tests/test_engine.py: log-probs absolute, grads relative to the largest reference


@pytest.fixture(scope="module")
def tables():
    hf, adapter = patched_adapter(patch_model(tiny_model("qwen3_5")))  # GDN (chunk 64) + conv (width 4) + attention
    return model_tables(hf, adapter)


def _schedules(name, tables):
    world, kind, make = PLANS[name]
    _, forest = forest_of(kind)
    the_plan = make(forest)
    return (
        forest,
        the_plan,
        [Schedule.compile([forest], the_plan, r, tables, torch.device("cpu")) for r in range(world)],
    )


def _rows(transfers, subset) -> dict[tuple[int, int, int, int], int]:
    """(producer rank, slot, consumer rank, slot) -> rows of one subset."""
    t = transfers
    return {
        (int(a), int(b), int(c), int(d)): int(n)
        for a, b, c, d, s, n in zip(
            t.producer_rank, t.producer_slot, t.consumer_rank, t.consumer_slot, t.subset, t.rows
        )
        if s == subset
    }


def test_prompt_handoff_table(tables):
    """A 40-token prompt on rank 0 (slot 0), its subtrees on ranks 1 and 2 (slot 1): each reads all
    40 prompt rows, the prompt's replay (no chunk edge: every row) and its last 3 tokens as the
    width-4 conv's halo, from rank 0; calls align by slot (rank 1 pads slot 0)."""
    _, the_plan, schedules = _schedules("prompt3", tables)
    for r, s in enumerate(schedules):  # each rank's table: the handoffs it sends or receives
        ends = lambda rows, r=r: {key: n for key, n in rows.items() if r in (key[0], key[2])}
        assert _rows(s.transfers, None) == ends({(0, 0, 1, 1): 40, (0, 0, 2, 1): 40})
        assert _rows(s.transfers, ReplayTable(64)) == ends({(0, 0, 1, 1): 40, (0, 0, 2, 1): 40})
        assert _rows(s.transfers, ConvHaloTable(4)) == ends({(0, 0, 1, 1): 3, (0, 0, 2, 1): 3})
    assert [s.order for s in schedules] == [(0, -1), (-1, 0), (0, 1)]
    prompt = schedules[0].units[0]
    assert {to: rows[None].tolist() for to, rows in prompt.sends.items()} == {1: list(range(40)), 2: list(range(40))}
    assert schedules[0].exchange.grad_receive == {1: ((1, 0), (2, 0))}  # both gradients back after slot 1's replay
    assert schedules[1].exchange.receive == {0: ((0, 0),)} and schedules[1].exchange.grad_send == {1: ((0, 0),)}
    assert the_plan.context.tolist() == [[0, 0], [0, 40], [0, 40]]


def test_chain_handoff_table_has_states(tables):
    """A chain cut at depths 30 and 65 over ranks 0, 1, 2: rank 2 reads 30 context rows from rank 0
    and 35 from rank 1, and the GDN state at the 64-token chunk edge from rank 1."""
    _, _, schedules = _schedules("chain3", tables)
    transfers = schedules[2].transfers
    assert _rows(transfers, None) == {(0, 0, 2, 2): 30, (1, 1, 2, 2): 35}
    assert _rows(transfers, RoundsTable(64)) == {(1, 1, 2, 2): 1}
    assert schedules[2].exchange.grad_send == {2: ((0, 0), (1, 1))}  # one message per producer rank


def test_same_slot_spans_stream(tables):
    """Spans of one slot on ranks 0 and 1 (a context-parallel group) stream inside call 0: rank 1
    reads rank 0's 30 trunk rows, by no exchange between calls; rank 2 (slot 1) reads both, as
    before, between calls."""
    _, forest = forest_of("family")
    group = piece_plan(forest, [(0, 0, 0, 50), (1, 0, 50, 85), (2, 1, 85, 112)], 3)
    s0, s1, s2 = (Schedule.compile([forest], group, r, tables, torch.device("cpu")) for r in range(3))
    assert s0.exchange.stream_send == {0: ((1, 0),)} and s1.exchange.stream_receive == {0: ((0, 0),)}
    assert _rows(s1.transfers, None)[0, 0, 1, 0] == 30
    assert 0 not in s1.exchange.receive and not s0.exchange.grad_receive.get(0)
    assert s2.exchange.receive == {0: ((0, 0), (1, 1))} and not s2.exchange.stream_receive
    # The worker's two-group plan keeps one graph per rank: its first group runs again in the replay.
    _, _, two_groups = _schedules("cp2slots", tables)
    assert [(s.calls, s.graph_calls()) for s in two_groups] == [(2, 1), (2, 1)]
    assert all(s.exchange.stream_send or s.exchange.stream_receive for s in two_groups)


def test_refuses_groups_that_wait_on_themselves(tables):
    """A reader of another rank's tokens in a later slot, two ranks of one slot reading each other's
    tokens (a cycle inside the call: rank 0 holds the top of the caterpillar and the bottom of the
    trunk, rank 1 what lies between), or a group whose spans run at different calls (each would
    wait inside its call for the other's), is refused, by name."""
    _, forest = forest_of("family")
    later = piece_plan(forest, [(1, 0, 50, 112), (0, 1, 0, 50)], 2)
    with pytest.raises(ValueError, match="later slot"):
        Schedule.compile([forest], later, 1, tables, torch.device("cpu"))
    cycle = piece_plan(forest, [(0, 0, 0, 10), (1, 0, 10, 60), (0, 0, 60, 112)], 2)
    with pytest.raises(ValueError, match="read each other's tokens"):
        Schedule.compile([forest], cycle, 0, tables, torch.device("cpu"))
    # A group at different positions of its slot: rank 0 runs a small forest first, then its span.
    _, small = forest_of("prompt")
    n = small.num_compact_tokens
    misaligned = piece_plan([small, forest], [(0, 0, 0, n), (0, 0, n, n + 50), (1, 0, n + 50, n + 112)], 2)
    with pytest.raises(ValueError, match="another position in the slot"):
        Schedule.compile([small, forest], misaligned, 1, tables, torch.device("cpu"))


def _assert_same(ref, got, tol: float = TOL) -> None:
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=tol)
    scale = max(float(g.abs().max()) for g in ref[1])
    for r, g in zip(ref[1], got[1]):
        torch.testing.assert_close(g, r, rtol=0, atol=tol * scale)


def _named_grouped(plan_name: str) -> bool:
    """Whether a plan of the workers holds a context-parallel group (its name says so)."""
    return plan_name.startswith(("cp", "fanned", "chained"))


def _check(out, cases, grouped: Callable[[str], bool] = _named_grouped) -> list[str]:
    report = []
    for case in cases:
        family, plan_name, wrapper = case.split(":")
        saved = torch.load(out / f"{family}-{plan_name}-{wrapper}.pt")
        got = (saved["logprobs"], saved["grads"])
        assert saved["transfers"] > 0 and saved["bytes"][0] > 0 and saved["bytes"][1] > 0
        assert (saved["streams"] > 0) == grouped(plan_name)
        if wrapper == "autocast":  # bf16 K/V etc. on the wire: the same units on one rank, to fp32 summation order
            _assert_same(saved["single"], got, tol=1e-5)
        else:
            _assert_same(saved["oracle"], got)
            _assert_same(saved["single"], got)
        assert float(saved["grads"][0].abs().max()) > 0
        if wrapper == "fsdp2" and plan_name.startswith("cp"):  # its every call a group's: gathered before
            assert saved["hook_gathers"] == 0
        report.append(f"{case}: {saved['bytes'][0]:.0f} bytes of values, {saved['bytes'][1]:.0f} of gradients sent")
    return report


CASES_3 = [
    "qwen3_5:chain3:plain",  # GDN + conv + attention
    "kimi_linear:prompt3:plain",  # KDA + MLA, three convs in one mixer
    "nemotron_h:chain3:plain",  # Mamba2 (16-token chunks) + attention
    "minimax:prompt3:plain",  # lightning attention
    "qwen3_5:prompt3:checkpointing",
    "qwen3_5:chain3:autocast",  # bf16 compute, fp32 states: both dtypes on the wire
    "kimi_linear:chain3:fsdp2",  # parameters sharded: FSDP2 gathers between the exchange points
    "qwen3_5:relay3:plain",  # the relay: heads handed on between slots, rank 0 -> 1 -> 2, the prompt from slot 0
    "nemotron_h:fanned3:checkpointing",  # the relay's tops in two slots: the system prompt a group, the tasks after it
]
CASES_2 = [
    "qwen3_5:zigzag2:ddp",  # a rank reads its own earlier unit and the other rank's
    "jamba:zigzag2:plain",  # Mamba1
    "falcon_h1:prompt2:plain",  # Mamba2 beside attention in one layer
    "qwen3_5:zigzag2:fsdp2",  # FSDP2's gradient sync off in every backward but the last
    "kimi_linear:relay2:fsdp2",
    "qwen3_5:kept2:ddp",  # the relay where only the last slot keeps its graph: the earlier ones rerun
    "nemotron_h:kept2:fsdp2",
]


CP_CASES_3 = [  # context-parallel groups: spans of one slot on several ranks
    "qwen3_5:cp3:plain",  # a tree's trunk over 3 ranks: GDN + conv + attention
    "kimi_linear:cpchain3:plain",  # KDA + MLA
    "nemotron_h:cp3:plain",  # Mamba2
    "qwen3_5:cpchain3:checkpointing",
    "kimi_linear:cpchain3:fsdp2",  # parameters gathered before the group's calls, none inside
    "kimi_linear:cpchain3:checkpointing",
    "nemotron_h:cp3:checkpointing",
    "mamba2:cp3:plain",  # no attention: rank 2 reads rank 0's span as context rows no layer keeps
    "mamba:cpbranch3:plain",  # rank 2's slot-0 span reads none of the rows rank 0 streams it (its slot 2 does)
    "qwen3_5:cpbranch3:fsdp2",  # their gradients go back before rank 2's backward meets a reduce-scatter
    "qwen3_5:fanned3:plain",
    "qwen3_5:chained3:plain",  # the relay's tops as chains: a task over two ranks beside one on a third, in slot 1
    "kimi_linear:chained3:fsdp2",
    "qwen3_5:cpwave3:plain",  # plan()'s DFS cut of a deep tree: branching spans, two slots of three
    "kimi_linear:cpwave3:checkpointing",
]
CP_CASES_2 = [
    "qwen3_5:cp2slots:ddp",  # two groups, the first read by the second and replayed (the budget keeps one graph)
    "qwen3_5:cp2slots:checkpointing",  # the replay under checkpointing (a group's one call keeps its graph: cpchain3)
    "qwen3_5:cpchain2:autocast",
    "qwen3_5:cp2slots:hostgroup",  # streamed headers on a gloo group of their own, as beside NCCL
    "qwen3_5:cp2slots:fsdp2",  # FSDP2: the replayed group too, gradient sync in the last backward
    "minimax:cp2:plain",  # lightning
    "jamba:cp2:plain",  # Mamba1
    "lfm2:cp2:plain",  # conv only
    "falcon_h1:cpchain2:plain",
    "gemma2:cp2:plain",  # sliding window (24 tokens, across the span boundary) and logit softcaps
    "zamba2:cp2:plain",  # Mamba2 beside a shared attention block
    "falcon_mamba:cp2:plain",  # Mamba1 with normed B/C/dt
    "minimax:cp2:checkpointing",  # the re-stated mixer forwards under checkpointing
    "jamba:cp2:checkpointing",
    "lfm3:cp2:checkpointing",  # conv and sliding attention
    "qwen3_5:cpwave2:ddp",  # plan()'s DFS cut: reads within a slot and from the slot before, across ranks
    "nemotron_h:cpwave2:plain",
    "kimi_linear:cpwave2:fsdp2",  # the DFS cut under FSDP2: every slot a group, parameters gathered before each
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, cases",
    [(3, CASES_3), (2, CASES_2), (3, CP_CASES_3), (2, CP_CASES_2)],
    ids=["handoffs-3-ranks", "handoffs-2-ranks-ddp", "cp-groups-3-ranks", "cp-groups-2-ranks"],
)
def test_ranks_equal_the_oracles(ranks, cases, tmp_path, capsys):
    torchrun("cross_rank_worker.py", ranks, str(tmp_path), *cases, timeout=600)
    with capsys.disabled():
        print("\n" + "\n".join(_check(tmp_path, cases)))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_random_plans_equal_the_oracles(ranks, tmp_path, capsys):
    """``plan()``'s own context-parallel plans of random agentic forests (``random_plan_worker``: no
    forest or plan built for a test; relays, DFS cuts, groups and handoffs as the planner chooses
    them under random budgets, memory models, links, chunk grids and host memory, where the graphs
    the budget cannot keep then wait instead of rerunning), each on a family and wrapper
    in turn (every layer kind; plain, DDP, checkpointing, FSDP2): the log-probs and gradients equal
    the unpatched model's and the single-process engine's, values and their gradients crossed ranks,
    streamed where the plan holds a context-parallel group (``_check``)."""
    first, count = 1000 * ranks, 12
    torchrun("random_plan_worker.py", ranks, str(tmp_path), str(first), str(count), timeout=600)
    _, plans, names = cases(first, count, ranks)
    report = _check(tmp_path, names, grouped=lambda name: plans[name][2](None).groups > 0)
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_plans_are_what_the_docstrings_say():
    """The worker's plans put context on other ranks (the plan counts it) and every token once."""
    for name, (world, kind, make) in PLANS.items():
        _, forest = forest_of(kind)
        the_plan = make(forest)
        assert the_plan.world_size == world and the_plan.tokens.sum() == forest.num_compact_tokens
        assert not the_plan.piece_replica.any() and (the_plan.context.sum(axis=1) > 0).sum() >= 1, name
        assert np.all(np.diff(the_plan.piece_start[np.argsort(the_plan.piece_start)]) > 0)


def test_planner_plans_hand_nothing_between_ranks(tables):
    """plan()'s plans keep a rank's context on the rank: no transfer, no exchange, no shared pairs,
    and the calls are the units then the padding, as before cross-rank handoffs."""
    from harts_hf import plan

    _, forest = forest_of("family")
    the_plan = plan(forest, world_size=3, max_tokens_per_microbatch=forest.max_length + 8)
    for rank in range(3):
        s = Schedule.compile([forest], the_plan, rank, tables, torch.device("cpu"), calls=6)
        assert len(s.transfers) == 0 and not s.exchange and s.pair_home is None
        assert s.order == (*range(len(s.units)), *[-1] * (6 - len(s.units)))
        assert [u.number for u in s.units] == list(range(len(s.units)))


def test_needs_the_plans_process_group():
    """A plan that hands context between ranks runs one process per rank: without a process group
    the engine says so instead of recomputing or hanging."""
    from harts_hf.engine import TreeEngine

    _, forest = forest_of("prompt")
    engine = TreeEngine(patch_model(tiny_model("qwen3_5")), forest, PLANS["prompt3"][2](forest), rank=1)
    with pytest.raises(RuntimeError, match="start torch.distributed"):
        engine.logprobs()
