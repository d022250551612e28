"""The cost model: its non-negative least-squares fit recovers known coefficients, its features
match the forest and ``ops.rounds``, and ``calibrate`` fits a real (tiny) model's timings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import tiny_model
from trees import nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.lab.calibrate import calibrate, calibration_forests, forest_features
from harts_hf.ops.rounds import build_rounds
from harts_hf.ops.tree_batch import TreeBatch
from harts_hf.planner import CostModel, fit_cost_model, plan
from harts_hf.planner.balance import FORWARD_SHARE
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.handoffs import Transfers


@pytest.mark.parametrize(
    "truth",
    [
        pytest.param((2e-5, 1e-9, 1e-3, 5e-3), id="all-terms"),
        pytest.param((3e-4, 0.0, 0.0, 2e-2), id="no-pairs-no-rounds"),
        pytest.param((0.0, 4e-8, 7e-3, 0.0), id="pairs-only-quadratic"),
    ],
)
def test_fit_recovers_known_coefficients(truth, rng):
    tokens = rng.integers(10, 100_000, 40).astype(float)
    features = np.stack([tokens, tokens * rng.uniform(10, 5000, 40), rng.integers(1, 6, 40), np.ones(40)], axis=1)
    seconds = features @ np.array(truth)
    fitted = fit_cost_model(features, seconds)
    got = [fitted.token, fitted.pair, fitted.round, fitted.microbatch]
    np.testing.assert_allclose(got, truth, rtol=1e-6, atol=1e-15)


def test_fit_stays_non_negative_on_noisy_data(rng):
    tokens = rng.integers(100, 10_000, 30).astype(float)
    features = np.stack([tokens, tokens * 50, rng.integers(1, 4, 30), np.ones(30)], axis=1)
    seconds = features @ np.array([1e-4, 0.0, 0.0, 1e-2]) * rng.uniform(0.8, 1.2, 30)
    fitted = fit_cost_model(features, seconds)
    assert min(fitted.as_dict().values()) >= 0 and max(fitted.token, fitted.pair) > 0
    assert np.abs(fitted(*features.T) / seconds - 1).max() < 0.3


@pytest.mark.parametrize(
    "features, seconds, match",
    [
        pytest.param(np.ones((3, 3)), np.ones(3), "want features", id="three-features"),
        pytest.param(np.ones((3, 4)), np.array([1.0, 0.0, 1.0]), "positive", id="zero-seconds"),
    ],
)
def test_fit_refuses_bad_input(features, seconds, match):
    with pytest.raises(ValueError, match=match):
        fit_cost_model(features, seconds)


@pytest.mark.parametrize(
    "coefficients, match",
    [
        pytest.param((-1.0, 0.0, 0.0, 0.0), "finite and >= 0", id="negative"),
        pytest.param((float("nan"), 1.0, 0.0, 0.0), "finite and >= 0", id="nan"),
        pytest.param((0.0, 0.0, 1.0, 1.0), "token or pair", id="free-tokens"),
    ],
)
def test_cost_model_validates(coefficients, match):
    with pytest.raises(ValueError, match=match):
        CostModel(*coefficients)


@pytest.mark.parametrize("build", nasty_tree_params())
def test_features_match_the_forest_and_ops_rounds(build, rng):
    forest = RolloutForest.from_sequences(build(rng))
    tokens, pairs, rounds, one = forest_features(forest)
    assert tokens == forest.num_compact_tokens and one == 1
    k = np.arange(forest.num_compact_tokens)
    ancestor_or_self = (k[:, None] <= k[None, :]) & (k[None, :] < forest.subtree_end[:, None])  # [key, query]
    assert pairs == ancestor_or_self.sum()
    assert rounds == build_rounds(TreeBatch.from_forest(forest), 64).num_rounds


def test_calibrate_fits_a_tiny_model():
    model = tiny_model("qwen3_5")
    forests = calibration_forests(model.get_input_embeddings().num_embeddings, sizes=(0.25, 0.5))[::2]
    fitted = calibrate(model, forests, repeats=1)
    values = np.array(list(fitted.as_dict().values()))
    assert np.isfinite(values).all() and (values >= 0).all() and max(fitted.token, fitted.pair) > 0
    features = np.stack([forest_features(f) for f in forests])
    assert (fitted(*features.T) > 0).all()


def test_predicted_seconds_say_where_they_come_from():
    """The built-in cost model is an H100 estimate, and every plan summary says so (a calibrated one
    is named as given)."""
    from harts_hf.planner.cost import cost_origin

    forest = RolloutForest.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    assert (
        "built-in H100 estimate"
        in plan(forest, world_size=1, max_tokens_per_microbatch=64).summary()["step_seconds_from"]
    )
    mine = CostModel(token=1e-4, pair=0.0, round=0.0, microbatch=0.0)
    assert (
        cost_origin(mine)
        == plan(forest, world_size=1, max_tokens_per_microbatch=64, cost_model=mine).summary()["step_seconds_from"]
    )
    assert "built-in" not in cost_origin(mine)


def test_calibration_forests_separate_rounds_and_pairs_from_tokens():
    """The fit can tell the features apart only where they vary independently: forests of 1 to 6
    rounds (not all 2-3, which is the per-microbatch intercept again) and forests whose tokens read
    hundreds of ancestors each (trained rollout trees do: the 24-row quick GRPO step reads ~380 a
    token; without such forests the pair coefficient is an extrapolation, 10x off)."""
    from harts_hf.lab.calibrate import binary_tree

    features = np.stack([forest_features(f) for f in calibration_forests(1024)])
    tokens, pairs, rounds, _ = features.T
    assert set(range(1, 7)) <= set(rounds.astype(int).tolist())
    assert (pairs / tokens).max() > 250 and pairs.max() > 4e5
    tree = binary_tree(3, 5, vocab=1024)
    assert tree.num_trajectories == 8 and tree.num_compact_tokens == 5 * (1 + 2 + 4 + 8)
    assert forest_features(tree)[2] == 4 == build_rounds(TreeBatch.from_forest(tree), 64).num_rounds


def test_rank_seconds_count_the_replays_step_seconds_counts():
    """A rank's predicted seconds (what ``harts/predicted_step_seconds`` logs against the engine's
    measured forward + backward) include the FORWARD_SHARE replay of every slot but the last; with
    one rank they are the plan's step."""
    from harts_hf.planner.balance import FORWARD_SHARE, rank_seconds, step_seconds

    cost = np.array([[0.6, 0.7], [0.5, 0.2]])
    np.testing.assert_allclose(rank_seconds(cost), [1.3 + FORWARD_SHARE * 0.6, 0.7 + FORWARD_SHARE * 0.5])
    np.testing.assert_allclose(rank_seconds(cost[:1]), [step_seconds(cost[:1])])
    np.testing.assert_allclose(rank_seconds(np.array([[0.4]])), [0.4])


