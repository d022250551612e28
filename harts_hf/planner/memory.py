"""What a microbatch holds in memory, and the budget the planner fits every microbatch into.

A microbatch computes its own tokens with grad and reads the ancestors it does not hold (its
*context*, computed in earlier slots) only as the boundary values its layers take: K/V in each
attention layer for every context token; a conv's W - 1 halo, the < C tokens a linear layer
replays and one state per path start, per entry (``harts_hf.engine.memory``). A context token then
costs a small fraction of an own token, whose activations span every layer (0.04 to 0.05 on the
built-in models; more under checkpointing, where own tokens get cheap). Counting context at an
own token's price (a token budget alone) refuses every trajectory longer than the budget.

:class:`MemoryModel` prices both (bytes, derived from a model by
``harts_hf.engine.memory_model``, fitted on the machine by ``harts-hf calibrate --memory``);
:class:`Budget` is what the planner reads: own-token equivalents and the context weight.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["TOKEN_MEMORY", "Budget", "MemoryModel"]


@dataclass(frozen=True)
class Budget:
    """A microbatch holds ``own + context_weight * context <= tokens`` (own-token equivalents); the
    graphs a rank's budget cannot keep may take ``host_bytes`` of host memory
    (``graphs.host_slots``; 0: none, they rerun)."""

    tokens: int
    context_weight: float = 1.0
    host_bytes: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, (int, np.integer)) or self.tokens <= 0:
            raise ValueError(f"a budget holds a positive whole number of tokens, got {self.tokens!r}")
        if not (isinstance(self.context_weight, (int, float, np.number)) and 0 <= self.context_weight < math.inf):
            raise ValueError(f"a context token costs a finite number >= 0 of own tokens, got {self.context_weight!r}")
        if not (isinstance(self.host_bytes, (int, float, np.number)) and 0 <= self.host_bytes < math.inf):
            raise ValueError(f"host memory for graphs is a finite number of bytes >= 0, got {self.host_bytes!r}")

    def footprint(self, own, context) -> np.ndarray:
        """Own-token equivalents of microbatches with ``own`` tokens and ``context`` ancestors."""
        return np.asarray(own, dtype=np.float64) + self.context_weight * np.asarray(context, dtype=np.float64)

    def room(self, context) -> np.ndarray:
        """Own tokens a microbatch whose context is ``context`` tokens can still take (may be <= 0)."""
        return np.floor(self.tokens - self.context_weight * np.asarray(context, dtype=np.float64)).astype(np.int64)

    @property
    def longest_trajectory(self) -> int | None:
        """The most tokens a trajectory may have: its last token, with every ancestor as context,
        still fits (None: any length)."""
        if self.context_weight == 0:
            return None
        longest = int((self.tokens - 1) / self.context_weight) + 1
        return longest if self.room(longest - 1) >= 1 else longest - 1  # floor's rounding


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes of one microbatch of ``n`` own tokens reading ``c`` context tokens:
    ``token * n + context * c + max(head * min(n, head_chunk), fixed + layer * n)``.

    Everything the forward saves stays until the backward has passed it: ``token``, the
    activations one own token keeps for the backward pass (every layer), and ``context``, what one
    ancestor token read from an earlier slot costs (its boundary values in every layer that reads
    them, kept, gathered and given a gradient). On top come two phases that never overlap: the LM
    head's checkpointed chunk first (``head`` bytes per row, at most ``head_chunk`` rows; 0: no such
    term), then the layers' backward, one layer at a time (``layer`` per own token: the hidden
    state's gradients, and the layer's recomputed activations under gradient checkpointing;
    ``fixed``: what does not grow with tokens, attention's score buffers at their full size: a bound
    that microbatches of a few hundred tokens stay well below, so their peak is overestimated).
    """

    token: float
    context: float
    head: float = 0.0
    head_chunk: int = 0
    fixed: float = 0.0
    layer: float = 0.0

    def __post_init__(self) -> None:
        values = asdict(self)
        if any(isinstance(v, bool) or not isinstance(v, (int, float, np.number)) for v in values.values()):
            raise ValueError(f"memory model coefficients must be numbers, got {values}")
        if not all(math.isfinite(v) and v >= 0 for v in values.values()) or self.token <= 0:
            raise ValueError(f"memory model coefficients must be finite, >= 0, with a positive token cost: {values}")

    def __call__(self, tokens, context=0) -> np.ndarray:
        """Predicted peak bytes (broadcasts over arrays)."""
        return self.saved(tokens, context) + self._phases(np.asarray(tokens, dtype=np.float64))

    def saved(self, tokens, context=0) -> np.ndarray:
        """Bytes a microbatch's graph keeps until its backward, ``token * n + context * c`` (broadcasts
        over arrays): what the graphs alive together add up, and what a graph in host memory moves."""
        return self.token * np.asarray(tokens, dtype=np.float64) + self.context * np.asarray(context)

    def _phases(self, n) -> np.ndarray:
        return np.maximum(self.head * np.minimum(n, self.head_chunk), self.fixed + self.layer * n)

    def budget(
        self, *, max_tokens: int | None = None, max_bytes: float | None = None, host_bytes: float = 0.0
    ) -> Budget:
        """The planner's budget: ``max_tokens`` own tokens (the memory of that many tokens without
        context), or as many as ``max_bytes`` holds; exactly one of the two; and ``host_bytes`` of
        host memory for the graphs it cannot keep.

        A context token is priced against the cheapest own token below the budget (the peak's
        slope in own tokens changes where the head's chunk fills and where one phase overtakes the
        other): a microbatch with fewer own tokens and more context then stays within the bytes
        of a full one."""
        if (max_tokens is None) == (max_bytes is None):
            raise ValueError("give a microbatch budget in tokens or in bytes, not both or neither")
        tokens = Budget(self._tokens_within(max_bytes) if max_tokens is None else max_tokens).tokens
        return Budget(tokens, self.context / (self.token + self._cheapest_slope(tokens)), host_bytes)

    def _tokens_within(self, max_bytes: float) -> int:
        """The most own tokens (no context) whose peak is at most ``max_bytes`` (the peak grows with n)."""
        lo, hi = 0, int(max_bytes / self.token) + 2  # peak(hi) > max_bytes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self(mid) <= max_bytes else (lo, mid)
        if lo < 1:
            raise ValueError(
                f"max_bytes_per_microbatch={max_bytes:,.0f} holds no token: this model's microbatch needs "
                f"{float(self(1)):,.0f} B for one token; raise the budget"
            )
        return lo

    def _cheapest_slope(self, tokens: int) -> float:
        """The smallest slope of the phases' peak in own tokens on [0, tokens] (it is piecewise linear:
        its kinks are where the head's chunk fills and where the phases cross)."""
        kinks = [self.head_chunk]
        if self.head > self.layer:
            kinks.append(self.fixed / (self.head - self.layer))
        if self.layer > 0:
            kinks.append((self.head * self.head_chunk - self.fixed) / self.layer)
        points = np.unique(np.clip([0.0, float(tokens), *kinks], 0.0, float(tokens)))
        return float(np.min(np.diff(self._phases(points)) / np.diff(points)))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


TOKEN_MEMORY = MemoryModel(token=1.0, context=1.0)
"""The model-free default: a context token costs as much as an own token (safe for any model,
and what a budget in tokens meant before context was priced)."""
