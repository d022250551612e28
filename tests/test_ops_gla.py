"""GLA / simple GLA (and Mamba2-SSD, lightning attention) on trees vs fla's naive references and transformers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import check_kernel, check_piece, check_tree, fla_naive
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
from transformers.models.nemotron_h import modeling_nemotron_h
from trees import NASTY_TREES, nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.ops.gla import (
    gla_chunk_scan,
    simple_gla_chunk_scan,
    tree_gla,
    tree_lightning,
    tree_mamba2_ssd,
    tree_simple_gla,
)
from harts_hf.ops.tree_batch import TreeBatch

H, K, V = 2, 8, 6
SCALE = K**-0.5
naive_gla = fla_naive("gla")
naive_simple_gla = fla_naive("simple_gla")

KERNEL_CASES = [
    pytest.param(16, [53, 40, 33, 16, 1], id="c16-mixed"),
    pytest.param(64, [150, 65, 64, 1], id="c64-mixed"),
]


def gla_inputs(length: int, gen: torch.Generator, per_channel: bool) -> dict[str, torch.Tensor]:
    decay_shape = (length, H, K) if per_channel else (length, H)
    return {
        "q": torch.randn(length, H, K, generator=gen),
        "k": torch.randn(length, H, K, generator=gen),
        "v": torch.randn(length, H, V, generator=gen),
        "g": -F.softplus(torch.randn(decay_shape, generator=gen)) * 0.3,
    }


def gla_oracle(d: dict[str, torch.Tensor], h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    o, state = naive_gla.naive_recurrent_gla(
        *(d[n][None] for n in NAMES), initial_state=h0[None], output_final_state=True
    )
    return o[0], state[0]


def simple_gla_chunk_oracle(chunk: int):
    def run(d: dict[str, torch.Tensor], h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, state = naive_simple_gla.naive_chunk_simple_gla(
            *(d[n][None] for n in NAMES),
            initial_state=h0[None],
            output_final_state=True,
            chunk_size=chunk,
            scale=SCALE,
        )
        return o[0], state[0]

    return run


def simple_gla_recurrent_oracle(d: dict[str, torch.Tensor], h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    o, state = naive_simple_gla.naive_recurrent_simple_gla(
        *(d[n][None] for n in NAMES), scale=SCALE, initial_state=h0[None], output_final_state=True
    )
    return o[0], state[0]


@pytest.mark.parametrize("chunk, lengths", KERNEL_CASES)
def test_gla_chunk_scan_matches_naive_recurrent_per_path(chunk: int, lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = [gla_inputs(t, gen, per_channel=True) for t in lengths]
    h0 = torch.randn(len(lengths), H, K, V, generator=gen) * 0.5
    check_kernel(gla_chunk_scan, gla_oracle, inputs, h0, chunk, SCALE)


@pytest.mark.parametrize("chunk, lengths", KERNEL_CASES)
@pytest.mark.parametrize("oracle", ["chunk", "recurrent"])
def test_simple_gla_chunk_scan_matches_naive_per_path(chunk: int, lengths: list[int], oracle: str) -> None:
    gen = torch.Generator().manual_seed(1)
    inputs = [gla_inputs(t, gen, per_channel=False) for t in lengths]
    h0 = torch.randn(len(lengths), H, K, V, generator=gen) * 0.5
    run = simple_gla_chunk_oracle(chunk) if oracle == "chunk" else simple_gla_recurrent_oracle
    check_kernel(simple_gla_chunk_scan, run, inputs, h0, chunk, SCALE)


TREE_CASES = nasty_tree_params()
PIECES = [pytest.param("grpo_group", 40, id="grpo_group"), pytest.param("caterpillar", 30, id="caterpillar")]


PerTraj = Callable[[torch.Tensor], torch.Tensor]
NAMES = ("q", "k", "v", "g")


def forest_of(build) -> RolloutForest:
    return RolloutForest.from_sequences(build(np.random.default_rng(0)))


def gla_leaves(n: int, per_channel: bool, seed: int) -> dict[str, torch.Tensor]:
    leaves = gla_inputs(n, torch.Generator().manual_seed(seed), per_channel)
    return {name: x.requires_grad_() for name, x in leaves.items()}


@pytest.mark.parametrize("build", TREE_CASES)
def test_tree_gla_matches_fla_per_trajectory(build) -> None:
    forest = forest_of(build)
    leaves = gla_leaves(forest.num_compact_tokens, True, 1)

    def tree(batch: TreeBatch) -> torch.Tensor:
        return tree_gla(*(leaves[n] for n in NAMES), batch, chunk_size=16)[0]

    def oracle(per_traj: PerTraj) -> torch.Tensor:
        return naive_gla.naive_recurrent_gla(*(per_traj(leaves[n]) for n in NAMES))[0]

    check_tree(forest, leaves, tree, oracle)


@pytest.mark.parametrize("build", TREE_CASES)
def test_tree_simple_gla_matches_fla_per_trajectory(build) -> None:
    forest = forest_of(build)
    leaves = gla_leaves(forest.num_compact_tokens, False, 2)

    def tree(batch: TreeBatch) -> torch.Tensor:
        return tree_simple_gla(*(leaves[n] for n in NAMES), batch, chunk_size=16)[0]

    def oracle(per_traj: PerTraj) -> torch.Tensor:
        return naive_simple_gla.naive_chunk_simple_gla(*(per_traj(leaves[n]) for n in NAMES), chunk_size=16)[0]

    check_tree(forest, leaves, tree, oracle)


# Mamba2: value heads H, groups G (B/C heads), head dim P, state size S.
M_HEADS, M_GROUPS, M_HEAD_DIM, M_STATE = 4, 2, 6, 8
mamba2_chunk_scan = modeling_nemotron_h.mamba2_chunk_scan.__wrapped__


def mamba2_leaves(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    leaves = {
        "x": torch.randn(n, M_HEADS, M_HEAD_DIM, generator=gen),
        "dt": torch.randn(n, M_HEADS, generator=gen),
        "B": torch.randn(n, M_GROUPS, M_STATE, generator=gen),
        "C": torch.randn(n, M_GROUPS, M_STATE, generator=gen),
        "A": -torch.rand(M_HEADS, generator=gen) - 0.5,
        "D": torch.randn(M_HEADS, generator=gen),
        "dt_bias": torch.randn(M_HEADS, generator=gen) * 0.5,
    }
    return {name: x.requires_grad_() for name, x in leaves.items()}


MAMBA2_OPTIONS = {"dt_softplus": True, "dt_limit": (0.0, 1.5)}


@pytest.mark.parametrize("build", TREE_CASES)
def test_tree_mamba2_ssd_matches_transformers_per_trajectory(build) -> None:
    forest = forest_of(build)
    leaves = mamba2_leaves(forest.num_compact_tokens, 3)
    ssd = ("x", "dt", "A", "B", "C")

    def tree(batch: TreeBatch) -> torch.Tensor:
        return tree_mamba2_ssd(
            *(leaves[n] for n in ssd), leaves["D"], batch, chunk_size=16, dt_bias=leaves["dt_bias"], **MAMBA2_OPTIONS
        )[0]

    def oracle(per_traj: PerTraj) -> torch.Tensor:
        x, dt, B, C = (per_traj(leaves[n]) for n in ("x", "dt", "B", "C"))
        return mamba2_chunk_scan(
            x, dt, leaves["A"], B, C, chunk_size=16, D=leaves["D"], dt_bias=leaves["dt_bias"], **MAMBA2_OPTIONS
        )

    check_tree(forest, leaves, tree, oracle)


def minimax_lightning(heads: int = 4, head_dim: int = 4, block: int = 16) -> MiniMaxLightningAttention:
    config = MiniMaxConfig(
        hidden_size=16,
        num_attention_heads=heads,
        head_dim=head_dim,
        block_size=block,
        num_hidden_layers=2,
        num_key_value_heads=1,
        intermediate_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    return MiniMaxLightningAttention(config, layer_idx=0)


@pytest.mark.parametrize("build", TREE_CASES)
def test_tree_lightning_matches_minimax_layer_per_trajectory(build) -> None:
    """The MiniMax layer with its lightning recurrence swapped for ``tree_lightning`` == the stock layer."""
    forest = forest_of(build)
    layer = minimax_lightning()
    hidden = torch.randn(forest.num_compact_tokens, 16, generator=torch.Generator().manual_seed(4)).requires_grad_()
    leaves = {"hidden": hidden, **dict(layer.named_parameters())}
    heads, head_dim = layer.num_attention_heads, layer.head_dim

    def tree(batch: TreeBatch) -> torch.Tensor:
        qkv = layer.act_fn(layer.qkv_proj(hidden)).reshape(-1, heads, 3 * head_dim)
        q, k, v = torch.split(qkv, head_dim, dim=-1)
        o, _ = tree_lightning(q, k, v, layer.slope_rate, batch, chunk_size=layer.block_size)
        o = layer.norm(o.reshape(-1, heads * head_dim))
        return layer.out_proj(torch.sigmoid(layer.output_gate(hidden)) * o)

    def oracle(per_traj: PerTraj) -> torch.Tensor:
        return layer(per_traj(hidden), position_embeddings=None, attention_mask=None)[0]

    check_tree(forest, leaves, tree, oracle)


def piece_leaves(kind: str, n: int) -> dict[str, torch.Tensor]:
    if kind == "mamba2":
        return mamba2_leaves(n, 5)
    leaves = gla_leaves(n, kind == "gla", 5)
    if kind == "lightning":
        del leaves["g"]  # a constant decay: the slope
    return leaves


@pytest.mark.parametrize("name, depth", PIECES)
@pytest.mark.parametrize("kind", ["gla", "simple_gla", "lightning", "mamba2"])
def test_tree_piece_with_context_equals_whole_forest(kind: str, name: str, depth: int) -> None:
    """Each wrapper prepares its context tokens' inputs (replay) like its own; boundary states hand over."""
    forest = forest_of(NASTY_TREES[name])
    leaves = piece_leaves(kind, forest.num_compact_tokens)
    slope = torch.tensor([0.3, 0.05])

    def run(batch, own, ctx, initial_states):
        def take(names: tuple[str, ...], rows: torch.Tensor) -> list[torch.Tensor]:
            return [leaves[n][rows] for n in names]

        def context(names: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
            return None if ctx is None else dict(zip(names, take(names, ctx)))

        opts = {"chunk_size": 16, "initial_states": initial_states}
        if kind == "mamba2":
            x, dt, B, C = take(("x", "dt", "B", "C"), own)
            ssd_opts = {"dt_bias": leaves["dt_bias"], **MAMBA2_OPTIONS, **opts}
            return tree_mamba2_ssd(
                x, dt, leaves["A"], B, C, leaves["D"], batch, context=context(("x", "dt", "B")), **ssd_opts
            )
        if kind == "lightning":
            return tree_lightning(*take(("q", "k", "v"), own), slope, batch, context=context(("k", "v")), **opts)
        op = tree_gla if kind == "gla" else tree_simple_gla
        return op(*take(("q", "k", "v", "g"), own), batch, context=context(("k", "v", "g")), **opts)

    check_piece(forest, np.flatnonzero(forest.position >= depth), 16, leaves, run)
