"""GDN on trees vs transformers' ``torch_chunk_gated_delta_rule`` and fla's ``naive_recurrent_gated_delta_rule``.

The tree op runs every compact token once; the oracles run every root-to-leaf trajectory on its
own (rows of one right-padded batch: padding with q=k=v=0, g=0, beta=0 leaves every row exact).
Outputs are compared per trajectory through the restore index; gradients of a random linear
functional of all trajectory outputs are compared w.r.t. the compact inputs (the oracle side's
gather scatter-adds per-trajectory gradients onto compact tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import assert_close, check_kernel, fla_naive
from transformers.models.qwen3_5 import modeling_qwen3_5
from trees import NASTY_TREES, nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.ops.gated_delta import gdn_chunk_scan, tree_gated_delta_rule
from harts_hf.ops.tree_batch import TreeBatch

HK, H, K, V = 1, 2, 8, 6  # GVA: two value heads per key head
SCALE = K**-0.5
# The stock torch function, without the hub/fla dispatch decorator.
chunk_gdn_torch = modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__
naive_recurrent_gdn = fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule


def gdn_inputs(n: int, gen: torch.Generator, k_heads: int = HK) -> dict[str, torch.Tensor]:
    """Random per-token GDN inputs for n tokens (q/k with ``k_heads`` heads, v/g/beta with H)."""
    return {
        "q": torch.randn(n, k_heads, K, generator=gen),
        "k": torch.randn(n, k_heads, K, generator=gen) * 0.5,
        "v": torch.randn(n, H, V, generator=gen),
        "g": -F.softplus(torch.randn(n, H, generator=gen)) * 0.05,  # slow decay: states matter across 64 tokens
        "beta": torch.rand(n, H, generator=gen),
    }


def padded_trajectories(forest: RolloutForest, x: torch.Tensor) -> torch.Tensor:
    """[B, max_len, ...] per-trajectory gather of compact rows, zero right padding."""
    idx = torch.as_tensor(forest.padded(forest.restore, fill=-1))
    rows = torch.cat((x, x.new_zeros(1, *x.shape[1:])))
    return rows[idx]


def oracle_outputs(
    forest: RolloutForest, inputs: dict[str, torch.Tensor], oracle: str, chunk: int, l2: bool
) -> torch.Tensor:
    """[B, max_len, H, V] every trajectory run alone by the oracle."""
    q, k, v, g, beta = (padded_trajectories(forest, inputs[n]) for n in ("q", "k", "v", "g", "beta"))
    if oracle == "transformers":
        return chunk_gdn_torch(q, k, v, g, beta, chunk_size=chunk, use_qk_l2norm_in_kernel=l2)[0]
    if l2:
        q, k = modeling_qwen3_5.l2norm(q), modeling_qwen3_5.l2norm(k)
    q, k = (x.repeat_interleave(H // q.shape[2], dim=2) for x in (q, k))
    return naive_recurrent_gdn(q, k, v, beta, g, scale=SCALE)[0]


def test_chunk_scan_matches_transformers_per_path() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths, chunk = [53, 40, 33, 16, 1], 16
    inputs = [gdn_inputs(t, gen, k_heads=H) for t in lengths]
    for d in inputs:
        d["k"] = F.normalize(d["k"], dim=-1)
    h0 = torch.randn(len(lengths), H, K, V, generator=gen) * 0.5

    def run(d: dict[str, torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        args = (d[n][None] for n in ("q", "k", "v", "g", "beta"))
        o, final = chunk_gdn_torch(*args, chunk_size=chunk, initial_state=state[None], output_final_state=True)
        return o[0], final[0]

    check_kernel(gdn_chunk_scan, run, inputs, h0, chunk, SCALE)


@pytest.mark.parametrize("build", nasty_tree_params())
@pytest.mark.parametrize(
    "chunk, l2, oracle",
    [
        pytest.param(64, True, "transformers", id="c64-l2-transformers"),
        pytest.param(16, False, "transformers", id="c16-transformers"),
        pytest.param(16, True, "fla", id="c16-l2-fla"),
    ],
)
def test_tree_matches_trajectories(build, chunk: int, l2: bool, oracle: str) -> None:
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    gen = torch.Generator().manual_seed(1)
    inputs = {n: x.requires_grad_() for n, x in gdn_inputs(forest.num_compact_tokens, gen).items()}

    got, _ = tree_gated_delta_rule(*inputs.values(), batch, chunk_size=chunk, use_qk_l2norm=l2)
    got = padded_trajectories(forest, got)
    ref = oracle_outputs(forest, inputs, oracle, chunk, l2)
    valid = torch.as_tensor(forest.padded(np.ones(forest.num_trajectory_tokens, dtype=bool), fill=False))
    assert_close("o", ref[valid], got[valid])

    weight = torch.randn(ref.shape, generator=gen) * valid[..., None, None]
    ref_grads = torch.autograd.grad((weight * ref).sum(), list(inputs.values()))
    got_grads = torch.autograd.grad((weight * got).sum(), list(inputs.values()))
    for name, r, g in zip(inputs, ref_grads, got_grads):
        assert_close(f"grad {name}", r, g)


@pytest.mark.parametrize("name", ["caterpillar", "branch_at_64", "deep_chain"])
def test_boundary_states_match_trajectory_prefixes(name: str) -> None:
    """``states_out`` after token t == the oracle's final state on the root path up to t."""
    chunk = 16
    forest = RolloutForest.from_sequences(NASTY_TREES[name](np.random.default_rng(0)))
    inputs = gdn_inputs(forest.num_compact_tokens, torch.Generator().manual_seed(3))
    tokens = np.flatnonzero((forest.position + 1) % chunk == 0)
    batch = TreeBatch.from_forest(forest).with_state_out({chunk: tokens})
    _, states = tree_gated_delta_rule(*inputs.values(), batch, chunk_size=chunk)
    owner = np.empty(forest.num_compact_tokens, dtype=np.int64)  # a trajectory through each token
    owner[forest.restore] = np.repeat(np.arange(forest.num_trajectories), forest.lengths)
    for t, got in zip(tokens, states):
        path = torch.as_tensor(forest.trajectory_index(owner[t])[: forest.position[t] + 1])
        args = (inputs[n][path][None] for n in ("q", "k", "v", "g", "beta"))
        ref = chunk_gdn_torch(*args, chunk_size=chunk, output_final_state=True)[1][0]
        assert_close(f"state after token {t}", ref, got)


def test_bf16_inputs_give_outputs_in_v_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Math runs in fp32 (like the oracle); only the output is cast back to v's dtype."""
    monkeypatch.setenv("HARTS_BACKEND", "torch")
    forest = RolloutForest.from_sequences(NASTY_TREES["grpo_group"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    gen = torch.Generator().manual_seed(4)
    inputs = {n: x.bfloat16() for n, x in gdn_inputs(forest.num_compact_tokens, gen).items()}
    got, _ = tree_gated_delta_rule(*inputs.values(), batch, use_qk_l2norm=True)
    ref, _ = tree_gated_delta_rule(*(x.float() for x in inputs.values()), batch, use_qk_l2norm=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref.bfloat16())
