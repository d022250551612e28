"""Trajectories several times longer than the microbatch budget train, in pieces, exactly.

The budget is memory: a piece's ancestors (computed in earlier slots) cost what the engine really
keeps for them (``harts_hf.engine.memory_model``), a fraction of an own token, so a trajectory
longer than the budget is cut into pieces whose own tokens plus priced context fit. Oracle: the
unpatched model, trajectory by trajectory, for every layer kind (gated delta, KDA, Mamba2,
lightning, short conv, attention) and with gradient checkpointing."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import assert_same, engine_run, oracle, sequence_loss
from tiny_models import tiny_model

from harts_hf import RolloutForest, patch_model, plan
from harts_hf.engine import memory_model
from harts_hf.planner import TOKEN_MEMORY, Budget, MemoryModel

BUDGET = 96  # own-token equivalents; the longest trajectory is 3x longer


LIGHT_CONTEXT = MemoryModel(token=10.0, context=2.0)


def fitting_budget(memory: MemoryModel, forest: RolloutForest, own: int = 24) -> int:
    """The budget whose deepest piece still takes ``own`` tokens (5-9x below the longest trajectory
    at the tiny models' context weights, 0.05 to 0.16)."""
    return int(np.ceil(memory.budget(max_tokens=own).context_weight * (forest.max_length - 1))) + own


def long_forest(seed: int = 0) -> tuple[list[list[int]], RolloutForest]:
    """A 300-token trunk (a branch at the chunk edge, a strict prefix) and three long tails."""
    rng = np.random.default_rng(seed)
    seg = lambda n: rng.integers(3, 120, n).tolist()
    trunk = seg(300)
    seqs = [trunk + seg(150), trunk[:64] + seg(90), trunk[:130] + seg(250), trunk[:150]]
    return seqs, RolloutForest.from_sequences(seqs)


@pytest.mark.parametrize(
    "family, checkpointing",
    [
        ("qwen3_5", False),
        ("qwen3_5", True),
        ("kimi_linear", False),
        ("nemotron_h", False),
        ("minimax", False),
        ("lfm2", False),
        ("falcon_h1", True),
    ],
)
def test_pieces_of_long_trajectories_equal_trajectory_wise(family, checkpointing):
    model = tiny_model(family)
    if checkpointing:
        model.train()  # transformers checkpoints in training mode only; the tiny models have no dropout
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = patch_model(model)
    seqs, forest = long_forest()
    # Checkpointed own tokens are cheap (the tiny models: 32 hidden units), context K/V is not: the
    # model's memory model then cannot cut this forest; the engine's exactness does not depend on
    # the pricing, so the checkpointed runs take a light one.
    memory = LIGHT_CONTEXT if checkpointing else memory_model(model)
    budget = fitting_budget(memory, forest)
    the_plan = plan(forest, world_size=1, max_tokens_per_microbatch=budget, memory_model=memory)
    assert forest.max_length >= 2 * budget and the_plan.num_slots >= 4
    assert (the_plan.budget.footprint(the_plan.tokens, the_plan.context) <= budget).all()
    assert (the_plan.context > budget).any()  # pieces read more ancestors than a budget of tokens holds
    loss_fn = sequence_loss(forest)
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    assert_same(ref, engine_run(model, forest, the_plan, loss_fn))


def test_two_ranks_split_long_trajectories():
    model = patch_model(tiny_model("qwen3_5"))
    seqs, forest = long_forest(1)
    memory = memory_model(model)
    the_plan = plan(forest, world_size=2, max_tokens_per_microbatch=fitting_budget(memory, forest), memory_model=memory)
    assert the_plan.num_slots >= 2 and np.unique(the_plan.piece_rank).size == 2
    loss_fn = sequence_loss(forest)
    assert_same(oracle(model, seqs, loss_fn, forest.max_length - 1), engine_run(model, forest, the_plan, loss_fn))


def test_memory_model_prices_context_below_a_token():
    """Derived from what the engine keeps: a context token costs a fraction of an own token, the
    same on every call (deterministic: every rank plans alike); checkpointing lowers a token's
    cost, not a context token's (its K/V in every attention layer)."""
    model = patch_model(tiny_model("qwen3_5"))
    memory = memory_model(model)
    assert 0 < memory.context < 0.5 * memory.token and memory.head > 0 and memory.head_chunk > 0
    assert memory_model(patch_model(tiny_model("qwen3_5", seed=1))) == memory  # weights do not matter
    ckpt = tiny_model("qwen3_5").train()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = memory_model(patch_model(ckpt))
    assert checkpointed.token < memory.token and checkpointed.context == memory.context


def test_a_token_budget_refuses_what_the_memory_model_plans():
    _, forest = long_forest()
    with pytest.raises(ValueError, match="longest trajectory.*pass the model's memory_model"):
        plan(forest, world_size=1, max_tokens_per_microbatch=BUDGET)
    light = MemoryModel(token=100.0, context=10.0)
    with pytest.raises(ValueError, match=r"need \(450 tokens.*0.1 own-token"):
        plan(forest, world_size=1, max_tokens_per_microbatch=40, memory_model=light)
    assert plan(forest, world_size=1, max_tokens_per_microbatch=60, memory_model=light).num_slots > 1


def test_a_budget_in_bytes_is_the_token_budget_it_holds():
    _, forest = long_forest()
    memory = MemoryModel(token=1000.0, context=150.0, head=500.0, head_chunk=64, fixed=4096.0, layer=100.0)
    for tokens in (80, 96, 300):  # under and over a full head chunk, and where the phases cross (n = 10, 279)
        nbytes = float(memory(tokens))
        assert memory.budget(max_bytes=nbytes) == memory.budget(max_tokens=tokens)
        assert memory.budget(max_bytes=nbytes - 1).tokens == tokens - 1
        by_bytes = plan(forest, world_size=1, max_bytes_per_microbatch=nbytes, memory_model=memory)
        by_tokens = plan(forest, world_size=1, max_tokens_per_microbatch=tokens, memory_model=memory)
        np.testing.assert_array_equal(by_bytes.piece_end, by_tokens.piece_end)
        assert (by_bytes.peak_bytes <= nbytes + 1e-6).all()  # every microbatch within the bytes


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda f: plan(f, world_size=1), "in tokens or in bytes"),
        (
            lambda f: plan(
                f, world_size=1, max_tokens_per_microbatch=10, max_bytes_per_microbatch=1e6, memory_model=TOKEN_MEMORY
            ),
            "not both",
        ),
        (lambda f: plan(f, world_size=1, max_bytes_per_microbatch=1e6), "needs the model's memory model"),
        (lambda f: plan(f, world_size=1, max_tokens_per_microbatch=10, memory_model={"token": 1}), "MemoryModel"),
        (
            lambda f: plan(f, world_size=1, max_bytes_per_microbatch=10.0, memory_model=MemoryModel(100.0, 1.0)),
            "holds no token",
        ),
        (lambda f: MemoryModel(token=0.0, context=0.0), "positive token cost"),
        (lambda f: MemoryModel(token=1.0, context=float("nan")), "finite"),
        (lambda f: Budget(0), "positive whole number"),
        (lambda f: Budget(10, -0.5), "finite number >= 0"),
    ],
)
def test_bad_budgets_are_refused(call, message):
    _, forest = long_forest()
    with pytest.raises((ValueError, TypeError), match=message):
        call(forest)


def test_zero_context_weight_cuts_anywhere():
    """Free context (a model without attention context cost) still leaves one own token a piece."""
    _, forest = long_forest()
    p = plan(forest, world_size=1, max_tokens_per_microbatch=32, memory_model=MemoryModel(1.0, 0.0))
    assert p.budget.context_weight == 0.0 and (p.tokens <= 32).all()
    assert p.tokens.sum() == forest.num_compact_tokens and p.num_slots >= forest.num_compact_tokens / 32
