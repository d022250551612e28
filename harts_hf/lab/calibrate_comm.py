"""``calibrate_comm(model)``: the cost model's communication terms, measured on this machine.

Seconds per byte and per message come from a real exchange: two processes (gloo over loopback, CPU,
one thread each) send tensors of 1 KiB to 16 MiB back and forth; half a round trip, the fastest of
``repeats``, is fitted as ``message + byte * bytes`` (non-negative least squares). ``duplex``, how
much a message the other way at the same time slows one (the engine posts a rank's sends and
receives of an exchange together), comes from the largest size sent both ways at once. Bytes per handed
context token and per path start come from the model (``harts_hf.engine.memory.memory_breakdown``:
the K/V one context row keeps in every attention layer; the conv halos, replay rows and states one
path start reads). A cluster's NCCL between nodes is not what this measures: there, run it on the
nodes, or set ``byte`` and ``message`` in the cost model's JSON.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..planner.cost import CostModel

__all__ = ["MESSAGE_BYTES", "calibrate_comm", "fit_duplex", "fit_exchange", "measure_exchange", "model_bytes"]

MESSAGE_BYTES = (2**10, 2**14, 2**18, 2**21, 2**24)
"""The sizes exchanged (bytes): latency-bound to bandwidth-bound."""


def _fastest(repeats: int, exchange: Callable[..., object], *args: object) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``exchange(*args)`` on both processes at once
    (a warm-up call first)."""
    best = np.inf
    for _ in range(repeats + 1):
        dist.barrier()
        began = time.perf_counter()
        exchange(*args)
        best = min(best, time.perf_counter() - began)
    return best


def _round_trip(rank: int, buf: torch.Tensor) -> None:
    """``buf`` from rank 0 to 1 and back."""
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _both_ways(peer: int, buf: torch.Tensor, other: torch.Tensor) -> None:
    """``buf`` to ``peer`` while ``other`` comes from it, posted together (as the engine's exchanges)."""
    ops = [dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, other, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _ping_pong(rank: int, port: int, repeats: int, out: dict) -> None:
    """One of the two processes: per size, round trips, then exchanges both ways at once; rank 0
    keeps the fastest of each."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        one, both = [], []
        for size in MESSAGE_BYTES:
            buf, other = torch.zeros(size // 4), torch.zeros(size // 4)
            one.append(_fastest(repeats, _round_trip, rank, buf) / 2)
            both.append(_fastest(repeats, _both_ways, 1 - rank, buf, other))
        if rank == 0:
            out["one"], out["both"] = one, both
    finally:
        dist.destroy_process_group()


def measure_exchange(repeats: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes [n], seconds [n], both [n]): one point-to-point message of each of :data:`MESSAGE_BYTES`
    one way, and two at once, one each way."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ping_pong, args=(port, repeats, out), nprocs=2, join=True)
        one, both = np.array(out["one"]), np.array(out["both"])
    return np.array(MESSAGE_BYTES, dtype=np.float64), one, both


def fit_duplex(one: float, both: float) -> float:
    """The cost model's ``duplex``: the share of a message one way that a message the other way at
    the same time adds (0: the link carries both at full speed; 1: one after the other), from the
    largest message's seconds one way and both ways at once, clipped to [0, 1]."""
    return float(np.clip(both / one - 1, 0.0, 1.0))


def fit_exchange(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(seconds per byte, seconds per message) >= 0 fitting ``seconds`` on ``nbytes``, relative error
    weighted (small messages count as much as large ones); a negative coefficient is fixed at 0."""
    x = np.stack([np.asarray(nbytes, dtype=np.float64), np.ones(len(seconds))], axis=1) / seconds[:, None]
    coef, *_ = np.linalg.lstsq(x, np.ones(len(seconds)), rcond=None)
    if (coef < 0).any():
        keep = int(np.argmax(coef))
        coef = np.zeros(2)
        coef[keep] = float(np.linalg.lstsq(x[:, keep : keep + 1], np.ones(len(seconds)), rcond=None)[0][0])
    return float(coef[0]), float(coef[1])


def model_bytes(model: nn.Module) -> tuple[float, float]:
    """(bytes per handed context token, bytes per handed path start) of a patched ``model``."""
    from ..engine.memory import memory_breakdown

    kinds = memory_breakdown(model)
    return float(sum(k.kv for k in kinds)), float(sum(k.path for k in kinds))


def calibrate_comm(cost: CostModel, model: nn.Module, repeats: int = 5) -> CostModel:
    """``cost`` with its communication terms measured here for the patched ``model``."""
    nbytes, one, both = measure_exchange(repeats)
    byte, message = fit_exchange(nbytes, one)
    context_bytes, state_bytes = model_bytes(model)
    return CostModel(
        **{
            **cost.as_dict(),
            "byte": byte,
            "message": message,
            "duplex": fit_duplex(one[-1], both[-1]),
            "context_bytes": context_bytes,
            "state_bytes": state_bytes,
        }
    )
