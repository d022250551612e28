"""KDA on trees vs transformers' torch ``chunk_kimi_delta_attention`` and fla's ``naive_recurrent_kda``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import check_kernel, check_piece, check_tree, fla_naive
from transformers.models.kimi_linear import modeling_kimi_linear
from trees import NASTY_TREES

from harts_hf.forest import RolloutForest
from harts_hf.ops.kda import kda_chunk_scan, tree_kda
from harts_hf.ops.tree_batch import TreeBatch

H, K, V = 2, 8, 6
SCALE = K**-0.5
NAMES = ("q", "k", "v", "g", "beta")
naive_recurrent_kda = fla_naive("kda").naive_recurrent_kda
# The stock torch function, without the hub/fla dispatch decorator.
chunk_kda_torch = modeling_kimi_linear.chunk_kimi_delta_attention.__wrapped__

PerTraj = Callable[[torch.Tensor], torch.Tensor]


def kda_inputs(n: int, gen: torch.Generator, heads_qk: int = H) -> dict[str, torch.Tensor]:
    """Raw inputs of n tokens (k not normalised); decays in the range KDA's forget gate produces."""
    return {
        "q": torch.randn(n, heads_qk, K, generator=gen),
        "k": torch.randn(n, heads_qk, K, generator=gen),
        "v": torch.randn(n, H, V, generator=gen),
        "g": -F.softplus(torch.randn(n, H, K, generator=gen)) * 0.3,
        "beta": torch.rand(n, H, generator=gen),
    }


def leaves_of(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: x.requires_grad_() for name, x in inputs.items()}


def transformers_oracle(chunk: int):
    def run(d: dict[str, torch.Tensor], h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta = (d[n][None] for n in NAMES)
        o, state = chunk_kda_torch(
            q, k, v, g=g, beta=beta, chunk_size=chunk, initial_state=h0[None], output_final_state=True
        )
        return o[0], state[0]

    return run


def fla_oracle(d: dict[str, torch.Tensor], h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, g, beta = (d[n][None] for n in NAMES)
    o, state = naive_recurrent_kda(q, k, v, g, beta, scale=SCALE, initial_state=h0[None], output_final_state=True)
    return o[0], state[0]


@pytest.mark.parametrize(
    "chunk, lengths",
    [
        pytest.param(16, [53, 40, 33, 16, 1], id="c16-mixed"),
        pytest.param(64, [150, 65, 64, 1], id="c64-mixed"),
    ],
)
@pytest.mark.parametrize("oracle", ["transformers", "fla"])
def test_kda_chunk_scan_matches_oracle_per_path(chunk: int, lengths: list[int], oracle: str) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = [kda_inputs(t, gen) for t in lengths]
    inputs = [{**d, "k": F.normalize(d["k"], dim=-1)} for d in inputs]
    h0 = torch.randn(len(lengths), H, K, V, generator=gen) * 0.5
    run = transformers_oracle(chunk) if oracle == "transformers" else fla_oracle
    check_kernel(kda_chunk_scan, run, inputs, h0, chunk, SCALE)


TREE_CASES = [pytest.param(build, 16, id=f"{name}-c16") for name, build in NASTY_TREES.items()]
TREE_CASES += [
    pytest.param(NASTY_TREES[name], 64, id=f"{name}-c64") for name in ("branch_at_63", "branch_at_64", "branch_at_65")
]


@pytest.mark.parametrize("build, chunk", TREE_CASES)
def test_tree_kda_matches_transformers_per_trajectory(build, chunk: int) -> None:
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    leaves = leaves_of(kda_inputs(forest.num_compact_tokens, torch.Generator().manual_seed(1)))

    def tree(batch: TreeBatch) -> torch.Tensor:
        return tree_kda(*(leaves[n] for n in NAMES), batch, use_qk_l2norm=True, chunk_size=chunk)[0]

    def oracle(per_traj: PerTraj) -> torch.Tensor:
        q, k, v, g, beta = (per_traj(leaves[n]) for n in NAMES)
        return chunk_kda_torch(q, k, v, g=g, beta=beta, chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0]

    check_tree(forest, leaves, tree, oracle)


@pytest.mark.parametrize("build", [pytest.param(build, id=name) for name, build in NASTY_TREES.items()])
def test_tree_kda_grouped_heads_match_fla_per_trajectory(build) -> None:
    """One q/k head shared by two value heads (GVA), as fla's KDA allows."""
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    leaves = leaves_of(kda_inputs(forest.num_compact_tokens, torch.Generator().manual_seed(2), heads_qk=1))

    def inputs(take: PerTraj) -> list[torch.Tensor]:
        q, k, v, g, beta = (take(leaves[n]) for n in NAMES)
        return [q, F.normalize(k, dim=-1), v, g, beta]

    def tree(batch: TreeBatch) -> torch.Tensor:
        return tree_kda(*inputs(lambda x: x), batch, chunk_size=16)[0]

    def oracle(per_traj: PerTraj) -> torch.Tensor:
        return naive_recurrent_kda(*inputs(per_traj), scale=SCALE)[0]

    check_tree(forest, leaves, tree, oracle)


@pytest.mark.parametrize(
    "name, depth", [pytest.param("grpo_group", 40, id="grpo_group"), pytest.param("caterpillar", 30, id="caterpillar")]
)
def test_tree_kda_piece_with_context_equals_whole_forest(name: str, depth: int) -> None:
    """Context replay (k, v, g, beta of context tokens, l2-normalised here) and boundary states."""
    forest = RolloutForest.from_sequences(NASTY_TREES[name](np.random.default_rng(0)))
    leaves = leaves_of(kda_inputs(forest.num_compact_tokens, torch.Generator().manual_seed(3)))

    def run(batch, own, ctx, initial_states):
        return tree_kda(
            *(leaves[n][own] for n in NAMES),
            batch,
            use_qk_l2norm=True,
            chunk_size=16,
            context=None if ctx is None else {n: leaves[n][ctx] for n in ("k", "v", "g", "beta")},
            initial_states=initial_states,
        )

    check_piece(forest, np.flatnonzero(forest.position >= depth), 16, leaves, run)
