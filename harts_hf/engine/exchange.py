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

Wire format (``wire``), recording: per (producer unit, reading rank) one block of named values.
The receiver reads the header on the host (one small transfer per block, between model calls,
never inside a layer). Replay: per (reading rank, producer rank) one uint8 message, the gradients
of every block the producer sent it, in its header order, unit by unit: the producer knows their
sizes, so no header.

A block whose reader runs in the producer's own call (a context-parallel group) streams inside
the call instead (:class:`~.stream.Streams`, which the Exchanger holds: ``streams``); the Exchanger
only closes each call's streams before its own exchange.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Schedule, Unit
from .store import Key, Store
from .stream import Streams
from .wire import as_bytes, decode, encode, from_bytes

__all__ = ["Exchanger"]


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
        self.streams = Streams(schedule, self.names, device, sent)
        self.streamed = {(p, q) for entries in self.plan.stream_send.values() for q, p in entries}

    # ------------------------------------------------------------------ recording
    def after_record(self, k: int, store: Store) -> None:
        """After call k of the recording: send the blocks its unit kept for other ranks, receive
        the blocks other ranks' call k made for this one."""
        if not self.plan:  # nothing of this rank crosses
            return
        self.streams.end_call(k, store)
        unit = self.by_call.get(k)
        outgoing = {
            to: self._block(unit, to, rows, store)
            for to, rows in sorted(unit.sends.items() if unit else ())
            if (unit.number, to) not in self.streamed
        }
        incoming = self.plan.receive.get(k, ())
        if not outgoing and not incoming:
            return
        sizes = {p: torch.zeros(2, dtype=torch.int64, device=self.device) for p, _ in incoming}
        self._run({to: block[0] for to, block in outgoing.items()}, sizes)
        buffers = {p: torch.empty(int(n.sum()), dtype=torch.uint8, device=self.device) for p, n in sizes.items()}
        self._run({to: block[1] for to, block in outgoing.items()}, buffers)
        self.bytes["values"] += sum(message.numel() for _, message in outgoing.values())
        for p, u in incoming:
            keys = []
            for (name, kind, n, field), value in decode(sizes[p], buffers[p]):
                keys.append((u, (self.modules[name], kind, n), field))
                store.values[keys[-1]] = value
            store.received[u] = keys

    def _block(
        self, unit: Unit, to: int, rows: dict[Hashable, torch.Tensor], store: Store
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sizes, message) of the block ``unit`` sends rank ``to``: its kept rows that rank reads."""
        keys = [key for key in store.values if key[0] == unit.number and store.subsets[key] in rows]
        values = [store.values[key].index_select(0, rows[store.subsets[key]]) for key in keys]
        store.sent[unit.number, to] = keys
        names = [(self.names[module], kind, n, field) for _, (module, kind, n), field in keys]
        return encode(list(zip(names, values)), self.device)

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
        messages = {p: as_bytes(grads, self.device) for p, grads in outgoing.items()}
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
            for (_, key), grad in zip(keys, from_bytes(buffers[q], specs[q])):
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
