"""The engine runs planned pieces exactly: per-trajectory log-probs and parameter gradients equal
the unpatched model run trajectory by trajectory (and the unsplit forest), for cuts anywhere
(mid-node, mid-chunk, 1-token pieces), several ranks, sequence-level objectives and gradient
checkpointing; a bad plan or active dropout is refused."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tiny_models import as_layout, family_forest, tiny_model, trainable, trajectory_logprobs
from trees import caterpillar, many_roots, one_token_nodes

from harts_hf import RolloutForest, patch_model, plan, tree_logprobs
from harts_hf.engine import TreeEngine
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.memory import TOKEN_MEMORY, Budget
from harts_hf.planner.pieces import Pieces
from harts_hf.planner.plan import build_plan

TOL = 2e-5  # fp32, relative to the largest reference value (log-probs: absolute)


def dfs_cut_plan(forest: RolloutForest, cuts: np.ndarray):
    """A one-rank plan that cuts the forest's DFS order at ``cuts``, one piece per slot: pieces
    start anywhere (mid-node, mid-chunk) and every piece's context lies in earlier slots."""
    bounds = np.unique(np.r_[0, cuts, forest.num_compact_tokens])
    k = bounds.size - 1
    zeros = np.zeros(k, dtype=np.int64)
    pieces = Pieces(zeros, np.arange(k), bounds[:-1], bounds[1:], zeros, np.zeros(k, dtype=bool), k)
    geo = Geometry.of([forest], DEFAULT_COST_MODEL)
    budget = Budget(forest.num_compact_tokens)
    return build_plan(geo, [forest], pieces, DEFAULT_COST_MODEL, budget, TOKEN_MEMORY, 64, time.perf_counter(), 1)


def per_token_loss(weights: torch.Tensor):
    return lambda lps: (lps[0] * weights).sum()


def sequence_loss(forest: RolloutForest):
    """A GSPO-like objective: a nonlinear function of each trajectory's mean log-prob."""
    counts = torch.as_tensor(forest.lengths - 1, dtype=torch.float32).clamp(min=1)
    return lambda lps: torch.exp(lps[0].sum(-1) / counts).sum()


def oracle(model, seqs, loss_fn, width):
    """Unpatched forward trajectory by trajectory: log-probs [B, width] and parameter grads."""
    params = trainable(model)
    lp = as_layout([lp for lp, _ in trajectory_logprobs(model, seqs)], width)
    grads = torch.autograd.grad(loss_fn([lp]), params, allow_unused=True)
    return lp.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def engine_run(model, forest, the_plan, loss_fn):
    """Every rank of ``the_plan`` in turn, gradients summed (what an all-reduce gives). A rank's
    loss sees its own rows live and the other ranks' rows as constants (a gathered objective)."""
    with torch.no_grad():
        others = tree_logprobs(model, forest)
    params = trainable(model)
    for p in params:
        p.grad = None
    width = forest.max_length - 1
    lps = torch.zeros(forest.num_trajectories, width)
    for rank in range(the_plan.world_size):
        engine = TreeEngine(model, forest, the_plan, rank=rank)
        lp = engine.logprobs()[0]
        own = engine.owned[0]
        lps[own] = lp[own]
        engine.backward(lambda l, own=own: loss_fn([torch.where(own[:, None], l[0], others)]))
    return lps, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def assert_same(ref, got, tol: float = TOL):
    """(log-probs, grads) within ``tol``: log-probs absolute, grads relative to the largest reference."""
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=tol)
    scale = max(float(g.abs().max()) for g in ref[1])
    for r, g in zip(ref[1], got[1]):
        torch.testing.assert_close(g, r, rtol=0, atol=tol * scale)


@pytest.fixture(
    scope="module", params=["qwen3_5", "kimi_linear", "nemotron_h", "lfm2", "minimax", "falcon_h1", "jamba"]
)
def family_model(request):
    model = tiny_model(request.param)
    return patch_model(model)


def _forest(seed: int) -> tuple[list[list[int]], RolloutForest]:
    seqs = family_forest(np.random.default_rng(seed))
    return seqs, RolloutForest.from_sequences(seqs)


@pytest.mark.parametrize(
    "cuts",
    [
        pytest.param([40], id="mid-chunk"),
        pytest.param([1, 2, 63, 64, 65], id="1-token-pieces-at-chunk-edge"),
        pytest.param([20, 66, 71, 90], id="mid-node-4-cuts"),
    ],
)
def test_dfs_cuts_equal_trajectory_wise(family_model, cuts):
    seqs, forest = _forest(0)
    weights = torch.as_tensor(
        np.random.default_rng(1).standard_normal((forest.num_trajectories, forest.max_length - 1)), dtype=torch.float32
    )
    loss_fn = per_token_loss(weights)
    the_plan = dfs_cut_plan(forest, np.asarray(cuts))
    assert the_plan.num_slots >= len(cuts)
    ref = oracle(family_model, seqs, loss_fn, forest.max_length - 1)
    assert_same(ref, engine_run(family_model, forest, the_plan, loss_fn))


