"""The memory model of a patched model, by accounting what the engine's units really hold.

Deterministic (the same on every rank, so every rank makes the same plan) and cheap: forward
passes over short synthetic chains.

- per own token (``token``): the bytes autograd saves for the backward pass
  (``saved_tensors_hooks``, each storage once, parameters excluded), the slope between two chain
  lengths; by decoder layer too (:func:`layer_bytes`), with checkpointing off;
- the backward, one layer at a time (``layer``): the hidden state's gradient and its running
  sum; under gradient checkpointing also the largest layer's recomputed activations;
- per context token: attention's K/V that an earlier unit keeps for it, times the copies a
  reading unit makes of them with grad (``CONTEXT_COPIES``: gathered, given a gradient, joined
  with its own rows in the ops, ...); conv halos, linear-attention replay rows and states are per
  path start (a few rows each, not per context token: :func:`memory_breakdown` shows them);
- the LM head: one checkpointed chunk of rows (logits, log-softmax and their gradient, fp32);
- fixed: attention's score buffers of one block group (``ops.attention.GROUP_ELEMENTS``: a piece
  under any context holds no more).

``harts-hf calibrate --memory`` measures peaks instead, on the machine.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..forest import RolloutForest
from ..modeling import _compat
from ..modeling.adapters import FamilyAdapter
from ..modeling.logprobs import model_head, stochastic_parts
from ..modeling.registry import patched_adapter
from ..ops.attention import GROUP_ELEMENTS
from ..planner.memory import TOKEN_MEMORY, MemoryModel
from ..planner.plan import plan
from .engine import Forward, TreeEngine

__all__ = ["LayerMemory", "decoder_layers", "layer_bytes", "memory_breakdown", "memory_model"]

PROBE_TOKENS = (128, 256)  # two chain lengths on the chunk grid
CONTEXT_COPIES = 7  # kept, gathered, its gradient, joined with own rows in the op (saved) and its gradient, the
# linear-attention tables (and gradients) built over the joined rows; 7.7 to 15 measured (`harts-hf calibrate --memory`)
SCORE_TEMPORARIES = 4  # attention's live score-sized buffers per group (logits, probabilities, their gradients)
FREE_CONTEXT = MemoryModel(token=1.0, context=0.0)  # cuts a probe chain in two wherever asked
_CACHE: dict[tuple, MemoryModel] = {}


def memory_model(
    model: nn.Module, *, head_chunk_tokens: int | None = None, forward: Forward | None = None
) -> MemoryModel:
    """The :class:`~harts_hf.planner.MemoryModel` of a patched ``model`` in its current dtype,
    device, autocast and gradient-checkpointing setting (cached per configuration). ``forward``
    runs the probe's model calls as the wrapper's forward, as :class:`TreeEngine` takes it (FSDP2
    gathers the parameters there; run it where the wrapper skips gradient sync). A model whose
    forward draws random numbers (dropout in training mode) cannot be cut into microbatches at all:
    it gets :data:`~harts_hf.planner.TOKEN_MEMORY`, under which it can still run in one."""
    hf, adapter = patched_adapter(model)
    if stochastic_parts(hf):
        return TOKEN_MEMORY
    head = hf.get_output_embeddings().weight
    device = head.device.type
    key = (
        type(hf),
        hf.config.to_json_string(use_diff=False),
        head.dtype,
        device,
        torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device),
        checkpointing(hf),
        head_chunk_tokens,
    )
    if key not in _CACHE:
        with torch.random.fork_rng(devices=[head.device] if device == "cuda" else []):
            _CACHE[key] = _probe(hf, adapter, head_chunk_tokens, forward)
    return _CACHE[key]


def checkpointing(hf: nn.Module) -> bool:
    """Whether gradient checkpointing is on (transformers 5 renamed the flag)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in hf.modules())


def chain(hf: nn.Module, n: int) -> RolloutForest:
    """One trajectory of ``n`` token ids within the model's vocabulary (the probes' workload)."""
    vocab = hf.get_output_embeddings().weight.shape[0]
    return RolloutForest.from_sequences([[(7 * i + 3) % vocab for i in range(n)]])


def decoder_layers(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """(kind, module) of every decoder layer in order; the kind is ``config.layer_types``' entry."""
    layers = _compat.decoder_layer_modules(hf)
    kinds = getattr(hf.config, "layer_types", None)
    kinds = list(kinds) if kinds is not None and len(kinds) == len(layers) else ["layer"] * len(layers)
    return list(zip(kinds, layers))


def _saved_bytes(
    hf: nn.Module, n: int, head_chunk_tokens: int | None, forward: Forward | None
) -> tuple[int, list[int]]:
    """Bytes autograd saves over one unit of an ``n``-token chain (each storage once): in all, and
    by decoder layer (what a checkpointed layer saves is hidden inside its checkpoint)."""
    layers = [module for _, module in decoder_layers(hf)]
    seen: dict[int, tuple[int, int | None]] = {}
    inside: list[int | None] = [None]
    params: set[int] = set()

    model = weakref.ref(hf)  # autograd keeps ``pack`` with every tensor it saved: no path back to the model

    def gathered() -> None:  # the parameters whole now: FSDP2 swaps them in for a module's forward only
        params.clear()  # and frees them after it: an activation may take a freed one's address
        params.update(p.untyped_storage().data_ptr() for p in model().parameters() if not isinstance(p, DTensor))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not params:
            gathered()
        if t.layout == torch.strided and (ptr := t.untyped_storage().data_ptr()) not in params:
            seen.setdefault(ptr, (t.untyped_storage().nbytes(), inside[0]))
        return t

    def enter(i: int) -> Callable:
        def hook(*_) -> None:
            inside[0] = i
            gathered()

        return hook

    hooks = [m.register_forward_pre_hook(enter(i)) for i, m in enumerate(layers)]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__(0, None)) for m in layers]
    forest = chain(hf, n)
    whole = plan(forest, world_size=1, max_tokens_per_microbatch=n)
    engine = TreeEngine(hf, forest, whole, head_chunk_tokens=head_chunk_tokens, forward=forward)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            recording = engine.record(keep_graph=True)
        del recording
    finally:
        for hook in hooks:
            hook.remove()
    by_layer = [0] * len(layers)
    for nbytes, layer in seen.values():
        if layer is not None:
            by_layer[layer] += nbytes
    return sum(nbytes for nbytes, _ in seen.values()), by_layer


