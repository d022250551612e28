"""Tree ops under autocast (TRL's default: fp32 weights, bf16 / fp16 compute) follow the dtype rules
of the stock layers they replace, then run with autocast off, in their own dtype rules.

- Attention and the short conv take their matmul / conv operands in the autocast dtype, as
  ``scaled_dot_product_attention`` and ``F.conv1d`` do under autocast (their softmax and
  accumulation stay fp32 inside the op).
- The linear-attention / SSM kinds take their inputs as the layer hands them (decays and gates
  often fp32, projections in the autocast dtype) and keep their states in fp32, as fla's kernels do.

Inside an op autocast is off, forward and backward: a custom autograd Function's backward would
otherwise run under whatever autocast the caller of ``backward()`` holds, and its fp32 state
arithmetic would be recast. Work that replays a forward later (the engine's record and replay)
captures the autocast it ran under with :class:`AutocastState` and restores it for the replay, as
``torch.utils.checkpoint`` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["AutocastState", "autocast_dtype", "cast_to", "no_autocast", "without_autocast"]


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts matmul-like ops to on ``device`` now, None where it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def cast_to(value, dtype: torch.dtype):
    """``value`` (a floating tensor, a tuple of them, or anything else, left alone) in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_to(v, dtype) for v in value)
    return value


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device``'s type for the block."""
    return torch.autocast(device.type, enabled=False)


def without_autocast(backward: Callable) -> Callable:
    """Decorator for an autograd Function's ``backward(ctx, *grads)``: run it with autocast off."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        device = next((g.device for g in grads if isinstance(g, torch.Tensor)), torch.device("cpu"))
        with no_autocast(device):
            return backward(ctx, *grads)

    return run


@dataclass(frozen=True)
class AutocastState:
    """The autocast of one device type at one moment, to run later work (a replay) under it again."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def current(cls, device: torch.device) -> AutocastState:
        on = device.type
        return cls(on, torch.is_autocast_enabled(on), torch.get_autocast_dtype(on), torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache_enabled):
            yield