def test_random_cuts_sequence_level_objective():
    model = patch_model(tiny_model("qwen3_5"))
    rng = np.random.default_rng(3)
    for seed in range(3):
        seqs, forest = _forest(seed)
        cuts = rng.choice(np.arange(1, forest.num_compact_tokens), size=5, replace=False)
        loss_fn = sequence_loss(forest)
        ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
        assert_same(ref, engine_run(model, forest, dfs_cut_plan(forest, cuts), loss_fn))


def engine_step(model, forest, the_plan, loss_fn, *, attached: bool = False, **engine_kwargs):
    """One engine step on rank 0, through its backward or (``attached``) a caller's own: (log-probs,
    grads), whether grad was on in each model call it made, and the engine."""
    for p in trainable(model):
        p.grad = None
    calls = []
    forward = engine_kwargs.pop("forward", lambda run: run())
    counted = lambda run: calls.append(torch.is_grad_enabled()) or forward(run)
    engine = TreeEngine(model, forest, the_plan, forward=counted, **engine_kwargs)
    calls.clear()  # the construction's probe call
    seen = []
    if attached:
        lps = engine.attached_logprobs()
        loss_fn(lps).backward()
        seen.append(lps[0].detach())
    else:
        engine.backward(lambda lps: seen.append(lps[0].detach()) or loss_fn(lps))
    return (
        (seen[0], [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in trainable(model)]),
        calls,
        engine,
    )


def test_the_last_piece_keeps_its_graph_and_runs_once():
    """The recording's last unit keeps its graph for the backward: U units under a budget that holds
    one graph make 2U - 1 model calls (every unit but the last recorded and rerun), through the
    replay and through a caller's own backward, with the oracle's gradients."""
    model = patch_model(tiny_model("qwen3_5"))
    seqs, forest = _forest(1)
    loss_fn = sequence_loss(forest)
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    cuts = dfs_cut_plan(forest, np.array([9, 40, 70]))
    for attached in (False, True):
        got, calls, engine = engine_step(model, forest, cuts, loss_fn, attached=attached)
        assert len(engine.units) == 4 and len(calls) == 2 * 4 - 1
        assert_same(ref, got)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shape", [caterpillar, many_roots, one_token_nodes], ids=lambda f: f.__name__)
def test_planned_pieces_and_ranks(world_size, shape):
    """The planner's own cuts under a budget that forces >= 3 pieces per large tree."""
    model = patch_model(tiny_model("qwen3_5"))
    rng = np.random.default_rng(world_size)
    seqs = [[3 + int(t) % 120 for t in s] for s in shape(rng)]
    forest = RolloutForest.from_sequences(seqs)
    budget = forest.max_length + 8
    the_plan = plan(forest, world_size=world_size, max_tokens_per_microbatch=budget)
    sizes = np.bincount(the_plan.piece_forest, minlength=1)
    assert the_plan.num_pieces >= 3 or forest.num_compact_tokens <= budget
    weights = torch.as_tensor(
        rng.standard_normal((forest.num_trajectories, forest.max_length - 1)), dtype=torch.float32
    )
    loss_fn = per_token_loss(weights)
    assert sizes.sum() == the_plan.num_pieces
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    assert_same(ref, engine_run(model, forest, the_plan, loss_fn))


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])  # kimi: three convs in one mixer
def test_gradient_checkpointing_keeps_layer_names(family, monkeypatch):
    """Calls are named by the module whose forward makes them (no hooks anywhere): checkpoint
    recomputation reruns those forwards and finds the same names."""
    model = patch_model(tiny_model(family))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seqs, forest = _forest(5)
    loss_fn = sequence_loss(forest)
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    the_plan = dfs_cut_plan(forest, np.array([30, 64, 70]))

    def no_hooks(*args, **kwargs):
        raise AssertionError("the engine registered a module hook")

    for name in ("register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook"):
        monkeypatch.setattr(torch.nn.Module, name, no_hooks)
    monkeypatch.setattr(torch.nn.modules.module, "register_module_forward_pre_hook", no_hooks)
    assert_same(ref, engine_run(model, forest, the_plan, loss_fn))


