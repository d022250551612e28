"""Context-parallel groups on the wire: a handoff between spans of one slot, streamed layer call by
layer call.

Why: a trajectory longer than the budget otherwise runs as pieces in sequence on one rank while
the others idle. Its contiguous spans may instead run in one slot on several ranks (a group,
``harts_hf.schedule.crossrank.check_groups``); the handoffs between them use the addresses of
every other handoff (ancestor K/V, conv halos, replay inputs, recurrent states), so every layer
kind is exact without new kernel math, and they stream: the producer posts a layer call's values
as soon as its Handoff keeps them, the reader waits for them where it reads them. The reader's
layer l then runs while the producer runs layer l + 1: R ranks run L layers in L + R - 1 layer
times instead of R L (a pipelined wavefront).

Backward, the reverse wavefront: the reader's context leaves send their gradients back as autograd
produces them (a tensor hook; those of values it does not read itself, which later slots read or
none, before its backward starts; the rest, and the flush, in a callback at the end of the reader's
backward pass, before a data-parallel wrapper's own), in the reverse of the order the values came;
the producer's kept values enter its backward through :class:`_GradIn`, whose backward receives
them (the autograd engine runs these in reverse creation order: a later layer's first). Readers
never wait for producers in the backward, producers never for readers in the forward: no cycle.

Ordering (NCCL ignores tags): every (producer unit, reading rank) pair is one ordered channel.
Forward: the producer's messages in the order it keeps values, three per value (its ``wire``
header's size and the header on a host group, :func:`host_group`; then the value itself), then an
end mark (size 0) after the call; the reader receives them in order, buffering the ones it
reads later, and drains the rest after the call (values later slots read). Backward: one gradient
message per value, in the reverse order; the producer receives them in that order, buffering. A
checkpoint's recomputation finds its values and leaves already there (``Handoff``). Headers are
host metadata on both sides (no device-to-host copy inside a layer: on a GPU the payloads go by
NCCL, the headers by gloo).

Collectives inside a model call that need every rank at the same layer (FSDP2's per-layer
gathers) would hold the wavefront at every layer: under FSDP2 the engine gathers every parameter
before a group's call instead (``TreeEngine._gather``); only the last backward's gradient
reduce-scatter still meets at each layer.
DDP synchronises in its last backward's callback, after the reader's flush.

Legend: X a value's kept rows, r the rows one reading rank reads.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Schedule, Unit
from .store import Key, Store
from .wire import header, read_header

__all__ = ["Inbox", "Outbox", "Streams"]


@functools.cache
def host_group(default: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The group headers travel on, in host memory: None (the ``default`` group) where it carries
    CPU tensors (gloo), else a gloo group over the same ranks, made once per default group (every
    rank of a plan with cross-rank handoffs makes its first Exchanger at the same point)."""
    return None if "gloo" in dist.get_backend(default) else dist.new_group(backend="gloo")


