"""Cross-rank handoffs on the wire: the blocks one rank's units keep for another rank's, and the
gradients that come back.

Why: a rank would otherwise recompute the shared chain above its subtrees (the plan's replica
pieces). With a cross-rank handoff the chain runs once, on one rank, and the values its readers
need (ancestor K/V, conv halos, recurrent states, replay inputs) travel to the ranks that read
them, their gradients back in the backward. Which unit sends which rows where is compiled with
the schedule (``harts_hf.schedule.crossrank``); this module only moves tensors, point to point
(``torch.distributed.batch_isend_irecv``: gloo on CPU, NCCL on GPU), on the default group whose
ranks are the plan's.

Ordering (no deadlock): calls are slot-aligned across ranks, so a producer always runs at an
earlier call index than its readers. The recording pass exchanges after call k on every rank (the
blocks made by call k), the replay after its rerun of call k (the gradients of blocks whose first
reader on the sending rank is call k, which its producer reruns later). Every rank passes every
exchange point in the same order, between whole model calls (so collectives inside a call, such
as FSDP2's gathers or DDP's buffer broadcasts, sit at the same index on every rank), and each
point's sends and receives are posted together and waited before the rank goes on; no point
follows the last backward pass, where DDP synchronises.

Wire format, recording: per (producer unit, reading rank) one block, in two messages: int64 [2]
(header bytes, payload bytes), then uint8 [header + payload]; the header is the JSON list of
(module qualified name, call kind, call n, field, dtype, shape) of each value, the payload the
values' bytes in that order (the rows the reading rank reads, ``Unit.sends``). Call names travel
as qualified names: every rank runs the same model. The receiver reads the header on the host (one
small transfer per block, between model calls, never inside a layer). Replay: per (reading rank,
producer rank) one uint8 message, the gradients of every block the producer sent it, in its
header order, unit by unit: the producer knows their sizes, so no header.
"""

from __future__ import annotations

import json
from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Schedule, Unit
from .handoff import Key, Store

__all__ = ["Exchanger"]


def _as_bytes(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    flat = [v.contiguous().view(-1).view(torch.uint8) for v in values]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8, device=device)