def test_refuses_a_module_shared_between_layers():
    """One attention module called by two layers cannot hand its context over per layer: refused
    while recording, not mixed up."""
    model = patch_model(tiny_model("llama"))
    model.model.layers[1].self_attn = model.model.layers[0].self_attn
    _, forest = _forest(0)
    engine = TreeEngine(model, forest, dfs_cut_plan(forest, np.array([40])))
    with pytest.raises(RuntimeError, match="LlamaAttention ran its 'attention' call twice"):
        engine.logprobs()


def test_single_microbatch_holds_one_graph():
    """A forest that fits runs once (no recording pass) and gives the unsplit forest's numbers."""
    model = patch_model(tiny_model("qwen3_5"))
    seqs, forest = _forest(2)
    engine = TreeEngine(model, forest, max_tokens_per_microbatch=10_000)
    assert len(engine.units) == 1 and engine.units[0].batch.num_context == 0
    loss_fn = sequence_loss(forest)
    assert_same(oracle(model, seqs, loss_fn, forest.max_length - 1), engine_run(model, forest, engine.plan, loss_fn))


def test_refuses_foreign_plan_dropout_and_empty_head_chunks():
    model = patch_model(tiny_model("qwen3_5"))
    _, forest = _forest(0)
    _, other = _forest(1)
    other = RolloutForest.from_sequences(other.trajectories()[:3])
    with pytest.raises(ValueError, match="other forests"):
        TreeEngine(model, forest, plan(other, world_size=1, max_tokens_per_microbatch=10_000))
    # As many trajectories, another shape (a longer shared prompt): refused, not misapplied.
    prompt = lambda n: [1 + t % 100 for t in range(n)]
    group = lambda n: RolloutForest.from_sequences([prompt(n) + [3, 4 + i] for i in range(4)])
    with pytest.raises(ValueError, match="other forests"):
        TreeEngine(model, group(90), plan(group(30), world_size=1, max_tokens_per_microbatch=4096))
    same_shape = RolloutForest.from_sequences([[7] * 30 + [5, 6 + i] for i in range(4)])
    TreeEngine(model, same_shape, plan(group(30), world_size=1, max_tokens_per_microbatch=4096))
    with pytest.raises(ValueError, match="world size"):
        TreeEngine(model, forest, plan(forest, world_size=1, max_tokens_per_microbatch=10_000), rank=1)
    with pytest.raises(ValueError, match="rank must be an integer"):
        TreeEngine(model, forest, plan(forest, world_size=2, max_tokens_per_microbatch=10_000), rank=1.0)
    with pytest.raises(ValueError, match="must be a positive integer"):  # 0 is not "no budget given"
        TreeEngine(model, forest, max_tokens_per_microbatch=0)
    model.config.attention_dropout = 0.1
    model.train()
    engine = TreeEngine(model, forest, dfs_cut_plan(forest, np.array([40])))
    with pytest.raises(ValueError, match="dropout"):
        engine.backward(lambda lps: lps[0].sum())
    model.config.attention_dropout = 0.0
    model.config.router_jitter_noise = 0.1  # MoE router noise (Mixtral, MiniMax): redrawn by every rerun
    with pytest.raises(ValueError, match="router_jitter_noise"):
        engine.backward(lambda lps: lps[0].sum())
    model.eval()
    engine.backward(lambda lps: lps[0].sum())  # no draws in eval mode
    with pytest.raises(ValueError, match="head_chunk_tokens"):
        TreeEngine(model, forest, head_chunk_tokens=0)


def prompt_groups(prompts: int) -> RolloutForest:
    """``prompts`` 300-token prompts, each with 4 completions of 200 tokens (a 1000-token vocabulary)."""
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(prompts):
        prompt = list(rng.integers(3, 1000, 300))
        seqs += [prompt + list(rng.integers(3, 1000, 200)) for _ in range(4)]
    return RolloutForest.from_sequences(seqs)