class Streams:
    """One rank's streamed handoffs in one pass (module docstring): what its units send to, and read
    from, units of their groups.

    Args:
        schedule: the rank's compiled schedule (``exchange.stream_send`` / ``stream_receive``).
        names: the patched model's modules' qualified names (they name the calls on the wire).
        device: where the values live.
        sent: bytes this rank sent, by "values" and "grads" (added to).
    """

    def __init__(self, schedule: Schedule, names: dict[nn.Module, str], device: torch.device, sent: dict[str, int]):
        exchange = schedule.exchange
        self.send_after, self.receive_after = exchange.stream_send, exchange.stream_receive
        self.units = {u.number: u for u in schedule.units}
        self.readers: dict[int, tuple[int, ...]] = {}  # this rank's producer -> the ranks of its group reading it
        for entries in exchange.stream_send.values():
            for q, p in entries:
                self.readers[p] = (*self.readers.get(p, ()), q)
        # another rank's producer -> (its rank, the index of this rank's unit of its group)
        self.peers = {p: (r, schedule.order[k]) for k, entries in exchange.stream_receive.items() for r, p in entries}
        self.names = names
        self.modules = {name: m for m, name in names.items()}
        self.device, self.bytes = device, sent
        self.host = host_group(dist.group.WORLD)
        self._posted: list[tuple[Any, ...]] = []  # (work, tensor it sends): kept alive until waited

    def producers(self, unit: Unit) -> list[int]:
        """The producers ``unit`` reads in its group (streamed)."""
        return [p for p, (_, index) in self.peers.items() if index == unit.index]

    def peer(self, unit: Unit, producer: int) -> int | None:
        """The rank of ``producer`` if ``unit`` reads it in its group (streamed), else None."""
        at = self.peers.get(producer)
        return at[0] if at is not None and at[1] == unit.index else None

    # ------------------------------------------------------------------ forward
    def keep(self, key: Key, value: torch.Tensor, subset: Hashable, store: Store) -> None:
        """A producer kept ``value`` [X, ...] for ``subset``: post the rows each reading rank of its
        group reads, now (inside the call)."""
        p = key[0]
        for q in self.readers.get(p, ()):
            rows = self.units[p].sends[q].get(subset)
            if rows is None:
                continue
            module, kind, n = key[1]
            block = value.detach().index_select(0, rows)
            head = header([((self.names[module], kind, n, key[2]), block)])
            self._post(q, self.host, torch.tensor([head.numel()]), head)
            self._post(q, None, block)
            store.sent.setdefault((p, q), []).append(key)
            self.bytes["values"] += head.numel() + block.nbytes

    def fetch(self, key: Key, store: Store) -> None:
        """Receive the producer's messages in order until ``key``'s value is in ``store``."""
        while key not in store.values:
            if not self._receive(key[0], store):
                module, kind, n = key[1]
                raise RuntimeError(
                    f"unit {key[0]} ended its call without sending {key[2]!r} of {type(module).__name__}'s {kind!r} "
                    f"call {n}: the ranks of a context-parallel group ran different layers"
                )

    def end_call(self, k: int, store: Store) -> None:
        """After call k: mark the end of every stream its producer sent, drain the streams its reader
        read (the values later slots read), and wait for this rank's sends."""
        for q, _ in self.send_after.get(k, ()):
            self._post(q, self.host, torch.zeros(1, dtype=torch.int64))
        for _, p in self.receive_after.get(k, ()):
            while self._receive(p, store):
                pass
        for work, *_ in self._posted:
            work.wait()
        self._posted.clear()

    def _post(self, to: int, group: dist.ProcessGroup | None, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._posted.append((dist.isend(t.contiguous(), to, group=group), t))

    def _receive(self, p: int, store: Store) -> bool:
        """One value of producer ``p`` into ``store``: its header on the host, then its payload
        straight into a tensor of its dtype and shape; False at the producer's end mark."""
        rank = self.peers[p][0]
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, rank, group=self.host)
        if int(size) == 0:
            return False
        head = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(head, rank, group=self.host)
        (((name, kind, n, field), dtype, shape),) = read_header(head)
        value = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(value, rank)
        key = (p, (self.modules[name], kind, n), field)
        store.values[key] = value
        store.received.setdefault(p, []).append(key)
        return True

    # ------------------------------------------------------------------ backward
    def inbox(self, unit: Unit, store: Store) -> Inbox | None:
        """Where ``unit``'s backward receives its group readers' gradients (None: it has none)."""
        readers = self.readers.get(unit.number)
        return None if readers is None else Inbox(unit, readers, store)

    def outbox(self, producer: int, store: Store, leaves: dict[Key, torch.Tensor]) -> Outbox:
        """Where a group reader's backward sends ``producer``'s gradients (``leaves``: its run's)."""
        return Outbox(producer, self.peers[producer][0], store, leaves, self.bytes)


