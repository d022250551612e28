"""Cross-rank handoffs chosen by the planner (``harts_hf/planner/handoffs.py``): a shared chain runs
once and is handed to the ranks reading it when that lowers the predicted step.

Invariants of such plans (every token owned once, recomputed copies only of the chains above the
handed ones; every read of another rank's token in a later slot; the budget holds with the
received context), the choice following the price of communication, determinism, and, under
``torchrun`` (2 ranks, gloo), the planned step trained exactly like the unpatched model and the
single-process engine (``handoff_plan_worker.py``, over ``cross_rank_worker.run_case``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from handoff_plan_worker import BUDGET, FREE_COMM, planned, tasks_forest
from launch import torchrun

from harts_hf import RolloutForest, plan
from harts_hf.planner.cost import COMM_DEFAULTS, DEFAULT_COST_MODEL, CostModel
from harts_hf.schedule import compile_rank


@pytest.fixture(scope="module")
def forest():
    return RolloutForest.from_sequences(tasks_forest())


def _owner_counts(p, forest, f: int = 0) -> np.ndarray:
    """[N] how many ranks own (not replicate) each compact token of ``forest``, the plan's forest ``f``."""
    count = np.zeros(forest.num_compact_tokens, dtype=np.int64)
    mine = p.piece_forest == f
    for s, e, replica in zip(p.piece_start[mine], p.piece_end[mine], p.piece_replica[mine]):
        count[s:e] += not replica
    return count


def _crosses(forest, p) -> bool:
    """Whether a unit of ``p`` reads context another rank computes (its schedules then share pairs)."""
    return compile_rank([forest], p, 0, frozenset(), "cpu").pair_home is not None


def _assert_valid(p, forest, budget: int) -> None:
    """Every token owned once; each piece's parent token computed on its own rank in a slot up to its
    own, or on another rank in an earlier slot; every microbatch within the budget, received context
    included."""
    assert (_owner_counts(p, forest) == 1).all()
    replicated = sum(e - s for s, e, r in zip(p.piece_start, p.piece_end, p.piece_replica) if r)
    assert replicated == p.replicated_tokens
    assert (p.budget.footprint(p.tokens, p.context) <= budget).all()
    for r, s, start in zip(p.piece_rank, p.piece_slot, p.piece_start):
        parent = forest.prev[start]
        if parent < 0:
            continue
        holds = (p.piece_start <= parent) & (parent < p.piece_end)
        mine = holds & (p.piece_rank == r) & (p.piece_slot <= s)
        theirs = holds & (p.piece_rank != r) & (p.piece_slot < s)
        assert (mine | theirs).any(), (r, s, start)


def test_handoff_plan_invariants(forest):
    """The first task's prompt runs once (slot 0) and is read on the other rank later; only the
    system prompt above it is recomputed."""
    p = planned(forest)
    assert p.handoffs > 0 and p.handoff_bytes > 0 and p.handoff_seconds == 0 and _crosses(forest, p)
    _assert_valid(p, forest, BUDGET)
    assert p.replicated_tokens <= 5  # the system prompt only
    no_exchange = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET, cost_model=FREE_COMM)
    assert p.redundancy < no_exchange.redundancy and p.step_seconds < no_exchange.step_seconds


def test_handoff_plan_invariants_on_swe_like():
    """A small swe-like batch on 4 ranks under the built-in compute costs and free communication:
    the plan hands task chains over and stays valid."""
    from harts_hf.sources import get_workload

    forest = get_workload("swe-like", scale=0.02, num_tasks=8).forest()
    cost = dataclasses.replace(DEFAULT_COST_MODEL, byte=0.0, message=0.0)
    p = plan(forest, world_size=4, max_tokens_per_microbatch=2048, cost_model=cost, handoffs=True)
    assert p.handoffs > 0 and _crosses(forest, p)
    _assert_valid(p, forest, 2048)


