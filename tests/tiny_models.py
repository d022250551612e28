"""Tiny random causal LMs of every supported family, built offline from config classes.

Each family's tiny model (declared with the family in ``harts_hf.lab.models.FAMILIES``) covers
every layer kind of its family in 2-4 layers (hidden 32-64, vocab 128), so a tree test exercises
every patched kernel. Mamba2 families use a 16-token SSD chunk so short trees
cross several chunk boundaries; GDN/KDA keep transformers' fixed 64-token chunk.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from harts_hf.forest import RolloutForest
from harts_hf.lab.models import FAMILIES as DECLARED
from harts_hf.lab.models import TINY_EXPERTS, TINY_SHARED, TINY_VOCAB, installed
from harts_hf.modeling import tree_forward

__all__ = [
    "FAMILIES",
    "VOCAB",
    "Run",
    "as_layout",
    "family_forest",
    "in_vocab",
    "keep_float64",
    "loss_weights",
    "max_diffs",
    "oracle_run",
    "padded_run",
    "padding_is_zero",
    "sharpen_routers",
    "tiny_model",
    "trainable",
    "trajectory_logprobs",
    "tree_run",
    "variation",
]

VOCAB = TINY_VOCAB
EXPERTS = TINY_EXPERTS
FAMILIES = {name: f for name, f in DECLARED.items() if installed(f)}
"""The declared families the installed transformers has (the tests parametrize over them)."""


def tiny_model(
    family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, attn: str = "sdpa"
) -> tf.PreTrainedModel:
    """A freshly initialised tiny ``family`` causal LM (eval mode), reproducible from ``seed``;
    ``attn`` falls back to "eager" for families without sdpa support (gemma2); float64 MoE
    experts run eagerly."""
    spec = FAMILIES[family]
    kwargs = {**TINY_SHARED, **spec.tiny}
    for key in ("layer_types", "layers_block_type", "mlp_layer_types"):
        if key in kwargs:
            kwargs["num_hidden_layers"] = len(kwargs[key])
    config = getattr(tf, spec.config)(**kwargs)
    cls = getattr(tf, spec.model)
    config._attn_implementation = attn if cls._supports_sdpa or attn != "sdpa" else "eager"
    if dtype == torch.float64:
        config._experts_implementation = "eager"  # torch's grouped_mm has no float64 kernel
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    return model.eval()


@contextlib.contextmanager
def keep_float64() -> Iterator[None]:
    """Casts to float32 keep float64 tensors as they are and new tensors default to float64, so that
    every upcast in transformers' reference kernels and ours is the identity on a float64 model: the
    oracle and the tree then both compute in float64 and any difference above ~1e-14 is a real one."""

    def keeps(x: torch.Tensor, dtype) -> bool:
        return x.dtype == torch.float64 and dtype is torch.float32

    to, as_type, softmax = torch.Tensor.to, torch.Tensor.type, F.softmax

    def to_keeping(x, *a, **k):
        return x if keeps(x, a[0] if a else k.get("dtype")) else to(x, *a, **k)

    def softmax_keeping(x, *a, dtype=None, **k):
        return softmax(x, *a, dtype=None if keeps(x, dtype) else dtype, **k)

    default = torch.get_default_dtype()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "to", to_keeping)
        patch.setattr(torch.Tensor, "type", lambda x, *a, **k: x if a and keeps(x, a[0]) else as_type(x, *a, **k))
        patch.setattr(torch.Tensor, "float", lambda x, *a, **k: x.to(torch.float32, *a, **k))
        patch.setattr(F, "softmax", softmax_keeping)
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(default)


@torch.no_grad()
def sharpen_routers(model: torch.nn.Module, factor: float = 8.0) -> torch.nn.Module:
    """Scale every MoE router's weight: wide top-k margins, so bf16 rounding differences between
    two valid summation orders do not flip which experts a token reaches (the deterministic
    routing the MoE statistics assume; near-ties flip under any reordering, baseline included)."""
    for name, param in model.named_parameters():
        if re.search(r"\.(gate|router)\.weight$", name) and param.shape[0] == EXPERTS:
            param.mul_(factor)
    return model


# ---------------------------------------------------------------- forests and oracles
def _seg(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, VOCAB, size=n).tolist()


def family_forest(rng: np.random.Generator, *, small: bool = False) -> list[list[int]]:
    """The nasty shapes in few trajectories (the oracle runs each one): branches at depth 63, 64
    and 65 of one chain (the 64-token chunk edge; 16-token SSD chunks too), a 1-token leaf, a
    strict prefix and, unless ``small``, a duplicate, a trajectory past 80 tokens, a caterpillar
    under a second root and a 1-token trajectory (nothing to predict)."""
    chain = _seg(rng, 70)
    seqs = [chain[:63] + _seg(rng, 3), chain[:64] + _seg(rng, 1), chain[:65] + _seg(rng, 6), chain, chain[:30]]
    if small:
        return seqs
    seqs += [chain + _seg(rng, 12), list(chain)]
    trunk = _seg(rng, 4)
    for _ in range(3):
        seqs.append(trunk + _seg(rng, int(rng.integers(1, 4))))
        trunk = trunk + _seg(rng, int(rng.integers(2, 6)))
    seqs += [trunk, _seg(rng, 1)]
    return seqs


def in_vocab(seqs: list[list[int]]) -> list[list[int]]:
    """Map the shared nasty trees (ids up to 2^20) into the tiny vocabulary (ids 3..VOCAB-1)."""
    return [[t % (VOCAB - 3) + 3 for t in s] for s in seqs]


def trajectory_logprobs(model: torch.nn.Module, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Oracle: the model's own forward (no tree) on each trajectory, logits -> log_softmax ->
    gather; returns (log-probs [L - 1], entropies [L - 1]) per trajectory. Trajectories of equal
    length share one batch (rows never interact, no padding)."""
    out: list = [None] * len(seqs)
    lengths = np.array([len(s) for s in seqs])
    for length in np.unique(lengths):
        rows = np.flatnonzero(lengths == length)
        ids = torch.tensor([seqs[i] for i in rows])  # [b, L]
        logp = model(input_ids=ids, use_cache=False).logits[:, :-1].float().log_softmax(-1)  # [b, L - 1, V]
        lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        for r, i in enumerate(rows):
            out[i] = (lp[r], ent[r])
    return out


