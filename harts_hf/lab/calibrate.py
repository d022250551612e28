"""``calibrate(model)``: fit the planner's cost model on this machine by timing a model on trees.

Times one forward + backward of ``tree_forward`` per forest over forests of varied size, depth
and branching (the shapes of ``harts_hf.sources``), each as one microbatch, and fits
:func:`~harts_hf.planner.cost.fit_cost_model` on their features (compact tokens, attended pairs,
rounds, 1); times the same forests' forward alone without grad (what a step's recording pass costs
a microbatch it reruns in the backward), whose median share of forward + backward is the cost
model's ``forward_share``; and what a step does for each forest outside its model calls (build the
forest from its rows, plan it in two slots, compile the engine's Schedule), whose median is
``step``, and the same planned over 2 ranks (rank 0's Schedule), whose median excess is
``step_ranks`` (the planner is pure: one process plans for any number of ranks). ``grad_bytes``
is counted, not timed: the bytes of the model's trainable parameters, which data parallelism
all-reduces each step at the communication terms' prices (``--comm`` measures them). Imports the
modeling stack, unlike the rest of the planner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..engine import TreeEngine
from ..forest import RolloutForest
from ..modeling import patch_model, tree_forward
from ..planner import plan
from ..planner.cost import CostModel, fit_cost_model
from ..sources import caterpillar, deep_chain, grpo_group, random_tree
from ..trees import min_rounds
from .plan_report import legend

__all__ = [
    "binary_tree",
    "calibrate",
    "calibration_forests",
    "forest_features",
    "format_cost_model",
    "gradient_bytes",
    "step_host_work",
]

FEATURE_MEANINGS = {
    "token": "per compact token: projections, MLP/MoE, norms, LM head",
    "pair": "per attended pair (query, key it reads): full attention's quadratic part",
    "round": "per round: a sequential packed linear-attention call",
    "microbatch": "per microbatch: fixed overhead (launches, gathers)",
}
"""What each coefficient of :class:`CostModel` prices (``planner/cost.py`` says more)."""

COMM_MEANINGS = {
    "byte": "per byte moved between ranks (a cross-rank handoff's values, and gradients back)",
    "message": "per message between ranks: its latency",
    "duplex": "share of an exchange's shorter direction it adds (0: both ways at full speed)",
    "context_bytes": "bytes per handed context token: its K/V in every attention layer",
    "state_bytes": "bytes per handed path start: conv halos, replay rows, linear-attention states",
    "grad_bytes": "bytes of gradients all-reduced between ranks each step: the trainable parameters'",
}
"""The communication terms (``harts-hf calibrate --comm`` measures them: ``calibrate_comm.py``)."""


def forest_features(forest: RolloutForest) -> np.ndarray:
    """[4] the cost model's features of ``forest`` run whole as one microbatch."""
    pairs = float((forest.position + 1).sum())
    rounds = float(min_rounds(forest.node_parent)[0].max())
    return np.array([forest.num_compact_tokens, pairs, rounds, 1.0])