@pytest.mark.slow
def test_peak_memory_follows_the_budget():
    """Peak memory of a step scales with the microbatch budget, not with the forest: a budget of
    1/7 of the compact tokens peaks below 2.5 x 1/7 of the one-microbatch peak (boundary values and
    fixed buffers are the slack)."""
    from harts_hf.lab.memory import PeakMemory
    from harts_hf.lab.models import build_model

    model = patch_model(build_model("qwen3_5", "quick").model)
    forest = prompt_groups(8)
    peaks = {}
    for budget in (forest.num_compact_tokens, forest.num_compact_tokens // 7):
        engine = TreeEngine(model, forest, max_tokens_per_microbatch=budget)
        with PeakMemory("cpu") as measured:
            engine.backward(lambda lps: lps[0].sum())
        peaks[budget] = (measured.peak_bytes, len(engine.units))
    (whole, one), (split, many) = peaks.values()
    assert one == 1 and many >= 7
    assert split < 2.5 / 7 * whole, peaks


def test_public_api():
    import harts_hf

    assert harts_hf.TreeEngine is TreeEngine
    assert {"TreeEngine", "plan", "Plan", "patch_model", "tree_logprobs", "RolloutForest"} <= set(harts_hf.__all__)


def test_returned_loss_is_the_whole_objective():
    model = patch_model(tiny_model("qwen3_5"))
    seqs, forest = _forest(4)
    weights = torch.as_tensor(
        np.random.default_rng(0).standard_normal((forest.num_trajectories, forest.max_length - 1)), dtype=torch.float32
    )
    loss_fn = per_token_loss(weights)
    with torch.no_grad():
        expected = loss_fn([tree_logprobs(model, forest)])
    engine = TreeEngine(model, forest, dfs_cut_plan(forest, np.array([10, 64, 80])))
    torch.testing.assert_close(engine.backward(loss_fn), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="scalar"):
        engine.backward(lambda lps: lps[0])


@pytest.mark.parametrize("world_size", [1, 2])
def test_several_forests_in_one_plan(world_size):
    """One forest per group: a slot mixes pieces of several forests, each its own model call."""
    model = patch_model(tiny_model("qwen3_5"))
    groups = [family_forest(np.random.default_rng(seed), small=True) for seed in range(3)]
    forests = [RolloutForest.from_sequences(g) for g in groups]
    the_plan = plan(forests, world_size=world_size, max_tokens_per_microbatch=max(f.max_length for f in forests) + 30)
    rng = np.random.default_rng(0)
    weights = [
        torch.as_tensor(rng.standard_normal((f.num_trajectories, f.max_length - 1)), dtype=torch.float32)
        for f in forests
    ]
    params = trainable(model)
    for p in params:
        p.grad = None
    got = [torch.zeros(f.num_trajectories, f.max_length - 1) for f in forests]
    for rank in range(world_size):
        engine = TreeEngine(model, forests, the_plan, rank=rank)
        for lp, own, out in zip(engine.logprobs(), engine.owned, got):
            out[own] = lp[own]
        engine.backward(lambda lps: sum((lp * w).sum() for lp, w in zip(lps, weights)))
    ref_lp, ref_grads = [], None
    for g, f, w in zip(groups, forests, weights):
        lp, grads = oracle(model, g, lambda lps, w=w: (lps[0] * w).sum(), f.max_length - 1)
        ref_lp.append(lp)
        ref_grads = grads if ref_grads is None else [a + b for a, b in zip(ref_grads, grads)]
    for r, g in zip(ref_lp, got):
        torch.testing.assert_close(g, r, rtol=0, atol=TOL)
    assert_same((ref_lp[0], ref_grads), (got[0], [p.grad for p in params]))


def test_attached_logprobs_backpropagate_through_the_replay():
    """A caller that owns loss.backward() (TRL) gets the same gradients: the backward replays."""
    model = patch_model(tiny_model("kimi_linear"))
    seqs, forest = _forest(6)
    loss_fn = sequence_loss(forest)
    ref = oracle(model, seqs, loss_fn, forest.max_length - 1)
    params = trainable(model)
    for p in params:
        p.grad = None
    engine = TreeEngine(model, forest, dfs_cut_plan(forest, np.array([5, 33, 64, 66, 90])))
    lps, ents = engine.attached_logprobs(return_entropy=True)
    assert lps[0].requires_grad and not ents[0].requires_grad
    loss_fn(lps).backward()
    assert_same(ref, (lps[0].detach(), [torch.zeros_like(p) if p.grad is None else p.grad for p in params]))
    model.requires_grad_(False)  # a frozen model (a reference policy): its log-probs, nothing to attach
    frozen = engine.attached_logprobs()
    assert not frozen[0].requires_grad
    torch.testing.assert_close(frozen[0], lps[0].detach(), rtol=0, atol=TOL)


def test_a_loss_without_log_probs_and_a_second_backward():
    """A loss that ignores the log-probs backpropagates nothing on every path (the multi-unit replay
    used to fail on it); a second backward through attached_logprobs says the records are gone."""
    model = patch_model(tiny_model("qwen3_5"))
    forest = RolloutForest.from_sequences([[5, 6, 7, 8], [5, 6, 9]])
    constant = lambda lps: torch.tensor(1.0)
    for budget in (4, 64):  # several units, and one
        engine = TreeEngine(model, forest, max_tokens_per_microbatch=budget)
        assert (len(engine.units) > 1) == (budget == 4)
        assert float(engine.backward(constant)) == 1.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    values = TreeEngine(model, forest, max_tokens_per_microbatch=4).attached_logprobs()[0]
    values.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call attached_logprobs again"):
        values.sum().backward()