@contextlib.contextmanager
def _without_checkpointing(hf: nn.Module) -> Iterator[None]:
    """Every layer's checkpointing flag off for the duration (what a checkpointed layer recomputes)."""
    flagged = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", False)]
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


def layer_bytes(
    model: nn.Module, *, head_chunk_tokens: int | None = None, forward: Forward | None = None
) -> list[tuple[str, float]]:
    """(kind, activation bytes per own token) of every decoder layer of a patched ``model``, with
    gradient checkpointing off: what the layer keeps for its backward pass, or recomputes in it
    when checkpointed."""
    hf, _ = patched_adapter(model)
    n1, n2 = PROBE_TOKENS
    with _without_checkpointing(hf):
        (_, low), (_, high) = (_saved_bytes(hf, n, head_chunk_tokens, forward) for n in (n1, n2))
    return [(kind, (b - a) / (n2 - n1)) for (kind, _), a, b in zip(decoder_layers(hf), low, high)]


def _boundary_by_layer(
    hf: nn.Module, n: int, head_chunk_tokens: int | None, forward: Forward | None
) -> tuple[int, list[tuple[int, int]]]:
    """Rows a later unit reads and, by decoder layer, (attention's K/V bytes at those rows, the
    other boundary bytes: conv halos, linear-attention replay rows and states) that an earlier unit
    keeps, over an ``n``-token chain in two units (the second starts one path)."""
    forest = chain(hf, n)
    halves = plan(forest, world_size=1, max_tokens_per_microbatch=n // 2, memory_model=FREE_CONTEXT)
    engine = TreeEngine(hf, forest, halves, head_chunk_tokens=head_chunk_tokens, forward=forward)
    with torch.no_grad():
        recording = engine.record()
    layers = decoder_layers(hf)
    owner = {id(m): i for i, (_, layer) in enumerate(layers) for m in layer.modules()}
    by_layer = [[0, 0] for _ in layers]
    for (module, kind, _), nbytes in recording.boundary_bytes_by_call().items():
        by_layer[owner[id(module)]][kind != "attention"] += nbytes
    return sum(unit.exports.size for unit in engine.units), [(kv, other) for kv, other in by_layer]


@dataclass(frozen=True)
class LayerMemory:
    """What one kind of decoder layer costs (:func:`memory_breakdown`), bytes."""

    kind: str
    layers: int
    activations: float  # per own token, every layer of the kind: kept for backward, checkpointing off
    checkpointed: float  # per own token, the same with checkpointing: the layers' inputs
    kv: float  # per context row: attention's K/V
    path: float  # per path a piece starts from an earlier slot's: conv halos, replay rows, states


def memory_breakdown(
    model: nn.Module, *, head_chunk_tokens: int | None = None, forward: Forward | None = None
) -> list[LayerMemory]:
    """:func:`memory_model`'s figures by decoder layer kind (``config.layer_types``), in the model's
    order of first appearance."""
    hf, _ = patched_adapter(model)
    hidden = hf.get_output_embeddings().weight
    rows, boundary = _boundary_by_layer(hf, PROBE_TOKENS[1], head_chunk_tokens, forward)
    kinds: dict[str, list[float]] = {}
    for (kind, act), (kv, other) in zip(
        layer_bytes(hf, head_chunk_tokens=head_chunk_tokens, forward=forward), boundary
    ):
        entry = kinds.setdefault(kind, [0, 0.0, 0.0, 0.0])
        for i, value in enumerate((1, act, kv / max(rows, 1), other)):
            entry[i] += value
    width = hidden.shape[1] * hidden.element_size()
    return [LayerMemory(k, n, act, n * width, kv, other) for k, (n, act, kv, other) in kinds.items()]


def _probe(
    hf: nn.Module, adapter: FamilyAdapter, head_chunk_tokens: int | None, forward: Forward | None
) -> MemoryModel:
    n1, n2 = PROBE_TOKENS
    head = hf.get_output_embeddings().weight
    (low, _), (high, _) = (_saved_bytes(hf, n, head_chunk_tokens, forward) for n in (n1, n2))
    token = max((high - low) / (n2 - n1), 1.0)
    layer = 2 * head.shape[1] * head.element_size()  # the hidden state's gradient and its sum
    if checkpointing(hf):
        layer += max((b for _, b in layer_bytes(hf, head_chunk_tokens=head_chunk_tokens, forward=forward)), default=0)
    rows, boundary = _boundary_by_layer(hf, n2, head_chunk_tokens, forward)
    context = CONTEXT_COPIES * sum(kv for kv, _ in boundary) / max(rows, 1)
    chunk = model_head(hf, adapter, head_chunk_tokens).chunk
    logits = 3 * head.shape[0] * 4  # fp32 logits, their log-softmax and gradient, per row
    fixed = SCORE_TEMPORARIES * GROUP_ELEMENTS * 4
    return MemoryModel(
        token=float(token),
        context=float(context),
        head=float(logits),
        head_chunk=chunk,
        fixed=fixed,
        layer=float(layer),
    )