def gradient_bytes(model: torch.nn.Module) -> float:
    """Bytes of ``model``'s trainable parameters: the gradients a data-parallel step all-reduces."""
    return float(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


def binary_tree(depth: int, node_len: int, *, seed: int = 0, vocab: int = 32000) -> RolloutForest:
    """A complete binary tree ``depth`` node levels below its root, ``node_len`` tokens a node: 2 **
    depth trajectories and ``depth + 1`` rounds (every node's two children tie), few tokens a round."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab, node_len).tolist()]
    for _ in range(depth):
        seqs = [s + rng.integers(3, vocab, node_len).tolist() for s in seqs for _ in range(2)]
    return RolloutForest.from_sequences(seqs)


def calibration_forests(vocab: int, *, sizes: Sequence[float] = (0.5, 1.0, 2.0), seed: int = 0) -> list[RolloutForest]:
    """Forests that separate the features: flat groups (tokens), long prompts (pairs), deep
    branchings, caterpillars and random trees, at every size in ``sizes`` (trajectories stay under
    512 tokens at size 2, within tiny models' position range; a few hundred compact tokens each, so
    the torch fallbacks time them in seconds on a CPU); then long shared prompts under a few short
    completions (hundreds of attended pairs a token, as deep as trained rollout trees: without them
    pairs ride on tokens and the fit prices a pair 10x) and complete binary trees of 1-6 rounds (the
    shapes above all run in 2-3 rounds, which the fit cannot tell from a microbatch's overhead)."""
    out = []
    for k, s in enumerate(sizes):

        def n(x: float, s: float = s) -> int:
            return max(1, round(x * s))

        shapes = [
            grpo_group(prompt_len=n(32), G=n(16), max_completion=n(48), seed=seed + k, vocab=vocab),
            grpo_group(prompt_len=n(160), G=2, max_completion=n(32), seed=seed + k, vocab=vocab),
            caterpillar(turns=6, trunk_len=n(24), leaf_len=n(8), seed=seed + k, vocab=vocab),
            deep_chain(levels=n(16), fanout=3, seed=seed + k, vocab=vocab),
            random_tree(num_nodes=n(40), max_node_len=n(24), seed=seed + k, vocab=vocab),
        ]
        out += [w.forest() for w in shapes]
    for k, prompt_len in enumerate((96, 224, 448)):
        group = grpo_group(prompt_len=prompt_len, G=4, groups=k + 1, max_completion=48, seed=seed + k, vocab=vocab)
        out.append(group.forest())
    # long completions deep under a prompt, as a multi-turn step's later turns: ~330 pairs a token over
    # ~1,500 tokens (a trained quick GRPO step: 381 over 1,739), which the short completions above miss
    out.append(grpo_group(prompt_len=320, G=10, max_completion=180, seed=seed, vocab=vocab).forest())
    out += [binary_tree(depth, 8, seed=seed + depth, vocab=vocab) for depth in range(6)]
    return out


def calibrate(
    model: torch.nn.Module,
    forests: Sequence[RolloutForest] | None = None,
    *,
    repeats: int = 3,
) -> CostModel:
    """Fit a :class:`CostModel` (seconds) to ``model``'s forward + backward on ``forests`` (default
    :func:`calibration_forests` within the model's vocabulary): the fastest of ``repeats`` timed
    runs per forest (``repeats`` sweeps over the forests) after one warm-up run each; its
    ``forward_share``, the median over forests of the fastest no-grad forward (the recording pass
    of a microbatch the step reruns) per fastest forward + backward; its ``step``, the median over
    forests of the fastest :func:`step_host_work` on one rank, and ``step_ranks`` the median of what
    the same over 2 ranks takes more (0 where it takes less); its ``grad_bytes``,
    :func:`gradient_bytes`."""
    patch_model(model)
    vocab = model.get_input_embeddings().num_embeddings
    forests = list(forests) if forests is not None else calibration_forests(vocab)
    device = next(model.parameters()).device

    # One CPU thread: its CPU time, which a machine shared with other jobs does not inflate (wall
    # time there came out up to 2.7x the quiet machine's, and the fit with it); else wall time.
    clock = time.process_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter

    def run(forest: RolloutForest) -> tuple[float, float]:
        """(forward + backward seconds, no-grad forward seconds)."""
        began = clock()
        tree_forward(model, forest).logprobs.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        model.zero_grad(set_to_none=True)
        middle = clock()
        with torch.no_grad():
            tree_forward(model, forest)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return middle - began, clock() - middle

    def host(forest: RolloutForest, world_size: int) -> float:
        began = clock()
        step_host_work(model, forest, world_size)
        return clock() - began

    for forest in forests:
        run(forest)
    # [forests, (forward + backward, forward, host work on 1 rank, on 2)]
    seconds = np.full((len(forests), 4), np.inf)
    for _ in range(repeats):  # sweeps, not runs back to back: a busy spell on a shared machine hits one try of each
        seconds = np.minimum(seconds, [(*run(forest), host(forest, 1), host(forest, 2)) for forest in forests])
    share = float(np.median(seconds[:, 1] / seconds[:, 0]))
    fitted = fit_cost_model(np.stack([forest_features(f) for f in forests]), seconds[:, 0], min(share, 1.0))
    return dataclasses.replace(
        fitted,
        step=float(np.median(seconds[:, 2])),
        step_ranks=max(float(np.median(seconds[:, 3] - seconds[:, 2])), 0.0),
        grad_bytes=gradient_bytes(model),
    )


def step_host_work(model: torch.nn.Module, forest: RolloutForest, world_size: int = 1) -> None:
    """What a training step does for ``forest`` besides its model calls: the forest built from its
    rows, planned over ``world_size`` ranks (in two slots where its longest trajectory allows) and
    rank 0's Schedule compiled."""
    again = RolloutForest.from_sequences(forest.trajectories())
    budget = max(-(-forest.num_compact_tokens // 2), int(forest.lengths.max()))
    TreeEngine(model, again, plan(again, world_size=world_size, max_tokens_per_microbatch=budget))


def format_cost_model(cost: CostModel, title: str) -> str:
    """``title``, one line per coefficient and what it prices, and why a coefficient is 0: the fit
    is non-negative least squares, which drops a feature that does not explain the measured times."""
    values = cost.as_dict()
    unit = {"context_bytes": "B", "state_bytes": "B", "grad_bytes": "B", "duplex": "x"}
    meanings = FEATURE_MEANINGS | COMM_MEANINGS
    shown = {k: v for k, v in values.items() if k in meanings}
    lines = [title, legend({k: f"{v:.3e} {unit.get(k, 's')}  {meanings[k]}" for k, v in shown.items()})]
    lines.append("predicted seconds of a microbatch = sum of coefficient x feature; the planner balances on it")
    lines.append(
        f"forward share {cost.forward_share:.3f}: a no-grad forward's share of forward + backward (median over "
        "the forests), what a slot rerun in the backward costs again"
    )
    lines.append(f"step {cost.step:.3e} s: once a step, outside the model calls (forest, plan, Schedule)")
    lines.append(f"step_ranks {cost.step_ranks:.3e} s: once a step planned over several ranks, besides step")
    lines.append(
        f"outside the model calls at 1 / 2 / 8 ranks: {' / '.join(f'{cost.outside(r):.3e}' for r in (1, 2, 8))} s "
        "(host work; with several ranks the gradient all-reduce too)"
    )
    dropped = [name for name in FEATURE_MEANINGS if values[name] == 0]
    if dropped:
        lines.append(
            f"0 ({', '.join(dropped)}): dropped by the non-negative least-squares fit, as not explaining the "
            "measured times on this machine"
        )
    return "\n".join(lines)