def test_calibrate_times_one_cpu_thread_by_its_cpu_time(monkeypatch):
    """On a CPU with one torch thread, calibrate reads the process's CPU time, which other jobs on a
    shared machine do not inflate (their wall time made the fit up to 2.7x the quiet machine's)."""
    import time

    import torch

    calls = []
    n = 3  # forests
    # clock increments: a warm-up run per forest (start, forward + backward, no-grad forward), then a
    # timed one (forest k: 0.04 (k + 1) s and a quarter of that) and its host work (0.002 s on one
    # rank, 0.005 s over two)
    warm = [0.05, 0.04, 0.01] * n
    timed = [x for k in range(n) for x in (0.05, 0.04 * (k + 1), 0.01 * (k + 1), 0.05, 0.002, 0.05, 0.005)]
    readings = np.cumsum(warm + timed)

    def fake_clock():
        calls.append(None)
        return readings[len(calls) - 1]

    monkeypatch.setattr(time, "process_time", fake_clock)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model("qwen3_5")
        forests = calibration_forests(model.get_input_embeddings().num_embeddings, sizes=(0.25,))[:n]
        fitted = calibrate(model, forests, repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == readings.size  # the clock read as above: every timing on CPU time
    assert max(fitted.token, fitted.pair) > 0
    assert fitted.forward_share == pytest.approx(0.25) != FORWARD_SHARE  # measured, not assumed
    assert fitted.step == pytest.approx(0.002) and fitted.step_ranks == pytest.approx(0.003)


def test_an_exchange_overlaps_its_sends_and_receives_but_for_duplex():
    """A rank's sends and receives of one exchange, posted together: full duplex (the built-in)
    costs the longer, one way at a time their sum; a duplex past 1 is refused."""
    sends, receives = np.array([3.0, 1.0, 0.0]), np.array([1.0, 2.0, 4.0])
    assert np.array_equal(DEFAULT_COST_MODEL.exchange(sends, receives), [3.0, 2.0, 4.0])
    half = dataclasses.replace(DEFAULT_COST_MODEL, duplex=1.0)
    assert np.array_equal(half.exchange(sends, receives), sends + receives)
    assert dataclasses.replace(DEFAULT_COST_MODEL, duplex=0.5).exchange(3.0, 1.0) == 3.5
    with pytest.raises(ValueError, match="duplex"):
        dataclasses.replace(DEFAULT_COST_MODEL, duplex=1.5)


def test_transfers_charge_each_rank_its_exchange():
    """Rank 0 sends 2 rows to rank 1 and receives 1 from it; rank 2 receives 1 from rank 0: each
    rank pays the longer of its sends and receives, priced by the cost model's transfer."""
    rows = np.array([[0, 2, 1], [1, 0, 0], [0, 0, 0]])
    t = Transfers.of_pairs(rows, np.zeros((3, 3)), DEFAULT_COST_MODEL)
    one = float(DEFAULT_COST_MODEL.transfer(1, 0, 1))
    two = float(DEFAULT_COST_MODEL.transfer(2, 0, 1))
    assert np.allclose(t.seconds, [two + one, two, one]) and t.messages == 3
