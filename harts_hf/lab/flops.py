"""Analytic FLOP count of a model on a workload: what prefix sharing can save, at best.

Forward FLOPs = token-wise work x tokens + attention work x attended (query, key) pairs
+ linear-attention work x tokens. Backward costs about twice the forward for every term, so the
ratio between two layouts of the same rollouts (the *ideal speedup*) is the same for the forward,
the backward and the step. Trajectory-wise training computes every trajectory token and attends
every causal pair of every trajectory; the forest computes every compact token once and attends
each compact token's root path once. Chunk padding, path replay and bookkeeping are what real
kernels add on top: they count against the measured efficiency, never in the ideal.

Per-token token-wise work is read off the parameter shapes (every matrix is one multiply-add
per element per token; routed experts count top_k of experts). Mixer terms use the chunkwise
algorithms transformers and fla run (C = chunk size, per head):
delta rule (GDN, KDA): 2C(3K + 2V) + 6KV; Mamba2 SSD: 2C(N + P) + 4NP; attention per pair:
2 heads (D_qk + D_v).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import nn

from ..forest import RolloutForest
from .models import Arch

__all__ = ["FlopModel", "Work", "compact_work", "ideal_speedup", "trajectory_work"]


@dataclass(frozen=True)
class Work:
    """The amounts the FLOP terms multiply: tokens computed and (query, key) pairs attended."""

    tokens: int
    pairs: int


def trajectory_work(forest: RolloutForest) -> Work:
    """Trajectory-wise training: every trajectory token, every causal pair of every trajectory."""
    lengths = forest.lengths.astype(np.int64)
    return Work(int(lengths.sum()), int((lengths * (lengths + 1) // 2).sum()))


def compact_work(forest: RolloutForest) -> Work:
    """The forest: every compact token once, attending its root path (depth + 1 keys)."""
    return Work(forest.num_compact_tokens, int((forest.position + 1).sum()))


def _token_flops(model: nn.Module, arch: Arch) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 2 or isinstance(module, nn.Conv1d):
                total += 2 * p.numel()
            elif p.dim() == 3:
                if arch.experts == 0 or p.shape[0] != arch.experts:
                    raise ValueError(
                        f"{type(module).__name__}.{name} {tuple(p.shape)}: a 3-D weight that is not "
                        f"stacked over the {arch.experts} routed experts"
                    )
                total += 2 * p.numel() * arch.top_k // arch.experts
    return total


def _linear_flops(arch: Arch) -> int:
    c, k, v = arch.chunk, arch.key_dim, arch.value_dim
    if arch.linear_kind == "delta":
        per_head = 2 * c * (3 * k + 2 * v) + 6 * k * v
    elif arch.linear_kind == "ssd":
        per_head = 2 * c * (k + v) + 4 * k * v
    elif arch.linear_kind == "scan":  # per channel and token: discretise (dt A, dt B x), update, read out C h
        per_head = 7 * k
    else:
        return 0
    return arch.linear_layers * arch.linear_heads * per_head


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs of one model: per token (token-wise), per attended pair, per linear-mixer token."""

    token: int
    pair: int
    linear: int

    @classmethod
    def of(cls, model: nn.Module, arch: Arch) -> FlopModel:
        pair = arch.attention_layers * 2 * arch.attention_heads * (arch.qk_dim + arch.v_dim)
        return cls(_token_flops(model, arch), pair, _linear_flops(arch))

    def forward(self, work: Work) -> int:
        return (self.token + self.linear) * work.tokens + self.pair * work.pairs

    def step(self, work: Work) -> int:
        """Forward + backward (twice the forward)."""
        return 3 * self.forward(work)

    def shares(self, work: Work) -> dict[str, float]:
        """Fraction of the forward spent in token-wise, attention and linear-mixer work."""
        total = self.forward(work)
        return {
            "token": self.token * work.tokens / total,
            "attention": self.pair * work.pairs / total,
            "linear": self.linear * work.tokens / total,
        }


def ideal_speedup(flops: FlopModel, forest: RolloutForest) -> float:
    """Trajectory-wise FLOPs over forest FLOPs for the rollouts of ``forest``."""
    return flops.forward(trajectory_work(forest)) / flops.forward(compact_work(forest))