def _from_bytes(buffer: torch.Tensor, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    out, at = [], 0
    for dtype, shape in specs:
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out.append(buffer[at : at + n].clone().view(dtype).view(shape))  # clone: an aligned copy
        at += n
    return out


class Exchanger:
    """Moves one rank's cross-rank handoffs (module docstring) for an engine's passes.

    Args:
        schedule: the rank's compiled schedule (its ``exchange`` and its units' ``sends``).
        model: the patched model the units run (its module names name the calls on the wire).
        device: where the blocks live (the model's device: CPU with gloo, CUDA with NCCL).
        sent: bytes this rank sent, by "values" and "grads" (added to).
    """

    def __init__(self, schedule: Schedule, model: nn.Module, device: torch.device, sent: dict[str, int]):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "this plan hands context between ranks: start torch.distributed (one process per rank of the plan)"
            )
        if dist.get_rank() != schedule.rank or dist.get_world_size() != schedule.plan.world_size:
            raise ValueError(
                f"this process is rank {dist.get_rank()} of {dist.get_world_size()}; the engine runs rank "
                f"{schedule.rank} of a plan for {schedule.plan.world_size}: cross-rank handoffs need the plan's ranks"
            )
        self.plan, self.device = schedule.exchange, device
        self.units = {u.number: u for u in schedule.units}
        self.by_call = {k: schedule.units[i] for k, i in enumerate(schedule.order) if i >= 0}
        self.names = {m: name for name, m in model.named_modules()}
        self.modules = {name: m for m, name in self.names.items()}
        self.bytes = sent

    # ------------------------------------------------------------------ recording
    def after_record(self, k: int, store: Store) -> None:
        """After call k of the recording: send the blocks its unit kept for other ranks, receive
        the blocks other ranks' call k made for this one."""
        if not self.plan:  # nothing of this rank crosses
            return
        unit = self.by_call.get(k)
        outgoing = {to: self._block(unit, to, rows, store) for to, rows in sorted(unit.sends.items())} if unit else {}
        incoming = self.plan.receive.get(k, ())
        if not outgoing and not incoming:
            return
        sizes = {p: torch.zeros(2, dtype=torch.int64, device=self.device) for p, _ in incoming}
        self._run({to: block[0] for to, block in outgoing.items()}, sizes)
        buffers = {p: torch.empty(int(n.sum()), dtype=torch.uint8, device=self.device) for p, n in sizes.items()}
        self._run({to: block[1] for to, block in outgoing.items()}, buffers)
        self.bytes["values"] += sum(message.numel() for _, message in outgoing.values())
        for p, u in incoming:
            header_bytes = int(sizes[p][0])
            header = json.loads(bytes(buffers[p][:header_bytes].cpu().tolist()).decode())
            specs = [(getattr(torch, dtype.removeprefix("torch.")), shape) for *_, dtype, shape in header]
            keys = [(u, (self.modules[name], kind, n), field) for name, kind, n, field, _, _ in header]
            for key, value in zip(keys, _from_bytes(buffers[p][header_bytes:], specs)):
                store.values[key] = value
            store.received[u] = keys

    def _block(
        self, unit: Unit, to: int, rows: dict[Hashable, torch.Tensor], store: Store
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sizes, message) of the block ``unit`` sends rank ``to``: its kept rows that rank reads."""
        keys = [key for key in store.values if key[0] == unit.number and store.subsets[key] in rows]
        values = [store.values[key].index_select(0, rows[store.subsets[key]]) for key in keys]
        store.sent[unit.number, to] = keys
        header = [
            [self.names[module], kind, n, field, str(v.dtype), list(v.shape)]
            for (_, (module, kind, n), field), v in zip(keys, values)
        ]
        head = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8, device=self.device)
        payload = _as_bytes(values, self.device)
        sizes = torch.tensor([head.numel(), payload.numel()], dtype=torch.int64, device=self.device)
        return sizes, torch.cat((head, payload))

    # ------------------------------------------------------------------ replay
    def after_replay(self, k: int, store: Store) -> None:
        """After the replay's rerun of call k: send back the gradients of the blocks whose first
        reader here is call k; receive those other ranks send for this rank's units."""
        if not self.plan:
            return
        outgoing: dict[int, list[torch.Tensor]] = {}
        for p, u in self.plan.grad_send.get(k, ()):
            outgoing.setdefault(p, []).extend(
                store.grads[key] if key in store.grads else torch.zeros_like(store.values[key])
                for key in store.received.pop(u)
            )
            store.release(u)
        incoming: dict[int, list[tuple[int, Key]]] = {}
        for q, u in self.plan.grad_receive.get(k, ()):
            incoming.setdefault(q, []).extend((q, key) for key in store.sent.pop((u, q)))
        if not outgoing and not incoming:
            return
        messages = {p: _as_bytes(grads, self.device) for p, grads in outgoing.items()}
        specs = {q: [self._spec(store, key, q) for _, key in keys] for q, keys in incoming.items()}
        buffers = {
            q: torch.empty(
                sum(torch.Size(s).numel() * d.itemsize for d, s in spec), dtype=torch.uint8, device=self.device
            )
            for q, spec in specs.items()
        }
        self._run(messages, buffers)
        self.bytes["grads"] += sum(m.numel() for m in messages.values())
        for q, keys in incoming.items():
            for (_, key), grad in zip(keys, _from_bytes(buffers[q], specs[q])):
                rows = self.units[key[0]].sends[q][store.subsets[key]]
                total = store.grads.get(key)
                total = torch.zeros_like(store.values[key]) if total is None else total.clone()
                store.grads[key] = total.index_add_(0, rows, grad)

    def _spec(self, store: Store, key: Key, to: int) -> tuple[torch.dtype, list[int]]:
        """dtype and shape of the block of ``key``'s value sent to rank ``to``."""
        value = store.values[key]
        rows = self.units[key[0]].sends[to][store.subsets[key]]
        return value.dtype, [rows.numel(), *value.shape[1:]]

    def _run(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
        """Post every send and receive of one exchange point together, then wait for them all."""
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sorted(sends.items())]
        ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in sorted(receives.items())]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