class Inbox:
    """A producer's gradients from the readers of its group, for one run with grad: per reading rank
    in the reverse order of the values sent (module docstring), received as its backward asks."""

    def __init__(self, unit: Unit, readers: tuple[int, ...], store: Store):
        self.unit, self.readers, self.store = unit, readers, store
        self.left: dict[int, deque] | None = None  # per reading rank: keys whose gradients are still to come
        self.got: dict[tuple[int, Key], torch.Tensor] = {}

    def marker(self, key: Key, value: torch.Tensor, subset: Hashable) -> torch.Tensor | None:
        """A scalar whose backward (a root of the unit's) adds the group's gradients to ``value``'s
        (None if no reader of the group reads ``subset`` or ``value`` has no gradient)."""
        if not value.requires_grad or all(subset not in self.unit.sends[q] for q in self.readers):
            return None
        return _GradIn.apply(self, key, value)

    def take(self, key: Key) -> torch.Tensor:
        """[X, ...] the gradients of ``key``'s value the group's readers send, summed."""
        value = self.store.values[key]
        total = torch.zeros_like(value)
        for q, left in self._left().items():
            if key not in self.store.sent.get((self.unit.number, q), ()):  # none where q reads no kept value
                continue
            while (q, key) not in self.got:
                self._receive(q, left.popleft())
            total.index_add_(0, self._rows(q, key), self.got.pop((q, key)))
        return total

    def drain(self) -> None:
        """Receive what no marker asked for (values without gradient); forget the streams."""
        for q, left in self._left().items():
            while left:
                self._receive(q, left.popleft())
            self.store.sent.pop((self.unit.number, q), None)
        self.got.clear()

    def _left(self) -> dict[int, deque]:
        if self.left is None:  # the order is complete once the unit's recording ran
            self.left = {q: deque(reversed(self.store.sent.get((self.unit.number, q), []))) for q in self.readers}
        return self.left

    def _rows(self, q: int, key: Key) -> torch.Tensor:
        return self.unit.sends[q][self.store.subsets[key]]

    def _receive(self, q: int, key: Key) -> None:
        value = self.store.values[key]
        grad = torch.empty((self._rows(q, key).numel(), *value.shape[1:]), dtype=value.dtype, device=value.device)
        dist.recv(grad, q)
        self.got[q, key] = grad


class _GradIn(torch.autograd.Function):
    """A scalar marker of a producer's kept value whose backward returns, as the value's gradient,
    what the readers of its group send back (:meth:`Inbox.take`)."""

    @staticmethod
    def forward(ctx, inbox: Inbox, key: Key, value: torch.Tensor) -> torch.Tensor:
        ctx.inbox, ctx.key = inbox, key
        return value.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):
        return None, None, ctx.inbox.take(ctx.key)


class Outbox:
    """A group reader's gradients for one producer, for one run with grad: sent in the reverse order
    the values came, each as soon as it and every one before it are known (module docstring)."""

    def __init__(self, producer: int, rank: int, store: Store, leaves: dict[Key, torch.Tensor], sent: dict[str, int]):
        self.producer, self.rank, self.store, self.leaves, self.bytes = producer, rank, store, leaves, sent
        self.left: deque | None = None
        self.ready: dict[Key, torch.Tensor] = {}
        self.posted: list[tuple[Any, torch.Tensor]] = []
        self.queued = False

    def arrived(self, key: Key, grad: torch.Tensor) -> None:
        """A leaf's hook: its gradient is known."""
        if not self.queued:
            # The rest at the end of this backward pass, before DDP's callback waits for its
            # gradient sync (which the producer's rank joins only once it received them all). The
            # engine's callback queue is what DDP and FSDP use for the same purpose.
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.queued = True
        self.ready[key] = grad
        self._advance(final=False)

    def start(self) -> None:
        """Before the reader's backward: send the gradients due ahead of the first value it reads
        (those of values it does not: known, the later slots' backward ran first)."""
        self._advance(final=False)

    def flush(self) -> None:
        """Send every gradient still due (0 or the local readers' for values no leaf here received)
        and wait for the sends."""
        self._advance(final=True)
        for work, _ in self.posted:
            work.wait()
        self.posted.clear()

    def _advance(self, final: bool) -> None:
        if self.left is None:
            self.left = deque(reversed(self.store.received.get(self.producer, [])))
        while self.left:
            key = self.left[0]
            if key not in self.ready and key in self.leaves and not final:
                return  # its leaf's gradient is still to come
            self.left.popleft()
            grad, local = self.ready.pop(key, None), self.store.grads.get(key)
            total = grad if local is None else local if grad is None else local + grad
            total = (torch.zeros_like(self.store.values[key]) if total is None else total).contiguous()
            self.posted.append((dist.isend(total, self.rank), total))
            self.bytes["grads"] += total.nbytes
