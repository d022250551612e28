"""The policy loss every benchmark mode back-propagates: GRPO's per-token surrogate.

``-A_i * exp(lp - lp.detach())`` on trained tokens, summed and divided by the number of trained
tokens of the whole batch (TRL's DAPO normalisation), so a loss split over microbatches sums to
the loss of the whole batch and all modes produce the same gradients: ``A_i * d lp / d theta``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["grpo_advantages", "policy_loss"]


def grpo_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """[B] group-normalised rewards ``(r - mean_g) / (std_g + eps)``.

    A batch whose rewards are all equal has no signal; the benchmark still needs gradients to
    compare, so it then falls back to the centred trajectory index (a fixed, non-zero weighting).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    _, group = np.unique(groups, return_inverse=True)
    count = np.bincount(group)
    mean = np.bincount(group, rewards) / count
    var = np.bincount(group, (rewards - mean[group]) ** 2) / count
    adv = (rewards - mean[group]) / (np.sqrt(var[group]) + eps)
    if not np.any(adv):
        idx = np.arange(rewards.size, dtype=np.float64)
        adv = (idx - idx.mean()) / max(idx.std(), 1.0)
    return adv


def policy_loss(
    logprobs: torch.Tensor,  # [b, L - 1] log-probs of the rows' tokens 1..L-1
    advantages: torch.Tensor,  # [b]
    mask: torch.Tensor,  # [b, L - 1] bool: the predicted token is trained
    trained_tokens: int,  # trained tokens of the whole batch (the normaliser)
) -> torch.Tensor:
    ratio = torch.exp(logprobs - logprobs.detach())
    per_token = -advantages[:, None].to(ratio.dtype) * ratio
    return torch.where(mask, per_token, 0.0).sum() / trained_tokens