def test_choice_follows_the_price_of_communication(forest):
    """Free communication: the handoff; a second per byte: recompute, the plan handoffs=False makes;
    the same plan every call."""
    dear = dataclasses.replace(FREE_COMM, byte=1.0, context_bytes=1e4)
    kept = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET, cost_model=dear, handoffs=True)
    off = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET, cost_model=dear)
    assert kept.handoffs == 0 and kept.step_seconds == off.step_seconds
    assert np.array_equal(kept.piece_start, off.piece_start) and np.array_equal(kept.piece_rank, off.piece_rank)
    a, b = planned(forest), planned(forest)
    for name in ("piece_rank", "piece_slot", "piece_start", "piece_end", "piece_replica", "cost"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.handoffs > 0


def test_transfer_seconds_are_charged(forest):
    """Priced communication shows in the plan: bytes moved, values and gradients, and the seconds a
    rank spends on them added to its last slot (moved once, never replayed)."""
    priced = dataclasses.replace(FREE_COMM, byte=1e-12, message=1e-6, context_bytes=1000.0, state_bytes=5000.0)
    p = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET, cost_model=priced, handoffs=True)
    free = planned(forest)
    assert p.handoffs == free.handoffs > 0 and p.handoff_bytes > 0
    assert p.handoff_seconds > 0
    assert p.handoff_seconds == pytest.approx(float((p.cost - free.cost)[:, -1].max()))
    assert np.array_equal(p.cost[:, :-1], free.cost[:, :-1])


def test_cost_models_without_comm_terms_still_load():
    """A JSON cost model saved before handoffs (four keys) gets the built-in communication terms."""
    old = {k: v for k, v in DEFAULT_COST_MODEL.as_dict().items() if k not in COMM_DEFAULTS}
    assert CostModel(**old) == DEFAULT_COST_MODEL
    with pytest.raises(ValueError, match="finite and >= 0"):
        CostModel(**old, byte=-1.0)


def test_plan_hands_nothing_unless_asked(forest):
    p = plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET, cost_model=FREE_COMM)
    assert p.handoffs == 0 and not _crosses(forest, p)


CASES = ["qwen3_5:planned2:plain", "qwen3_5:planned2:ddp"]


@pytest.mark.slow
def test_planned_handoffs_train_exactly(tmp_path, capsys):
    """plan()'s handoff plan on two processes: log-probs and SGD gradients summed over ranks equal
    the unpatched model's trajectory by trajectory and the single-process engine's."""
    from test_cross_rank import _check

    torchrun("handoff_plan_worker.py", 2, str(tmp_path), *CASES, timeout=600)
    with capsys.disabled():
        print("\n" + "\n".join(_check(tmp_path, CASES)))


def test_report_shows_handoffs_and_no_exchange(forest, tmp_path, monkeypatch):
    """``harts-hf plan``'s record, table and plot: the handoffs, the planner without them beside it
    (slower here, recomputing the task prompt) and the lower bound."""
    import matplotlib.pyplot as plt

    from harts_hf.lab import plan_record, record_table
    from harts_hf.lab.plan_plot import plot_plan
    from harts_hf.lab.plan_report import NO_EXCHANGE

    p = planned(forest)
    record = plan_record([forest], p, exact_seconds=1)
    off = record["no_exchange"]
    assert off["handoffs"]["messages"] == 0 and off["step_seconds"] > record["step_seconds"]
    assert record["handoffs"] == {"messages": p.handoffs, "bytes": p.handoff_bytes, "seconds": p.handoff_seconds}
    bound = record["lower_bound"]
    work = max(bound["unique_work_per_rank"], bound["longest_path"])
    assert bound["seconds"] == work + bound["outside"] <= record["step_seconds"]
    lines = record_table(record).splitlines()
    harts, no_exchange = (next(row for row in lines if row.startswith(name)) for name in ("harts ", "no_exchange "))
    assert harts.split()[6] == str(p.handoffs) and no_exchange.split()[6] == "0"
    assert lines.index(no_exchange) == lines.index(harts) + 1
    assert any(row.split()[:1] == ["no_exchange"] and NO_EXCHANGE["no_exchange"][:20] in row for row in lines)
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plot_plan(p, forest, tmp_path / "plan.png", record=record, workload="tasks")
    title = kept[0].axes[0].get_title()
    assert (
        f"{p.handoffs} handoffs between ranks moving" in title
        and "no exchange: step" in title
        and "lower bound" in title
    )
    plt.close(kept[0])
