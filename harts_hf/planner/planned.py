"""The Plan: what ``plan()`` decides for one step (ranks, slots, pieces, their predicted costs) and
what the schedule compiles. In a file of its own so the planner's passes (``handoffs.py``,
``groups.py``) read and remake plans without importing ``plan.py``, which runs them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .balance import rank_imbalance, rank_seconds, slot_imbalance, step_seconds
from .cost import CostModel, cost_origin
from .graphs import unkept
from .memory import Budget, MemoryModel

__all__ = ["Plan"]


@dataclass(frozen=True, eq=False)
class Plan:
    """Microbatch slots per rank, their pieces and the handoffs between them.

    Pieces [P], ordered by (rank, slot), in a microbatch the cut pieces (DFS order) before whole
    trees: ``piece_rank``, ``piece_slot``, ``piece_forest`` and the forest-local DFS range
    ``piece_start:piece_end`` (a shared chain above the rank's subtrees, a whole tree, or a DFS
    range of one subtree; never two trees). ``piece_replica``: the tokens are owned by another
    rank and recomputed here as context (their losses belong to the owner: see ``traj_rank``).
    ``piece_branch``: the branch (a subtree assigned whole to one rank, ``assign.py``) the piece
    belongs to, -1 for a shared chain.

    Microbatches [R, S] (slot s of rank r): predicted ``cost`` (seconds), own ``tokens``,
    ``context`` tokens (ancestors in earlier slots its attention reads; ``budget.footprint(tokens,
    context) <= budget.tokens``) and linear-attention ``rounds``. Empty microbatches cost 0;
    ``peak_bytes`` is what ``memory_model`` predicts they hold.

    A microbatch's context lies in pieces of earlier slots: of its own rank, or of another rank,
    whose unit then sends it (a cross-rank handoff: ``harts_hf.engine.exchange``; never from the
    same slot of another rank, which would need context parallelism). ``plan()`` places a rank's
    context on the rank (replica pieces) unless called with ``handoffs=True``: then ``handoffs``
    (messages between ranks), ``handoff_bytes`` (values and gradients) and ``handoff_seconds`` (the
    most a rank spends on them, in ``cost``) count the chains it hands over. Which
    pieces, and where each context row and boundary state comes from (the handoff addresses), is
    compiled from these pieces by ``harts_hf.schedule``, the one place that derives them; the plan
    keeps only the context's size, which the budget decides on.

    ``graph_slots`` [R]: how many last slots of each rank keep their graphs from the recording to
    their backward (at least 1; ``graphs.py``): the engine reruns the others in the backward, and
    the predicted step charges them a forward more (``cost_model.forward_share``), or, where the
    budget gives host memory (``budget.host_bytes``) and the ``graph_rule`` allows
    (``graphs.GRAPH_RULES``), keeps them there (``host_graphs``), charged what the copies add.

    With ``context_parallel=True``, ``groups`` context-parallel groups (``groups.py``: microbatches
    of one slot on several ranks reading each other, streamed by the engine), the largest over
    ``group_ranks`` ranks, their spans' context and states moving ``group_bytes`` (an upper bound),
    priced as wavefronts over ``group_layers`` decoder layers.

    ``traj_rank``: per forest, [B] the rank computing each trajectory's loss (the owner of its
    last token; its whole path is on that rank unless part of it is handed over). ``forest_digests``: per forest, the
    ``RolloutForest.shape_digest`` the plan was made for.
    """

    world_size: int
    num_slots: int
    budget: Budget
    memory_model: MemoryModel
    chunk_size: int
    cost_model: CostModel
    piece_rank: np.ndarray
    piece_slot: np.ndarray
    piece_forest: np.ndarray
    piece_start: np.ndarray
    piece_end: np.ndarray
    piece_replica: np.ndarray
    piece_branch: np.ndarray
    cost: np.ndarray
    tokens: np.ndarray
    context: np.ndarray
    rounds: np.ndarray
    graph_slots: np.ndarray
    traj_rank: list[np.ndarray]
    forest_digests: tuple[str, ...]
    num_compact_tokens: int
    replicated_tokens: int
    replay_tokens: int
    plan_seconds: float
    graph_rule: str = "budget"
    handoffs: int = 0
    handoff_bytes: float = 0.0
    handoff_seconds: float = 0.0
    groups: int = 0
    group_ranks: int = 0
    group_bytes: float = 0.0
    group_layers: int = 0

    @property
    def num_pieces(self) -> int:
        return int(self.piece_rank.size)

    @property
    def slot_imbalance(self) -> float:
        """max over slots of (max rank cost / mean rank cost) in the slot (see ``balance.py``)."""
        return slot_imbalance(self.cost)

    @property
    def rank_imbalance(self) -> float:
        """max rank total cost / mean rank total cost."""
        return rank_imbalance(self.cost)

    @property
    def redundancy(self) -> float:
        """Extra compact tokens computed over the unsplit forest (replicated shared chains plus the
        replay cuts add, an upper bound), per compact token."""
        return (self.replicated_tokens + self.replay_tokens) / self.num_compact_tokens

    @property
    def unit_counts(self) -> np.ndarray:
        """[R] model calls each rank makes: one per slot and forest it holds tokens of."""
        num_forests = int(self.piece_forest.max()) + 1 if self.num_pieces else 1
        calls = np.unique((self.piece_rank * self.num_slots + self.piece_slot) * num_forests + self.piece_forest)
        return np.bincount(calls // (self.num_slots * num_forests), minlength=self.world_size)

    @property
    def fits_budget(self) -> bool:
        """Whether every microbatch's footprint, received context included, is within the budget."""
        return bool((self.budget.footprint(self.tokens, self.context) <= self.budget.tokens).all())

    @property
    def peak_bytes(self) -> np.ndarray:
        """[R, S] bytes the memory model predicts each microbatch holds (0 when empty)."""
        return np.where(self.tokens > 0, self.memory_model(self.tokens, self.context), 0.0)

    @cached_property
    def _unkept(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rerun, host graphs, host copies' seconds) [R, S] (``graphs.unkept``), once per plan: the
        step's price reads them all."""
        return unkept(
            self.memory_model,
            self.cost_model,
            self.budget,
            self.tokens,
            self.context,
            self.cost,
            self.graph_slots,
            self.graph_rule,
        )

    @property
    def rerun(self) -> np.ndarray:
        """[R, S] bool: the microbatches rerun in the backward (no graph kept; empty ones never)."""
        return self._unkept[0]

    @property
    def host_graphs(self) -> np.ndarray:
        """[R, S] bool: the microbatches whose graphs wait in host memory for their backward."""
        return self._unkept[1]

    @property
    def host_copy_seconds(self) -> np.ndarray:
        """[R, S] seconds the host graphs' copies add (0 elsewhere)."""
        return self._unkept[2]

    @property
    def host_bytes(self) -> np.ndarray:
        """[R] bytes of graphs each rank keeps in host memory at once (before its backward)."""
        return np.where(self.host_graphs, self.memory_model.saved(self.tokens, self.context), 0.0).sum(axis=1)

    @property
    def step_seconds(self) -> float:
        """Predicted lockstep step time: per slot, the slowest rank, and the slowest rank's rerun or
        host copies; and the step's work outside its model calls (``cost_model.outside``)."""
        share = self.cost_model.forward_share
        return step_seconds(self.cost, self.rerun, share, self.host_copy_seconds) + self.cost_model.outside(
            self.world_size
        )

    @property
    def rank_seconds(self) -> np.ndarray:
        """[R] each rank's predicted forward + backward seconds on its own, reruns, host copies and
        the step's work outside its model calls included."""
        share = self.cost_model.forward_share
        return rank_seconds(self.cost, self.rerun, share, self.host_copy_seconds) + self.cost_model.outside(
            self.world_size
        )

    def microbatch(self, rank: int, slot: int) -> list[tuple[int, np.ndarray]]:
        """(forest index, compact indices) of the tokens of slot ``slot`` on rank ``rank``, one
        entry per forest it touches: what ``TreeBatch.from_forest(forest, tokens=...)`` takes."""
        sel = np.flatnonzero((self.piece_rank == rank) & (self.piece_slot == slot))
        out = []
        for f in np.unique(self.piece_forest[sel]):
            mine = sel[self.piece_forest[sel] == f]
            idx = np.concatenate([np.arange(s, e) for s, e in zip(self.piece_start[mine], self.piece_end[mine])])
            out.append((int(f), idx))
        return out

    def summary(self) -> dict:
        """The numbers ``harts-hf plan`` reports."""
        return {
            "world_size": self.world_size,
            "slots": self.num_slots,
            "pieces": self.num_pieces,
            "imbalance": {"slot": self.slot_imbalance, "rank": self.rank_imbalance},
            "redundancy": self.redundancy,
            "step_seconds": self.step_seconds,
            "step_seconds_from": cost_origin(self.cost_model),
            "slot_seconds": {"slowest": self.cost.max(axis=0).tolist(), "mean": self.cost.mean(axis=0).tolist()},
            "plan_seconds": self.plan_seconds,
            "handoffs": {"messages": self.handoffs, "bytes": self.handoff_bytes, "seconds": self.handoff_seconds},
            "graphs": {
                "rule": self.graph_rule,
                "rerun": int(self.rerun.sum()),
                "host": int(self.host_graphs.sum()),
                "host_bytes": float(self.host_bytes.max()),
            },
            "context_parallel": {
                "groups": self.groups,
                "ranks": self.group_ranks,
                "bytes": self.group_bytes,
                "layers": self.group_layers,
            },
        }
