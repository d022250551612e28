"""One registry of tree-op backends (in the manner of fla's ``backends.py``).

Each layer kind ("attention", "conv", "gated_delta", "kda", "gla", "simple_gla") has one or more
implementations, each registered under a backend name with a test of whether the backend is
installed and whether it accepts a given call. ``torch`` is registered for every kind and is the
guaranteed fallback. The choice is read in ONE place, the ``HARTS_BACKEND`` environment switch:

| HARTS_BACKEND | meaning |
|---------------|---------|
| ``auto`` (default) | the first registered non-torch backend that is available and accepts the call, else ``torch`` |
| ``torch`` | always the pure-PyTorch backend (runs everywhere, CPU included) |
| ``<name>`` | that backend; an error if it is unavailable or refuses the call |

The chosen backend is logged once per (kind, backend).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from .precision import autocast_dtype, cast_to, no_autocast

__all__ = ["dispatch", "implementation", "register", "registered", "requested"]

logger = logging.getLogger(__name__)
ENV = "HARTS_BACKEND"


@dataclass(frozen=True)
class _Entry:
    fn: Callable
    available: Callable[[], bool]
    accepts: Callable[..., bool]


_REGISTRY: dict[str, dict[str, _Entry]] = {}
_LOGGED: set[tuple[str, str]] = set()


def register(
    kind: str,
    backend: str,
    *,
    available: Callable[[], bool] = lambda: True,
    accepts: Callable[..., bool] = lambda *args, **kwargs: True,
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s implementation of layer ``kind``."""

    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault(kind, {})[backend] = _Entry(fn, available, accepts)
        return fn

    return wrap


def registered(kind: str) -> list[str]:
    """Backend names registered for ``kind``, in registration order."""
    return list(_REGISTRY.get(kind, {}))


def requested() -> str:
    """The backend ``HARTS_BACKEND`` asks for (normalised; "auto" when unset)."""
    return os.environ.get(ENV, "auto").strip().lower() or "auto"


def implementation(kind: str, *args, **kwargs) -> Callable:
    """The implementation of ``kind`` that serves this call (``args``/``kwargs`` are the call's)."""
    if kind not in _REGISTRY:
        raise KeyError(f"unknown tree-op kind {kind!r}; registered kinds: {sorted(_REGISTRY)}")
    entries = _REGISTRY[kind]
    wanted = requested()
    if wanted == "auto":
        candidates = [name for name in entries if name != "torch"] + ["torch"]
    elif wanted in entries:
        candidates = [wanted]
    else:
        raise ValueError(f"{ENV}={wanted!r} is not a backend of {kind!r}; choose from {sorted(entries) + ['auto']}")
    for name in candidates:
        entry = entries.get(name)
        if entry is not None and entry.available() and entry.accepts(*args, **kwargs):
            if (kind, name) not in _LOGGED:
                _LOGGED.add((kind, name))
                logger.info("harts-hf: %s runs on the %s backend", kind, name)
            return entry.fn
    raise RuntimeError(
        f"{ENV}={wanted!r}: backend {candidates[0]!r} for {kind!r} is not available or does not "
        f"accept this call (set {ENV}=torch to use the pure-PyTorch backend)"
    )


def dispatch(
    kind: str, check: Callable[..., None] | None = None, autocast_casts: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Decorator for a public op: it keeps the op's signature and docstring (its body is only the
    docstring) and runs each call on the implementation :func:`implementation` picks for it.
    ``check`` gets the call's arguments by name (defaults filled in) and refuses bad inputs once,
    before any backend sees them. Under autocast (``harts_hf.ops.precision``) the arguments named in
    ``autocast_casts`` are cast to the autocast dtype, the others left as given, and the op runs
    with autocast off."""

    def wrap(public: Callable) -> Callable:
        signature = inspect.signature(public)

        @functools.wraps(public)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if check is not None:
                check(**bound.arguments)
            device = next(iter(bound.arguments.values())).device  # the op's first tensor
            dtype = autocast_dtype(device)
            if dtype is None:
                return implementation(kind, *args, **kwargs)(*args, **kwargs)
            for name in autocast_casts:
                bound.arguments[name] = cast_to(bound.arguments[name], dtype)
            with no_autocast(device):
                return implementation(kind, *bound.args, **bound.kwargs)(*bound.args, **bound.kwargs)

        return call

    return wrap