def as_layout(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-trajectory [L_i - 1] tensors -> [B, width] zero-padded (the tree_logprobs layout)."""
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])


# ---------------------------------------------------------------- tree vs oracle runs
@dataclass
class Run:
    """Log-probs [B, W] (detached, tree layout) and the gradients of ``sum(weights * logprobs)``."""

    logprobs: torch.Tensor
    grads: list[torch.Tensor]
    entropy: torch.Tensor | None = None


def loss_weights(forest: RolloutForest, seed: int = 0) -> torch.Tensor:
    """[B, W] fixed random per-token weights (an RL objective's dL/dlogp)."""
    return torch.rand(forest.num_trajectories, forest.max_length - 1, generator=torch.Generator().manual_seed(seed))


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _grads(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def oracle_run(model: torch.nn.Module, seqs: list[list[int]], weights: torch.Tensor) -> Run:
    rows = trajectory_logprobs(model, seqs)
    loss = sum((lp * weights[i, : lp.numel()].to(lp.dtype)).sum() for i, (lp, _) in enumerate(rows))
    width = weights.shape[1]
    return Run(
        as_layout([lp.detach() for lp, _ in rows], width),
        _grads(loss, trainable(model)),
        as_layout([ent.detach() for _, ent in rows], width),
    )


def padded_run(model: torch.nn.Module, seqs: list[list[int]], weights: torch.Tensor, *, left: bool = False) -> Run:
    """The model on all trajectories as ONE padded batch with an attention mask, right-padded or
    ``left``-padded (rows end together, as TRL lays out prompts), read back into the trajectory layout."""
    width = max(len(s) for s in seqs)
    lengths = torch.tensor([len(s) for s in seqs])
    start = width - lengths if left else torch.zeros_like(lengths)  # [B] column of each row's first token
    cols = torch.arange(width)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = (cols[None] >= start[:, None]) & (cols[None] < (start + lengths)[:, None])  # [B, width]
    ids[mask] = torch.tensor([t for s in seqs for t in s])
    logp = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits[:, :-1].float().log_softmax(-1)
    at = (start[:, None] + cols[None, :-1]).clamp(max=width - 2)  # [B, width - 1] prediction of position j
    keep = cols[None, :-1] < (lengths - 1)[:, None]
    lp = torch.where(keep, logp.gather(-1, ids[:, 1:, None])[..., 0].gather(1, at), 0.0)
    ent = torch.where(keep, -(logp.exp() * logp).sum(-1).gather(1, at), 0.0)
    return Run(lp.detach(), _grads((lp * weights.to(lp.dtype)).sum(), trainable(model)), ent.detach())


def tree_run(model: torch.nn.Module, forest: RolloutForest, weights: torch.Tensor) -> Run:
    out = tree_forward(model, forest, return_entropy=True)
    grads = _grads((out.logprobs * weights).sum(), trainable(model))
    return Run(out.logprobs.detach(), grads, out.entropy.detach())


def max_diffs(ref: Run, got: Run) -> tuple[float, float, float]:
    """(max |log-prob diff|, max |entropy diff|, max |grad diff| / max |ref grad|)."""
    lp = float((got.logprobs - ref.logprobs).abs().max())
    ent = float((got.entropy - ref.entropy).abs().max())
    scale = max(float(g.abs().max()) for g in ref.grads)
    grad = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got.grads, ref.grads))
    return lp, ent, grad / scale


def variation(ref: Run, other: Run, real: torch.Tensor) -> np.ndarray:
    """(mean |log-prob diff|, mean |entropy diff|, ||grad diff|| / ||ref grad|| over all parameters),
    log-probs and entropies over the ``real`` [B, W] tokens: how far ``other`` lies from ``ref`` in
    low precision, where single tokens move more than the rest (an MoE near-tie flips anywhere)."""
    diff = torch.cat([(a.float() - b.float()).flatten() for a, b in zip(other.grads, ref.grads)])
    norm = torch.cat([b.float().flatten() for b in ref.grads]).norm()
    return np.array(
        [
            float((other.logprobs - ref.logprobs)[real].abs().mean()),
            float((other.entropy - ref.entropy)[real].abs().mean()),
            float(diff.norm() / norm),
        ]
    )


def padding_is_zero(forest: RolloutForest, run: Run) -> bool:
    """Every entry past a row's end is exactly 0 (log-probs and entropies)."""
    past = torch.as_tensor(np.arange(forest.max_length - 1)[None] >= forest.lengths[:, None] - 1)
    return bool((run.logprobs[past] == 0).all() and (run.entropy[past] == 0).all())
