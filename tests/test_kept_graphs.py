"""No avoidable replay: the last model calls keep their graphs from the recording as far as the
plan's byte budget holds them alive together, and are not rerun; the numbers stay the oracle's
(token- and sequence-level losses, through the replay and a caller's own backward, with gradient
checkpointing), and under a data-parallel wrapper call 0 still runs its forward in the sync
context, right before its backward."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from launch import torchrun
from test_engine import (
    _forest,
    assert_same,
    dfs_cut_plan,
    engine_step,
    oracle,
    per_token_loss,
    sequence_loss,
)
from tiny_models import tiny_model

from harts_hf import patch_model
from harts_hf.engine import TreeEngine
from harts_hf.planner.graphs import graph_slots
from harts_hf.planner.memory import Budget

CUTS = np.array([9, 40, 70])  # forest 1 (118 compact tokens): slots of 9, 31, 30, 48 own tokens

# Budget (own-token equivalents, TOKEN_MEMORY: bytes = tokens) -> graphs kept. A graph saves its
# slot's own tokens plus its context (9, 31 + 8, 30 + 39, 48 + 68): 116 alone, 185 with the slot
# before, 224 with two, 233 with all.
KEPT = {118: 1, 200: 2, 233: 4}


@pytest.fixture(scope="module")
def model():
    return patch_model(tiny_model("qwen3_5"))


def _plan(forest, tokens: int):
    return with_budget(dfs_cut_plan(forest, CUTS), Budget(tokens))


def with_budget(the_plan, budget: Budget):
    """``the_plan`` under another byte budget: the slots that keep their graphs follow it."""
    kept = graph_slots(the_plan.memory_model, budget, the_plan.tokens, the_plan.context)
    return dataclasses.replace(the_plan, budget=budget, graph_slots=kept)


@pytest.mark.parametrize("tokens", list(KEPT), ids=lambda t: f"keeps-{KEPT[t]}-of-4")
@pytest.mark.parametrize("objective", ["token", "sequence"])
def test_kept_graphs_equal_the_oracle_and_the_replay(model, tokens, objective):
    """U units keeping K graphs make 2U - K model calls (K with grad in the recording, none of them
    rerun), with the oracle's log-probs and gradients, and the all-but-last-rerun path's."""
    seqs, forest = _forest(1)
    if objective == "token":
        weights = np.random.default_rng(1).standard_normal((forest.num_trajectories, forest.max_length - 1))
        loss_fn = per_token_loss(torch.as_tensor(weights, dtype=torch.float32))
    else:
        loss_fn = sequence_loss(forest)
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    rerun, _, _ = engine_step(model, forest, _plan(forest, min(KEPT)), loss_fn)
    for attached in (False, True):
        got, calls, engine = engine_step(model, forest, _plan(forest, tokens), loss_fn, attached=attached)
        units, kept = len(engine.units), KEPT[tokens]
        assert units == 4 and engine.schedule.graph_calls() == kept
        assert len(calls) == 2 * units - kept
        assert calls[:units] == [False] * (units - kept) + [True] * kept  # the recording
        assert not any(calls[units:]) or all(calls[units:])  # the reruns, all with grad
        assert_same(ref, got)
        assert_same(rerun, got, tol=1e-6)


def test_kept_graphs_under_gradient_checkpointing():
    """A kept graph's checkpoint recomputation (in its backward, after later units read its exports)
    finds the same names and keeps its first exports: the oracle's numbers."""
    model = patch_model(tiny_model("kimi_linear"))  # three convs in one mixer
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seqs, forest = _forest(1)
    loss_fn = sequence_loss(forest)
    got, calls, engine = engine_step(model, forest, _plan(forest, max(KEPT)), loss_fn)
    assert len(calls) == len(engine.units) == 4
    assert_same(oracle(model, seqs, loss_fn, forest.max_length - 1), got)


def test_call_zero_runs_its_forward_in_the_sync_context(model):
    """Under ``no_sync``, every kept graph's forward runs inside it (its backward does not sync) and
    call 0, whose backward syncs, is rerun outside it right before that backward: with a budget
    that holds every graph, 4 units make 5 calls, not 4."""
    seqs, forest = _forest(1)
    loss_fn = sequence_loss(forest)
    inside = [False]
    forwards, backwards = [], []

    @contextlib.contextmanager
    def no_sync():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    def forward(run):
        forwards.append(inside[0])
        return run()

    # Every backward pass goes through the LM head: record whether it ran inside no_sync.
    hook = model.get_output_embeddings().weight.register_hook(lambda g: backwards.append(inside[0]))
    try:
        got, calls, engine = engine_step(
            model, forest, _plan(forest, max(KEPT)), loss_fn, forward=forward, no_sync=no_sync
        )
    finally:
        hook.remove()
    forwards = forwards[-len(calls) :]  # the construction's probe call went first
    assert engine.schedule.graph_calls() == 4
    assert calls == [False, True, True, True, True]  # call 0 without grad, calls 1-3 kept, call 0 rerun
    assert forwards == [False, True, True, True, False]
    assert backwards == [True, True, True, False]  # the last backward (call 0's) syncs
    assert_same(oracle(model, seqs, loss_fn, forest.max_length - 1), got)


def test_a_single_call_under_no_sync_keeps_its_graph_only_in_the_sync_context(model):
    """A rank's only call under ``no_sync`` keeps its graph where the caller says its context is the
    sync context (``keep_graph``: TreeEngine.backward), and is rerun otherwise."""
    _, forest = _forest(2)
    calls = []
    engine = TreeEngine(
        model,
        forest,
        max_tokens_per_microbatch=10_000,
        forward=lambda run: calls.append(1) or run(),
        no_sync=contextlib.nullcontext,
    )
    assert engine.calls == 1
    calls.clear()
    engine.backward(lambda lps: lps[0].sum())
    assert len(calls) == 1
    calls.clear()
    recording = engine.record()
    recording.backward([torch.ones_like(v) for v in recording.logprobs])
    assert len(calls) == 2  # the recording, then the rerun


@pytest.mark.slow
def test_measured_memory_of_kept_graphs_within_the_prediction():
    """With the model's measured memory model, a budget of 1, 2 and 3 microbatches keeps 1, 2 and 3
    graphs alive together, and the step's measured peak stays within the memory model's prediction
    for them (their saved activations summed, plus the largest transient phase), below the budget.
    Measured in a process of its own (``kept_memory_worker.py``): what earlier tests left in this
    one is not the step's."""
    torchrun("kept_memory_worker.py", 1, timeout=300)
