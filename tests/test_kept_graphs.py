"""No avoidable replay: the last model calls keep their graphs from the recording as far as the
plan's byte budget holds them alive together, and are not rerun; the numbers stay the oracle's
(token- and sequence-level losses, through the replay and a caller's own backward, with gradient
checkpointing), and under a data-parallel wrapper every call keeps its graph inside ``no_sync``
and a closing call syncs. With host memory in the budget, the graphs the budget cannot hold wait
there instead of rerunning."""

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


def _host_plan(forest):
    """The 4-slot plan under a budget that holds one graph, and host memory for the 3 others."""
    the_plan = with_budget(dfs_cut_plan(forest, CUTS), Budget(min(KEPT), host_bytes=1e6))
    assert the_plan.host_graphs.tolist() == [[True, True, True, False]] and not the_plan.rerun.any()
    return the_plan


def _loss(forest, objective: str, seed: int):
    """A token-level loss (random weights) or a sequence-level one over ``forest``."""
    if objective == "sequence":
        return sequence_loss(forest)
    weights = np.random.default_rng(seed).standard_normal((forest.num_trajectories, forest.max_length - 1))
    return per_token_loss(torch.as_tensor(weights, dtype=torch.float32))


@pytest.mark.parametrize("tokens", list(KEPT), ids=lambda t: f"keeps-{KEPT[t]}-of-4")
@pytest.mark.parametrize("objective", ["token", "sequence"])
def test_kept_graphs_equal_the_oracle_and_the_replay(model, tokens, objective):
    """U units keeping K graphs make 2U - K model calls (K with grad in the recording, none of them
    rerun), with the oracle's log-probs and gradients, and the all-but-last-rerun path's."""
    seqs, forest = _forest(1)
    loss_fn = _loss(forest, objective, seed=1)
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


@pytest.mark.parametrize("objective", ["token", "sequence"])
def test_graphs_in_host_memory_equal_the_oracle_and_run_once(model, objective):
    """With host memory for them, the 3 slots the budget cannot keep record with grad, their saved
    tensors in host memory (copies: what the CPU runs of the GPU's path), and none reruns: 4 units
    make 4 model calls, with the oracle's log-probs and gradients, through the engine's backward
    and a caller's."""
    seqs, forest = _forest(1)
    loss_fn = _loss(forest, objective, seed=2)
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    for attached in (False, True):
        got, calls, engine = engine_step(model, forest, _host_plan(forest), loss_fn, attached=attached)
        assert engine.schedule.graph_calls() == 1 and engine.schedule.host_calls() == {0, 1, 2}
        assert calls == [True] * 4
        assert engine.host.moved > 0
        assert_same(ref, got)


def test_graphs_in_host_memory_under_gradient_checkpointing_and_no_sync():
    """With gradient checkpointing (its recomputation in the backward reads host copies of the
    checkpoints' inputs) and under ``no_sync``: call 0 keeps its graph in host memory, so every call
    runs inside ``no_sync`` and a closing call syncs; the oracle's numbers."""
    model = patch_model(tiny_model("kimi_linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seqs, forest = _forest(1)
    loss_fn = sequence_loss(forest)
    got, calls, engine = engine_step(model, forest, _host_plan(forest), loss_fn, no_sync=contextlib.nullcontext)
    assert calls == [True] * 5  # 4 units, then the closing call
    assert engine.host.moved > 0
    assert_same(oracle(model, seqs, loss_fn, forest.max_length - 1), got)


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


def test_every_call_keeps_its_graph_under_no_sync_and_a_closing_call_syncs(model):
    """Under ``no_sync``, every kept graph's forward runs inside it (a DDP backward syncs where the
    forward before it ran outside), call 0 included, and a closing call (every parameter times 0,
    no model compute) runs its forward and backward outside it, last: the step's only syncing
    backward. With a budget that holds every graph, 4 units make 4 model calls and the closing one
    (no rerun), and the numbers are the oracle's."""
    seqs, forest = _forest(1)
    loss_fn = sequence_loss(forest)
    inside = [False]
    events = []

    @contextlib.contextmanager
    def no_sync():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    def forward(run):
        events.append(("forward", inside[0]))
        return run()

    # Every backward pass goes through the LM head: record whether it ran inside no_sync.
    hook = model.get_output_embeddings().weight.register_hook(lambda g: events.append(("backward", inside[0])))
    try:
        got, calls, engine = engine_step(
            model, forest, _plan(forest, max(KEPT)), loss_fn, forward=forward, no_sync=no_sync
        )
    finally:
        hook.remove()
    assert engine.schedule.graph_calls() == 4
    assert calls == [True] * 5  # calls 0-3 kept, then the closing call
    recorded = [("forward", True)] * 4
    assert events[-10:] == recorded + [("backward", True)] * 4 + [("forward", False), ("backward", False)]
    assert_same(oracle(model, seqs, loss_fn, forest.max_length - 1), got)


def test_a_single_call_under_no_sync_keeps_its_graph_and_syncs_in_its_context_or_a_closing_call(model):
    """A rank's only call under ``no_sync`` keeps its graph: its backward syncs where the caller
    says its context is the sync context (``keep_graph``: TreeEngine.backward), and a closing call
    syncs otherwise."""
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
    assert len(calls) == 2  # the recording, then the closing call


@pytest.mark.slow
def test_measured_memory_of_kept_graphs_within_the_prediction():
    """With the model's measured memory model, a budget of 1, 2 and 3 microbatches keeps 1, 2 and 3
    graphs alive together, and the step's measured peak stays within the memory model's prediction
    for them (their saved activations summed, plus the largest transient phase), below the budget.
    Measured in a process of its own (``kept_memory_worker.py``): what earlier tests left in this
    one is not the step's."""
    torchrun("kept_memory_worker.py", 1, timeout=300)
