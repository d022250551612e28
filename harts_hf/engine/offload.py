"""Graphs kept in host memory: a model call's saved tensors go to host memory as its forward saves
them and come back before its backward reads them.

Why: a rank whose slots hold more than the byte budget keeps only its last slots' graphs and
reruns the forward of every earlier one in the backward (``harts_hf.planner.graphs``): at SWE-like
scale 4 on 64 ranks that is a fifth of the step. A host has several times a GPU's memory, and a
copy stream moves a slot's saved tensors there during its forward and back during its backward,
beside the compute; where the copies hide behind the passes, the graph costs nothing to keep. The
plan says which calls (``Plan.host_graphs``, rule ``host``); the engine records them with grad
inside :meth:`HostGraphs.saving` and replays them from their graphs.

On a GPU a saved tensor is copied to pinned host memory on the copy stream once the compute stream
has made it (its device memory stays held until the copy is done: ``record_stream``), and the next
call waits for the copies on the device: one call's graph at a time is on the device, as the budget
holds it, and what the copies do not hide behind the forward delays the next call (what the plan
prices: ``planner.graphs.host_seconds``). Before the call's backward every tensor is copied back
on the copy stream, the last saved first (the backward reads them in about that order), and each
unpack makes the compute stream wait for its own copy: no host sync. On a CPU the host is the
device: the tensors are copied all the same, so the CPU tests run the GPU's path but its streams.

Parameters (alive anyway), tensors elsewhere than the device and tensors under :data:`MIN_BYTES`
(a copy costs more than they hold) stay where they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["MIN_BYTES", "HostCall", "HostGraphs"]

MIN_BYTES = 1024
"""The smallest saved tensor moved to host memory (bytes)."""


class HostGraphs:
    """One rank's copies of graphs to and from host memory on ``device``; ``moved`` counts the bytes
    sent to host memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.moved = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[HostCall]:
        """Inside: every tensor a forward saves for its backward goes to host memory; the
        :class:`HostCall` yielded holds them for that call's backward."""
        call = HostCall(self)
        with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
            yield call
        if self.stream is not None:  # the next call starts once these copies are done: one graph on the device
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _Saved:
    """One saved tensor in host memory, and its copy back on the device once fetched."""

    __slots__ = ("back", "host", "ready")

    def __init__(self, host: torch.Tensor):
        self.host, self.back, self.ready = host, None, None


class HostCall:
    """The saved tensors of one model call's graph in host memory (:meth:`HostGraphs.saving`)."""

    def __init__(self, graphs: HostGraphs):
        self.graphs = graphs
        self.saved: list[_Saved] = []

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        if (
            isinstance(tensor, nn.Parameter)
            or tensor.layout != torch.strided
            or tensor.device != self.graphs.device
            or tensor.numel() * tensor.element_size() < MIN_BYTES
        ):
            return tensor
        stream = self.graphs.stream
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=stream is not None)
        if stream is None:
            host.copy_(tensor)
        else:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
        self.graphs.moved += host.numel() * host.element_size()
        saved = _Saved(host)
        self.saved.append(saved)
        return saved

    def fetch(self) -> None:
        """Before the call's backward: copy every saved tensor back to the device, the last saved
        first (on a GPU on the copy stream, once the compute stream got here)."""
        stream, device = self.graphs.stream, self.graphs.device
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        for saved in reversed(self.saved):
            if stream is None:
                saved.back = saved.host.to(device, copy=True)
                continue
            with torch.cuda.stream(stream):
                saved.back = saved.host.to(device, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
        self.saved = []  # the graph holds them now: its backward frees them

    def unpack(self, packed: torch.Tensor | _Saved) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        if packed.back is None:  # a backward before the replay fetched it: copied now
            return packed.host.to(self.graphs.device, copy=True)
        if packed.ready is not None:
            compute = torch.cuda.current_stream(self.graphs.device)
            compute.wait_event(packed.ready)
            packed.back.record_stream(compute)
        return packed.back
