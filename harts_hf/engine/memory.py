"""The memory model of a patched model, by accounting what the engine's units really hold.

Deterministic (the same on every rank, so every rank makes the same plan) and cheap: forward
passes over short synthetic chains.

- per own token: the bytes autograd saves for the backward pass (``saved_tensors_hooks``, each
  storage once, parameters excluded), the slope between two chain lengths; plus the backward's
  transients: the gradients of one layer's saved values at a time and of the hidden state;
- per context token: the boundary values an earlier unit keeps for it (attention's K/V at every
  context row; conv halos and linear-attention replay rows are per path start, a few rows
  each, and fall out of the slope), times the copies a reading unit makes of
  them with grad (``CONTEXT_COPIES``: gathered, given a gradient, joined with its own rows in
  the ops, ...);
- the LM head: one checkpointed chunk of rows (logits, log-softmax and their gradient, fp32);
- fixed: attention's score buffers of one block group (``ops.attention.GROUP_ELEMENTS``).

``harts-hf calibrate`` measures peaks instead, on the machine, for the figures that matter there.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forest import RolloutForest
from ..modeling.adapters import FamilyAdapter
from ..modeling.logprobs import model_head, stochastic_parts
from ..modeling.registry import patched_adapter
from ..ops.attention import GROUP_ELEMENTS
from ..planner.memory import TOKEN_MEMORY, MemoryModel
from ..planner.plan import plan
from .engine import Forward, TreeEngine

__all__ = ["memory_model"]

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


def _saved_bytes(hf: nn.Module, n: int, head_chunk_tokens: int | None, forward: Forward | None) -> int:
    """Bytes autograd saves over one unit of an ``n``-token chain (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and (ptr := t.untyped_storage().data_ptr()) not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    forest = chain(hf, n)
    whole = plan(forest, world_size=1, max_tokens_per_microbatch=n)
    engine = TreeEngine(hf, forest, whole, head_chunk_tokens=head_chunk_tokens, forward=forward)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
        recording = engine.record(keep_graph=True)
    del recording
    return sum(seen.values())


def _boundary_bytes_per_row(hf: nn.Module, n: int, head_chunk_tokens: int | None, forward: Forward | None) -> float:
    """Bytes an earlier unit keeps per row a later unit reads (an ``n``-token chain in two units)."""
    forest = chain(hf, n)
    halves = plan(forest, world_size=1, max_tokens_per_microbatch=n // 2, memory_model=FREE_CONTEXT)
    engine = TreeEngine(hf, forest, halves, head_chunk_tokens=head_chunk_tokens, forward=forward)
    with torch.no_grad():
        recording = engine.record()
    rows = sum(unit.exports.size for unit in engine.units)
    return recording.boundary_bytes / max(rows, 1)


def _probe(
    hf: nn.Module, adapter: FamilyAdapter, head_chunk_tokens: int | None, forward: Forward | None
) -> MemoryModel:
    n1, n2 = PROBE_TOKENS
    head = hf.get_output_embeddings().weight
    saved = [_saved_bytes(hf, n, head_chunk_tokens, forward) for n in (n1, n2)]
    slope = (saved[1] - saved[0]) / (n2 - n1)
    layers = max(int(getattr(hf.config, "num_hidden_layers", 1) or 1), 1)
    token = max(slope, 1.0) * (1 + 1 / layers) + 2 * head.shape[1] * head.element_size()
    context = CONTEXT_COPIES * _boundary_bytes_per_row(hf, n2, head_chunk_tokens, forward)
    chunk = model_head(hf, adapter, head_chunk_tokens).chunk
    logits = 3 * head.shape[0] * 4  # fp32 logits, their log-softmax and gradient, per row
    fixed = SCORE_TEMPORARIES * GROUP_ELEMENTS * 4
    return MemoryModel(token=float(token), context=float(context), head=float(logits), head_chunk=chunk, fixed=fixed)
