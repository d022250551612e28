"""What a step spends outside its model calls (``CostModel.outside``): the host work on one rank
(``step``), what planning over several ranks adds (``step_ranks``) and the gradient all-reduce
(``grad_bytes`` over a ring at the communication terms' prices); priced alike by a plan, its ranks
and the baselines; optional in a cost model's JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import tiny_model

from harts_hf.lab.baselines import per_trajectory
from harts_hf.lab.calibrate import format_cost_model, gradient_bytes
from harts_hf.planner import CostModel, plan
from harts_hf.planner.balance import rank_seconds, step_seconds
from harts_hf.planner.cost import cost_origin
from harts_hf.sources import grpo_group
from harts_hf.trainers.config import HARTSGRPOConfig

COST = CostModel(
    token=1e-4,
    pair=0.0,
    round=0.0,
    microbatch=1e-3,
    byte=1e-9,
    message=1e-4,
    forward_share=0.4,
    step=0.01,
    step_ranks=0.008,
    grad_bytes=2e6,
)


def test_outside_is_host_work_then_a_ring_all_reduce_over_several_ranks():
    """One rank: the host work alone. R ranks: the multi-rank planning on top, and each rank sends
    2 (R - 1) / R of the gradient bytes in 2 (R - 1) messages."""
    assert COST.outside(1) == 0.01
    for ranks in (2, 3, 8):
        ring = 2 * (ranks - 1)
        assert COST.outside(ranks) == pytest.approx(0.018 + 1e-9 * 2e6 * ring / ranks + 1e-4 * ring)
    with pytest.raises(ValueError, match="at least one rank"):
        COST.outside(0)


@pytest.mark.parametrize(
    "terms",
    [
        pytest.param({}, id="calibrated"),
        pytest.param({"step_ranks": 0.0}, id="no-multi-rank-planning"),
        pytest.param({"grad_bytes": 0.0, "message": 0.0}, id="free-gradient-sync"),
    ],
)
def test_outside_never_falls_as_ranks_are_added(terms):
    """More ranks never make a step's work outside its model calls cheaper: the ring's bytes per rank
    and its messages only grow with R; more gradient bytes or a dearer byte cost more."""
    cost = CostModel(**{**COST.as_dict(), **terms})
    seconds = [cost.outside(r) for r in range(1, 65)]
    assert (np.diff(seconds) >= 0).all() and seconds[-1] > seconds[0]
    heavier = CostModel(**{**cost.as_dict(), "grad_bytes": 4e6, "byte": 2e-9})
    assert heavier.outside(4) >= cost.outside(4) and heavier.outside(1) == cost.outside(1)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_ranks_and_baselines_add_the_same_outside_seconds(world_size):
    """A plan's predicted step and each rank's seconds are their model calls (lockstep slots and
    reruns) plus ``outside(R)``; a baseline's table is priced the same way at its R."""
    forest = grpo_group(prompt_len=40, G=8, max_completion=40, seed=3).forest()
    p = plan(forest, world_size=world_size, max_tokens_per_microbatch=100, cost_model=COST)
    calls = step_seconds(p.cost, p.rerun, COST.forward_share)
    assert p.step_seconds == pytest.approx(calls + COST.outside(world_size))
    np.testing.assert_allclose(
        p.rank_seconds, rank_seconds(p.cost, p.rerun, COST.forward_share) + COST.outside(world_size)
    )
    base = per_trajectory([forest], world_size, p.budget, COST)
    assert base.cost.shape[0] == world_size
    assert base.step_seconds == pytest.approx(
        step_seconds(base.cost, share=COST.forward_share) + COST.outside(world_size)
    )


def test_cost_model_json_round_trips_with_and_without_the_outside_terms():
    """The new terms survive JSON and the trainer config; a cost model written before them reads as 0
    (its step priced as before, at any R) and says so; a negative one is refused."""
    assert CostModel(**json.loads(json.dumps(COST.as_dict()))) == COST
    config = HARTSGRPOConfig(output_dir="unused", use_cpu=True, harts_cost_model=json.dumps(COST.as_dict()))
    assert config.harts_planner_cost_model == COST
    old = {k: v for k, v in COST.as_dict().items() if k not in ("step_ranks", "grad_bytes")}
    read = CostModel(**json.loads(json.dumps(old)))
    assert (read.step_ranks, read.grad_bytes) == (0.0, 0.0)
    assert read.outside(4) == read.outside(1) == read.step
    assert "assumed 0" in cost_origin(read) and "assumed 0" not in cost_origin(COST)
    for name in ("step_ranks", "grad_bytes"):
        with pytest.raises(ValueError, match=">= 0"):
            CostModel(**{**COST.as_dict(), name: -1.0})


def test_gradient_bytes_count_the_trainable_parameters():
    """What a data-parallel step all-reduces: every trainable parameter's bytes, none of a frozen one."""
    model = tiny_model("qwen3_5")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert gradient_bytes(model) == total > 0
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    assert gradient_bytes(model) == total - frozen.numel() * frozen.element_size()


def test_calibrate_prints_the_outside_terms():
    """``harts-hf calibrate`` shows the gradient bytes in bytes, the multi-rank planning, and the
    seconds outside the model calls at 1, 2 and 8 ranks as the plan prices them."""
    text = format_cost_model(COST, "cost model of tiny in 1.0 s:")
    assert "grad_bytes     2.000e+06 B" in text and "step_ranks 8.000e-03 s" in text
    assert " / ".join(f"{COST.outside(r):.3e}" for r in (1, 2, 8)) in text
