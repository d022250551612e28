"""The planner's cost model: seconds of one microbatch's forward + backward, linear in four features.

``seconds = token * compact_tokens + pair * attended_pairs + round * rounds + microbatch``

- compact tokens: projections, MLP/MoE, norms, LM head (token-wise work);
- attended pairs: sum over attention queries of the keys they read (depth + 1 for a token at
  depth p: every ancestor and itself), the quadratic part of full attention;
- rounds: sequential packed linear-attention calls (kernel launches per linear layer);
- one per microbatch: fixed overhead (launch latency, FSDP gathers, optimizer-free bookkeeping).

``forward_share`` is not a feature: the share of those seconds a microbatch's forward alone takes,
what rerunning a recorded microbatch costs again in the backward (``balance.py``). Nor are the
seconds a step spends outside its model calls, once, which a plan's predicted step adds to its
slots (:meth:`CostModel.outside`): ``step``, the host work of a step on one rank (building the
forest, planning, compiling the Schedule); ``step_ranks``, what planning it over several ranks adds
(measured at 2 ranks; at 4 and 8 the planner took no longer on the calibration forests, so it is
not extrapolated); and the data-parallel gradient all-reduce, ``grad_bytes`` (the trainable
parameters' bytes) over a ring at the communication terms' prices.

Communication, for cross-rank handoffs (``handoffs.py``): a handed chain moves ``context_bytes`` per
context token (its K/V in every attention layer) and ``state_bytes`` per path starting under it
(linear-attention / SSM states, conv halos, replay rows), there and (their gradients) back, at
``byte`` seconds per byte plus ``message`` seconds per message; a rank's sends and receives of
an exchange, posted together, overlap but for ``duplex`` of the shorter (:meth:`CostModel.exchange`).

:data:`DEFAULT_COST_MODEL` holds order-of-magnitude values for a ~1B-parameter hybrid model on one
H100-class GPU (about 50K tokens/s forward + backward; attention at ~20K context costs as much
as the rest); its communication terms: :data:`COMM_DEFAULTS`. ``calibrate``
(``harts_hf.lab.calibrate``) fits the coefficients on this machine.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from .balance import FORWARD_SHARE

__all__ = ["COMM_DEFAULTS", "DEFAULT_COST_MODEL", "HOST_BYTE", "CostModel", "cost_origin", "fit_cost_model"]

FEATURES = ("token", "pair", "round", "microbatch")

COMM_DEFAULTS = {"byte": 4e-11, "message": 2e-5, "duplex": 0.0, "context_bytes": 12_288.0, "state_bytes": 2e7}
"""The built-in communication estimate (a cost model without these keys, as every one saved before
handoffs, gets them): 25 GB/s and 20 us per message point to point, each way at once (NCCL over
InfiniBand between nodes, full duplex as the ring all-reduce of :meth:`CostModel.outside` takes it;
NVLink inside a node is faster), for a ~1B hybrid model like the compute terms' (6 attention
layers of 2 K/V heads x 256 in bf16: 12 KiB per context token; 18 GDN layers of 16 x 128 x 128 fp32
states plus a < 64-token bf16 replay of the 2,048-wide input: about 20 MB per path start)."""


HOST_BYTE = 4e-11
"""The built-in estimate of seconds per byte between a GPU and its host's pinned memory, each way:
25 GB/s, below what one PCIe 5.0 x16 link carries (about 50 GB/s), as GPUs sharing a switch or a
socket see it (``graphs.host_seconds``: graphs kept in host memory)."""


@dataclass(frozen=True)
class CostModel:
    """Seconds per compact token, per attended pair, per round and per microbatch; seconds per byte
    and per message between ranks, the share of the shorter direction an exchange both ways adds
    (``duplex``, in [0, 1]), bytes per handed context token and path start (all >= 0); the
    forward's share of a microbatch's seconds (in (0, 1]; absent from a cost model written before
    it was measured: :data:`~.balance.FORWARD_SHARE`, the backward taken as twice the forward), the
    seconds a step spends outside its model calls (:meth:`outside`: ``step`` on one rank,
    ``step_ranks`` more planned over several, ``grad_bytes`` all-reduced between them; absent: 0, as
    a cost model written before they were measured), all measured by ``harts-hf calibrate``; and
    the seconds per byte each way between a GPU and its host's memory (``host_byte``, for graphs
    kept there: :data:`HOST_BYTE`, an estimate, unless the JSON sets it)."""

    token: float
    pair: float
    round: float
    microbatch: float
    byte: float = COMM_DEFAULTS["byte"]
    message: float = COMM_DEFAULTS["message"]
    duplex: float = COMM_DEFAULTS["duplex"]
    context_bytes: float = COMM_DEFAULTS["context_bytes"]
    state_bytes: float = COMM_DEFAULTS["state_bytes"]
    forward_share: float = FORWARD_SHARE
    host_byte: float = HOST_BYTE
    step: float = 0.0
    step_ranks: float = 0.0
    grad_bytes: float = 0.0

    def __post_init__(self) -> None:
        values = asdict(self)
        if any(isinstance(v, bool) or not isinstance(v, (int, float, np.number)) for v in values.values()):
            raise ValueError(f"cost model coefficients must be numbers, got {values}")
        if any(not np.isfinite(v) or v < 0 for v in values.values()):
            raise ValueError(f"cost model coefficients must be finite and >= 0, got {values}")
        if self.token <= 0 and self.pair <= 0:
            raise ValueError("a cost model needs a positive token or pair coefficient: tokens must cost something")
        if self.duplex > 1:
            raise ValueError(f"duplex is a share, in [0, 1]: {self.duplex}")
        if not 0 < self.forward_share <= 1:
            raise ValueError(
                f"forward_share is a forward's share of forward + backward, in (0, 1]: {self.forward_share}"
            )

    def __call__(self, tokens, pairs, rounds, microbatches=1) -> np.ndarray:
        """Predicted seconds (broadcasts over arrays)."""
        return (
            self.token * np.asarray(tokens, dtype=np.float64)
            + self.pair * np.asarray(pairs, dtype=np.float64)
            + self.round * np.asarray(rounds, dtype=np.float64)
            + self.microbatch * np.asarray(microbatches, dtype=np.float64)
        )

    def transfer_bytes(self, context_tokens, path_starts) -> np.ndarray:
        """Bytes of handing ``context_tokens`` and ``path_starts`` over, there and (the gradients) back
        (broadcasts over arrays)."""
        return 2 * (
            self.context_bytes * np.asarray(context_tokens, dtype=np.float64)
            + self.state_bytes * np.asarray(path_starts, dtype=np.float64)
        )

    def transfer(self, context_tokens, path_starts, messages) -> np.ndarray:
        """Predicted seconds of handing ``context_tokens`` and ``path_starts`` over in ``messages``,
        there and (the gradients) back (broadcasts over arrays)."""
        return self.byte * self.transfer_bytes(context_tokens, path_starts) + 2 * self.message * np.asarray(
            messages, dtype=np.float64
        )

    def exchange(self, sends, receives) -> np.ndarray:
        """Predicted seconds a rank spends on an exchange whose sends and receives alone would take
        ``sends`` and ``receives`` seconds, posted together (the engine's exchanges): the longer
        and ``duplex`` of the shorter (broadcasts over arrays)."""
        sends, receives = np.asarray(sends, dtype=np.float64), np.asarray(receives, dtype=np.float64)
        return np.maximum(sends, receives) + self.duplex * np.minimum(sends, receives)

    def outside(self, world_size: int) -> float:
        """Predicted seconds a step over ``world_size`` ranks spends outside its model calls: the host
        work (``step``, and ``step_ranks`` more for a plan over several ranks) and, with several
        ranks, the gradient all-reduce, a ring (as DDP's over gloo or NCCL): each rank sends 2 (R - 1)
        / R of ``grad_bytes`` in 2 (R - 1) messages (none where ``grad_bytes`` is 0: not counted)."""
        if world_size < 1:
            raise ValueError(f"a step runs on at least one rank, got world_size {world_size}")
        if world_size == 1:
            return self.step
        ring = 2 * (world_size - 1)
        reduce = ring * (self.byte * self.grad_bytes / world_size + self.message) if self.grad_bytes > 0 else 0.0
        return self.step + self.step_ranks + reduce

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


DEFAULT_COST_MODEL = CostModel(token=2e-5, pair=1e-9, round=1e-3, microbatch=5e-3)
"""A built-in estimate for a ~1B model on an H100: it orders and balances work; its seconds are not
this machine's (``cost_origin``)."""


def cost_origin(cost_model: CostModel) -> str:
    """Where a cost model's predicted seconds come from, for every place that prints or plots them."""
    if cost_model == DEFAULT_COST_MODEL:
        return "the built-in H100 estimate, not this machine (harts-hf calibrate --json F fits one here)"
    notes = ["the given cost model"]
    if cost_model.forward_share == FORWARD_SHARE:  # a cost model written before calibrate measured it
        notes.append("its reruns at an assumed forward share of 1/3 (backward = 2 x forward)")
    if {k: getattr(cost_model, k) for k in COMM_DEFAULTS} == COMM_DEFAULTS:
        notes.append("its communication terms are COMM_DEFAULTS' estimate (harts-hf calibrate --comm measures them)")
    if cost_model.step_ranks == 0 and cost_model.grad_bytes == 0:  # written before calibrate measured them
        notes.append("no seconds for planning over several ranks or their gradient all-reduce (assumed 0)")
    return "; ".join(notes)


def fit_cost_model(features: np.ndarray, seconds: np.ndarray, forward_share: float = FORWARD_SHARE) -> CostModel:
    """Non-negative least squares fit of ``seconds`` [n] on ``features`` [n, 4] (tokens, pairs,
    rounds, microbatches), relative error weighted so small and large microbatches count alike;
    ``forward_share`` (measured apart) is passed through.

    Exact NNLS by enumerating the supports (four coefficients): the best unconstrained fit on
    each support, kept when non-negative; supports without a positive token or pair coefficient
    are skipped (tokens must cost something for the planner to balance them).
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (x.shape[0],):
        raise ValueError(f"want features [n, {len(FEATURES)}] and seconds [n], got {x.shape} and {y.shape}")
    if (y <= 0).any():
        raise ValueError("measured seconds must be positive")
    xw, yw = x / y[:, None], np.ones_like(y)  # relative residuals
    scale = np.abs(xw).max(axis=0)
    scale[scale == 0] = 1.0
    xs = xw / scale
    best, best_err = None, np.inf
    for k in range(1, len(FEATURES) + 1):
        for support in itertools.combinations(range(len(FEATURES)), k):
            sel = np.array(support)
            coef, *_ = np.linalg.lstsq(xs[:, sel], yw, rcond=None)
            if (coef < 0).any() or not (coef[sel < 2] > 0).any():  # features 0, 1: token, pair
                continue
            err = float(np.sum((xs[:, sel] @ coef - yw) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(len(FEATURES))
                best[sel] = coef
    if best is None:
        raise ValueError("no non-negative fit gives tokens or attended pairs a positive cost")
    return CostModel(**dict(zip(FEATURES, (best / scale).tolist())), forward_share=forward_share)
