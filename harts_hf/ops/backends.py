"""One registry of tree-op backends (in the manner of fla's ``backends.py``).

Each layer kind ("attention", "conv", "gated_delta", "kda", "gla", "simple_gla") has one or more
implementations, each registered under a backend name with a test of whether the backend is
installed, whether it accepts a given call, and the tree tables it reads. A call is described by a
:class:`Call` (the kind, the device of its tensors, its chunk grid, head dims and conv width):
the public op describes each call from its tensors, a model's layers describe theirs from their
modules (``harts_hf.modeling.tables``), and both go through ONE choice, :func:`choose`, so the
tables a model's layers declare are those of the implementations that will run.
``torch`` is registered for every kind and is the guaranteed fallback. The choice is read in ONE
place, the ``HARTS_BACKEND`` environment switch:

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

import torch

from .precision import autocast_dtype, cast_to, no_autocast
from .tree_batch import Table

__all__ = [
    "Call",
    "call_of",
    "choose",
    "dispatch",
    "implementation",
    "register",
    "registered",
    "requested",
    "tables_of",
]

logger = logging.getLogger(__name__)
ENV = "HARTS_BACKEND"


@dataclass(frozen=True)
class Call:
    """What one tree-op call's backend and tables depend on.

    Args:
        kind: the op kind ("attention", "conv", "gated_delta", ...).
        device: where its tensors are.
        chunk_size: a linear kind's chunk grid C.
        key_dim, value_dim: a linear kind's head dims K and V.
        width: a conv's width W.
    """

    kind: str
    device: torch.device
    chunk_size: int | None = None
    key_dim: int | None = None
    value_dim: int | None = None
    width: int | None = None


@dataclass(frozen=True)
class _Entry:
    fn: Callable
    available: Callable[[], bool]
    accepts: Callable[[Call], bool]
    tables: Callable[[Call], tuple[Table, ...]]


_REGISTRY: dict[str, dict[str, _Entry]] = {}
_DESCRIBE: dict[str, tuple[inspect.Signature, Callable[..., Call]]] = {}
_LOGGED: set[tuple[str, str]] = set()


def register(
    kind: str,
    backend: str,
    *,
    tables: Callable[[Call], tuple[Table, ...]],
    available: Callable[[], bool] = lambda: True,
    accepts: Callable[[Call], bool] = lambda call: True,
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s implementation of layer ``kind``; ``tables``
    names the tree tables a call of it reads (building one builds the others its builder reads)."""

    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault(kind, {})[backend] = _Entry(fn, available, accepts, tables)
        return fn

    return wrap


def registered(kind: str) -> list[str]:
    """Backend names registered for ``kind``, in registration order."""
    return list(_REGISTRY.get(kind, {}))


def requested() -> str:
    """The backend ``HARTS_BACKEND`` asks for (normalised; "auto" when unset)."""
    return os.environ.get(ENV, "auto").strip().lower() or "auto"


def choose(call: Call) -> _Entry:
    """The registered implementation that serves ``call``: the one choice behind both a call of
    the op (:func:`dispatch`) and the tables a layer declares (:func:`tables_of`)."""
    kind = call.kind
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
        if entry is not None and entry.available() and entry.accepts(call):
            if (kind, name) not in _LOGGED:
                _LOGGED.add((kind, name))
                logger.info("harts-hf: %s runs on the %s backend", kind, name)
            return entry
    raise RuntimeError(
        f"{ENV}={wanted!r}: backend {candidates[0]!r} for {kind!r} is not available or does not "
        f"accept this call (set {ENV}=torch to use the pure-PyTorch backend)"
    )


def tables_of(call: Call) -> tuple[Table, ...]:
    """The tree tables ``call`` reads: those of the implementation :func:`choose` picks for it."""
    return choose(call).tables(call)


def call_of(kind: str, *args, **kwargs) -> Call:
    """The :class:`Call` of the public ``kind`` op on these arguments (the ones it reads suffice)."""
    signature, describe = _DESCRIBE[kind]
    bound = signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return describe(kind, **bound.arguments)


def implementation(kind: str, *args, **kwargs) -> Callable:
    """The implementation of ``kind`` that serves this call (arguments: :func:`call_of`)."""
    return choose(call_of(kind, *args, **kwargs)).fn


def dispatch(
    kind: str,
    describe: Callable[..., Call],
    check: Callable[..., None] | None = None,
    autocast_casts: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Decorator for a public op: it keeps the op's signature and docstring (its body is only the
    docstring) and runs each call on the implementation :func:`choose` picks for the :class:`Call`
    ``describe(kind, **arguments)`` makes of the call's arguments (by name, defaults filled in). ``check`` gets the same
    arguments and refuses bad inputs once, before any backend sees them. Under autocast
    (``harts_hf.ops.precision``) the arguments named in ``autocast_casts`` are cast to the autocast
    dtype, the others left as given, and the op runs with autocast off."""

    def wrap(public: Callable) -> Callable:
        signature = inspect.signature(public)
        _DESCRIBE[kind] = (signature, describe)

        @functools.wraps(public)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if check is not None:
                check(**bound.arguments)
            fn = choose(describe(kind, **bound.arguments)).fn
            device = next(iter(bound.arguments.values())).device  # the op's first tensor
            dtype = autocast_dtype(device)
            if dtype is None:
                return fn(*args, **kwargs)
            for name in autocast_casts:
                bound.arguments[name] = cast_to(bound.arguments[name], dtype)
            with no_autocast(device):
                return fn(*bound.args, **bound.kwargs)

        return call

    return wrap
