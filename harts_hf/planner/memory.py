"""What a microbatch holds in memory, and the budget the planner fits every microbatch into.

A microbatch computes its own tokens with grad and reads the ancestors it does not hold (its
*context*, computed in earlier slots) only as the boundary values its layers take: K/V in each
attention layer for every context token; a conv's W - 1 halo, the < C tokens a linear layer
replays and one state per path start, per entry (``harts_hf.engine.memory``). A context token then
costs a small fraction of an own token, whose activations span every layer (0.04 to 0.05 on the
built-in models; more under checkpointing, where own tokens get cheap). Counting context at an
own token's price (a token budget alone) refuses every trajectory longer than the budget.

:class:`MemoryModel` prices both (bytes, derived from a model by
``harts_hf.modeling.memory.memory_model``, fitted on the machine by ``harts-hf calibrate``);
:class:`Budget` is what the planner reads: own-token equivalents and the context weight.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["TOKEN_MEMORY", "Budget", "MemoryModel"]


@dataclass(frozen=True)
class Budget:
    """A microbatch holds ``own + context_weight * context <= tokens`` (own-token equivalents)."""

    tokens: int
    context_weight: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, (int, np.integer)) or self.tokens <= 0:
            raise ValueError(f"a budget holds a positive whole number of tokens, got {self.tokens!r}")
        if not (isinstance(self.context_weight, (int, float, np.number)) and 0 <= self.context_weight < math.inf):
            raise ValueError(f"a context token costs a finite number >= 0 of own tokens, got {self.context_weight!r}")

    def footprint(self, own, context) -> np.ndarray:
        """Own-token equivalents of microbatches with ``own`` tokens and ``context`` ancestors."""
        return np.asarray(own, dtype=np.float64) + self.context_weight * np.asarray(context, dtype=np.float64)

    def room(self, context) -> np.ndarray:
        """Own tokens a microbatch whose context is ``context`` tokens can still take (may be <= 0)."""
        return np.floor(self.tokens - self.context_weight * np.asarray(context, dtype=np.float64)).astype(np.int64)


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes of one microbatch of ``n`` own tokens reading ``c`` context tokens:
    ``token * n + context * c + head * min(n, head_chunk) + fixed``.

    ``token``: activations one own token keeps for the backward pass (every layer) and its share of
    the backward's transients; ``context``: what one ancestor token read from an earlier slot
    costs (its boundary values in every layer that reads them, kept, gathered and given a
    gradient); ``head``: bytes per row of the LM head's checkpointed chunk of logits, which holds
    at most ``head_chunk`` rows (0: no such term); ``fixed``: whatever does not grow with tokens.
    """

    token: float
    context: float
    head: float = 0.0
    head_chunk: int = 0
    fixed: float = 0.0

    def __post_init__(self) -> None:
        values = asdict(self)
        if any(isinstance(v, bool) or not isinstance(v, (int, float, np.number)) for v in values.values()):
            raise ValueError(f"memory model coefficients must be numbers, got {values}")
        if not all(math.isfinite(v) and v >= 0 for v in values.values()) or self.token <= 0:
            raise ValueError(f"memory model coefficients must be finite, >= 0, with a positive token cost: {values}")

    def __call__(self, tokens, context=0) -> np.ndarray:
        """Predicted peak bytes (broadcasts over arrays)."""
        n = np.asarray(tokens, dtype=np.float64)
        return (
            self.token * n
            + self.context * np.asarray(context)
            + self.head * np.minimum(n, self.head_chunk)
            + self.fixed
        )

    def budget(self, *, max_tokens: int | None = None, max_bytes: float | None = None) -> Budget:
        """The planner's budget: ``max_tokens`` own tokens (the memory of that many tokens without
        context), or as many as ``max_bytes`` holds; exactly one of the two.

        The head's rows are capped, so an own token costs ``token + head`` up to ``head_chunk`` own
        tokens and ``token`` beyond: pricing context against the marginal own token keeps every
        microbatch within the bytes of the budget in both regimes."""
        if (max_tokens is None) == (max_bytes is None):
            raise ValueError("give a microbatch budget in tokens or in bytes, not both or neither")
        if max_bytes is not None:
            room = max_bytes - self.fixed
            full = (self.token + self.head) * self.head_chunk  # own tokens up to a full head chunk
            max_tokens = int(
                room // (self.token + self.head) if room <= full else (room - self.head * self.head_chunk) // self.token
            )
            if max_tokens < 1:
                raise ValueError(
                    f"max_bytes_per_microbatch={max_bytes:,.0f} holds no token: this model's microbatch needs "
                    f"{self.fixed:,.0f} B fixed plus {self.token + self.head:,.0f} B per token; raise the budget"
                )
        marginal = self.token + (self.head if max_tokens <= self.head_chunk else 0.0)
        return Budget(max_tokens, self.context / marginal)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


TOKEN_MEMORY = MemoryModel(token=1.0, context=1.0)
"""The model-free default: a context token costs as much as an own token (safe for any model,
and what a budget in tokens meant before context was priced)."""
