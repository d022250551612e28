"""Planning together (``harts_hf/planner/planners.py``): the processes of a step each cut a share of
the relay's orders and choose from the gathered cuts, and every one ends with the plan one process
makes alone, field by field. The planners here are threads meeting at a barrier
(``harts_hf.lab.planning``); the trainer's are its ranks, through ``accelerate.utils.gather_object``,
and ``random_plan_worker.py`` plans its random forests together on 2 and 3 gloo processes, checked
the same way."""

from __future__ import annotations

import threading

import pytest

from harts_hf.lab.plan_report import bench_memory_model
from harts_hf.lab.planning import differing_fields, plan_together, threaded_planners
from harts_hf.planner import Planners, plan, sequences
from harts_hf.planner.sequences import ORDER_TRIES
from harts_hf.sources import get_workload


@pytest.mark.parametrize(
    "scale, world_size, max_tokens, count",
    [
        pytest.param(0.5, 32, 32_768, 3, id="relay-32-ranks-3-planners"),
        pytest.param(1.0, 16, 32_768, 2, id="kept-last-slot-16-ranks-2-planners"),
        pytest.param(0.5, 32, 32_768, 6, id="more-planners-than-orders"),
    ],
)
def test_planners_together_make_the_plan_one_makes_alone(scale, world_size, max_tokens, count, monkeypatch):
    """SWE-like batches whose plan is the relay (every rank holding its graphs; or so many tokens that
    only the last slot keeps its graph, where orders are chosen by that slot's footprint), planned by
    ``count`` planners together, some with no order to cut: each gathered (the relay's orders were
    shared) and each made the plan one process makes alone."""
    if count > 3:  # more planners than orders, without as many threads
        monkeypatch.setattr(sequences, "ORDER_TRIES", 4)
    forest = get_workload("swe-like", scale=scale).forest()
    kw = {
        "world_size": world_size,
        "max_tokens_per_microbatch": max_tokens,
        "memory_model": bench_memory_model("qwen3_5", "default"),
        "context_parallel": True,
    }
    alone = plan(forest, **kw)
    assert (alone.piece_branch >= 0).any()  # the relay
    together = plan_together(forest, count, **kw)
    assert min(together.gathers) == max(together.gathers) > 0
    for got in together.plans:
        assert not differing_fields(got, alone)


def test_planners_share_the_candidates_once():
    for count in (1, 2, 3, 7, 64, 100):
        shares = [Planners(rank, count, lambda obj: [obj]).share(ORDER_TRIES) for rank in range(count)]
        assert [k for share in shares for k in share] == list(range(ORDER_TRIES))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="rank 2 is not one of 2 planners"):
        Planners(2, 2, lambda obj: [obj])


def test_planners_of_different_steps_all_refuse():
    """A rank that plans other forests or options than the others would pair its candidates with
    theirs: every planner refuses before planning, with the ranks that differ."""
    forest = get_workload("swe-like", scale=0.02, num_tasks=2).forest()
    errors = []

    def run(planners, max_tokens):
        try:
            plan(forest, world_size=4, max_tokens_per_microbatch=max_tokens, context_parallel=True, planners=planners)
        except ValueError as error:
            errors.append(str(error))

    threads = [
        threading.Thread(target=run, args=(planners, budget))
        for planners, budget in zip(threaded_planners(3), (4096, 4096, 2048))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 3 and all("planners [2] plan a different step from planner 0" in e for e in errors)
