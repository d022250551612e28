"""``calibrate(model)``: fit the planner's cost model on this machine by timing a model on trees.

Times one forward + backward of ``tree_forward`` per forest over forests of varied size, depth
and branching (the shapes of ``harts_hf.sources``), each as one microbatch, and fits
:func:`~harts_hf.planner.cost.fit_cost_model` on their features (compact tokens, attended pairs,
rounds, 1). Imports the modeling stack, unlike the rest of the planner.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from ..forest import RolloutForest
from ..modeling import patch_model, tree_forward
from ..planner.cost import CostModel, fit_cost_model
from ..sources import caterpillar, deep_chain, grpo_group, random_tree
from ..trees import min_rounds
from .plan_report import legend

__all__ = ["calibrate", "calibration_forests", "forest_features", "format_cost_model"]

FEATURE_MEANINGS = {
    "token": "per compact token: projections, MLP/MoE, norms, LM head",
    "pair": "per attended pair (query, key it reads): full attention's quadratic part",
    "round": "per round: a sequential packed linear-attention call",
    "microbatch": "per microbatch: fixed overhead (launches, gathers)",
}
"""What each coefficient of :class:`CostModel` prices (``planner/cost.py`` says more)."""


def forest_features(forest: RolloutForest) -> np.ndarray:
    """[4] the cost model's features of ``forest`` run whole as one microbatch."""
    pairs = float((forest.position + 1).sum())
    rounds = float(min_rounds(forest.node_parent)[0].max())
    return np.array([forest.num_compact_tokens, pairs, rounds, 1.0])


def calibration_forests(vocab: int, *, sizes: Sequence[float] = (0.5, 1.0, 2.0), seed: int = 0) -> list[RolloutForest]:
    """Forests that separate the features: flat groups (tokens), long prompts (pairs), deep
    branchings, caterpillars and random trees (rounds), at every size in ``sizes`` (trajectories
    stay under 512 tokens at size 2, within tiny models' position range; a few hundred compact
    tokens each, so the torch fallbacks time them in seconds on a CPU)."""
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
    return out


def calibrate(
    model: torch.nn.Module,
    forests: Sequence[RolloutForest] | None = None,
    *,
    repeats: int = 3,
) -> CostModel:
    """Fit a :class:`CostModel` (seconds) to ``model``'s forward + backward on ``forests`` (default
    :func:`calibration_forests` within the model's vocabulary): the fastest of ``repeats`` timed
    runs per forest after one warm-up run."""
    patch_model(model)
    vocab = model.get_input_embeddings().num_embeddings
    forests = list(forests) if forests is not None else calibration_forests(vocab)
    device = next(model.parameters()).device

    def run(forest: RolloutForest) -> float:
        began = time.perf_counter()
        tree_forward(model, forest).logprobs.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    seconds = []
    for forest in forests:
        run(forest)
        seconds.append(min(run(forest) for _ in range(repeats)))
    return fit_cost_model(np.stack([forest_features(f) for f in forests]), np.array(seconds))


def format_cost_model(cost: CostModel, title: str) -> str:
    """``title``, one line per coefficient and what it prices, and why a coefficient is 0: the fit
    is non-negative least squares, which drops a feature that does not explain the measured times."""
    values = cost.as_dict()
    lines = [title, legend({name: f"{value:.3e} s  {FEATURE_MEANINGS[name]}" for name, value in values.items()})]
    lines.append("predicted seconds of a microbatch = sum of coefficient x feature; the planner balances on it")
    dropped = [name for name, value in values.items() if value == 0]
    if dropped:
        lines.append(
            f"0 ({', '.join(dropped)}): dropped by the non-negative least-squares fit, as not explaining the "
            "measured times on this machine"
        )
    return "\n".join(lines)
