"""``verify``: run a probe forest through a patched model both ways and report the differences.

Tree way: :func:`tree_logprobs` once over the forest. Reference way: the same model without a
tree (the unpatched code path) on each trajectory separately, ``logits -> log_softmax -> gather``.
Both get the gradient of the same weighted sum of log-probs w.r.t. every trainable parameter.
The model runs in eval mode for the probe (dropout would make both ways random) and is put
back in its previous mode; parameter ``.grad`` fields are left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..forest import RolloutForest
from .logprobs import tree_logprobs
from .registry import patched_adapter

__all__ = ["VerifyReport", "probe_forest", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """Max differences tree vs trajectory-wise (gradients relative to the largest gradient)."""

    family: str
    dtype: torch.dtype
    max_logprob_diff: float
    max_grad_diff: float
    max_grad: float
    logprob_tol: float
    grad_tol: float

    @property
    def ok(self) -> bool:
        return self.max_logprob_diff <= self.logprob_tol and self.max_grad_diff <= self.grad_tol * max(
            self.max_grad, 1e-30
        )

    def __str__(self) -> str:
        return (
            f"{self.family} ({self.dtype}): max |dlogp| = {self.max_logprob_diff:.3g} (tol {self.logprob_tol:g}), "
            f"max |dgrad| = {self.max_grad_diff:.3g} of max |grad| {self.max_grad:.3g} (tol {self.grad_tol:g} relative)"
            f" -> {'ok' if self.ok else 'FAILED'}"
        )


def probe_forest(vocab_size: int, *, seed: int = 0) -> RolloutForest:
    """A small forest with the shapes that break tree code: branches just before, at and after a
    64-token chunk boundary, a 1-token leaf, a strict prefix, a duplicate and a second root."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab_size, 62).tolist()
    seqs = [prompt + rng.integers(0, vocab_size, n).tolist() for n in (1, 2, 3, 9)]
    seqs += [
        seqs[-1] + rng.integers(0, vocab_size, 4).tolist(),
        seqs[-1][:40],
        seqs[1],
        rng.integers(0, vocab_size, 5).tolist(),
    ]
    return RolloutForest.from_sequences(seqs)


def _weighted_grads(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    if not params:  # a frozen model: log-probs only
        return []
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _trajectory_wise(model: torch.nn.Module, forest: RolloutForest, weights: torch.Tensor, params: list) -> tuple:
    """Reference: each trajectory alone through the model's own (no-tree) forward."""
    device = weights.device
    logprobs = torch.zeros_like(weights)
    grads = [torch.zeros_like(p) for p in params]
    for i, seq in enumerate(forest.trajectories()):
        if seq.size < 2:
            continue
        ids = torch.as_tensor(seq, device=device)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # [L_i - 1, V]
        lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        for acc, g in zip(grads, _weighted_grads((lp * weights[i, : lp.numel()]).sum(), params)):
            acc += g
        logprobs[i, : lp.numel()] = lp.detach()
    return logprobs, grads


def verify(
    model: torch.nn.Module,
    forest: RolloutForest | None = None,
    *,
    seed: int = 0,
    logprob_tol: float | None = None,
    grad_tol: float | None = None,
    print_report: bool = True,
) -> VerifyReport:
    """Compare tree log-probs and parameter gradients with trajectory-wise runs of ``model``.

    Default tolerances: 1e-4 (fp32 parameters) or 0.1 (half precision), absolute for log-probs
    and relative to the largest gradient for gradients.
    """
    hf, adapter = patched_adapter(model)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype if params else next(model.parameters()).dtype
    loose = dtype in (torch.bfloat16, torch.float16)
    forest = forest if forest is not None else probe_forest(hf.get_input_embeddings().num_embeddings, seed=seed)
    device = hf.get_output_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(forest.num_trajectories, forest.max_length - 1, generator=gen).to(device)
    was_training = model.training
    model.eval()
    try:
        lp = tree_logprobs(model, forest)
        tree_grads = _weighted_grads((lp * weights).sum(), params)
        ref_lp, ref_grads = _trajectory_wise(model, forest, weights, params)
    finally:
        model.train(was_training)
    grad_diff = max((float((a - b).abs().max()) for a, b in zip(tree_grads, ref_grads) if a.numel()), default=0.0)
    report = VerifyReport(
        family=adapter.family,
        dtype=dtype,
        max_logprob_diff=float((lp.detach() - ref_lp).abs().max()) if lp.numel() else 0.0,
        max_grad_diff=grad_diff,
        max_grad=max((float(g.abs().max()) for g in ref_grads if g.numel()), default=0.0),
        logprob_tol=logprob_tol if logprob_tol is not None else (0.1 if loose else 1e-4),
        grad_tol=grad_tol if grad_tol is not None else (0.1 if loose else 1e-4),
    )
    if print_report:
        print(f"harts-hf verify: {report}")
    return report
