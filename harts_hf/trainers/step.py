"""The HARTS step: one plan over every rank's rows of an optimizer step; TRL's loss on stock's rows.

A *block* is the run of TRL microbatches of one optimizer step that one generation buffer holds
(the whole step unless ``steps_per_generation`` is smaller than ``gradient_accumulation_steps``).
At the block's first loss pass:

1. every rank's rows of the block are all-gathered and become one forest (rank-major, then
   microbatch, then row: the order stock TRL gives them);
2. one plan over the ranks and their microbatch slots under the token budget
   (:func:`harts_hf.plan`) decides who computes which tokens when: trees are divided between
   ranks where that lowers the step time, trees above the budget are cut into pieces that the
   schedule's handoffs join exactly;
3. every rank's engine records its units without grad, and the log-probs and entropies of the
   trajectories it owns are summed over the ranks, so every rank holds every row's values.

Each TRL microbatch's loss then runs, unchanged, on exactly the rows and grouping stock TRL gives
it, reading its values from one leaf tensor; its backward accumulates the gradients w.r.t. the
log-probs (and entropies, for the entropy bonus) there. After the block's last microbatch those
gradients are summed over the ranks and every rank's engine backpropagates its units, in reverse
slot order, one unit's graph alive at a time; gradient synchronisation runs once, in the last of
these backward passes (the others run in accelerate's ``no_sync``), through the wrapper the trainer
trains (DDP, FSDP2).

Legend: B rows of the block on all ranks, L their longest row, b a microbatch's rows.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np
import torch
from accelerate.utils import gather_object
from torch.distributed.fsdp import FSDPModule

from ..engine import TreeEngine
from ..forest import RolloutForest
from ..modeling.moe import router_aux_loss
from ..planner import Planners, plan
from .rows import row_sequences, to_completion_layout

__all__ = ["HARTSStep", "batch_rows", "block_length"]


def block_length(step: int, accumulation: int, steps_per_generation: int) -> int:
    """Microbatches from trainer step ``step`` to the end of its optimizer step or of its
    generation buffer, whichever comes first."""
    return min(accumulation - step % accumulation, steps_per_generation - step % steps_per_generation)


def batch_rows(batch: dict) -> list[np.ndarray]:
    """The real tokens of every row of a TRL microbatch (prompt then completion), or of a pass's
    ``input_ids`` under its ``attention_mask``."""
    if "input_ids" in batch:
        return row_sequences(batch["input_ids"], batch["attention_mask"])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return row_sequences(ids, mask)


def _key(row: np.ndarray) -> bytes:
    return np.asarray(row, dtype=np.int64).tobytes()


def _same_sequences(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class HARTSStep:
    """One block's log-probs and entropies on every rank (module docstring). Every rank makes it
    at the same time (it all-gathers the rows and sums the values over the ranks). Made with grad
    enabled it records its units for :meth:`backward` (a loss pass); without, it is a no-grad pass
    over the same kind of plan (old policy, reference, evaluation).

    Args:
        trainer: the trainer (its accelerator).
        model: the model as the trainer runs it (wrapped by DDP / FSDP2 where it is).
        microbatches: this rank's TRL microbatches of the block, in order (or, for a no-grad pass,
            ``{"input_ids", "attention_mask"}`` batches: :func:`batch_rows`).
        plan_options: ``max_tokens_per_microbatch``, ``cost_model``, ``chunk_size`` for the plan.
        entropy: compute the entropies too.
        entropy_grad: the losses backpropagate through the entropies (TRL's entropy bonus).
        router: the losses add the MoE router loss of each microbatch (:meth:`aux_loss`).
        statistics: also these per-token head statistics (``logprobs.PAIR_STATISTICS`` other than the
            entropy; no gradient), :attr:`statistics`.
        temperature: divides the logits (the rollout trainers' sampling temperature).
        previous: an earlier step; where its rows and plan options are this one's (the reference
            pass after the old-policy pass), its forest, plan and schedule are reused.
        inside_forward: the step is made inside the forward of ``model`` (a no-grad pass answering a
            fused-head call: the wrapper's forward has begun), so its calls run the model directly.

    Attributes:
        sequences: every rank's rows of the block (their real tokens), in the forest's order.
    """

    def __init__(
        self,
        trainer,
        model: torch.nn.Module,
        microbatches: Sequence[dict],
        plan_options: dict,
        *,
        entropy: bool = True,
        entropy_grad: bool = False,
        router: bool = False,
        statistics: tuple[str, ...] = (),
        temperature: float = 1.0,
        previous: HARTSStep | None = None,
        inside_forward: bool = False,
    ):
        began = time.perf_counter()
        acc = self.accelerator = trainer.accelerator
        self.microbatches = list(microbatches)
        rows = [batch_rows(batch) for batch in microbatches]
        mine = [row for part in rows for row in part]
        everyone = gather_object([mine]) if acc.num_processes > 1 else [mine]  # per rank, its rows
        first = sum(len(part) for part in everyone[: acc.process_index])
        bounds = first + np.cumsum([0] + [len(part) for part in rows])
        self._rows = [torch.arange(a, b, device=acc.device) for a, b in zip(bounds[:-1], bounds[1:])]
        self.sequences = [row for part in everyone for row in part]  # every rank's rows, in the forest's order
        self.plan_options = plan_options
        same = (
            previous is not None
            and previous.plan_options == plan_options
            and _same_sequences(previous.sequences, self.sequences)
        )
        self.forest = previous.forest if same else RolloutForest.from_sequences(self.sequences)
        unwrapped = acc.unwrap_model(model)
        sharded = any(isinstance(m, FSDPModule) for m in unwrapped.modules())
        syncs = not inside_forward and acc.num_processes > 1  # the wrapper syncs gradients (one process: none)
        # the graphs the engine may keep under this wrapper (planner.graphs.GRAPH_RULES), priced by the plan
        graphs = "last" if sharded else "budget"
        # every rank plans the same step: together, each cuts a share of the candidates (planner/planners.py)
        planners = Planners(acc.process_index, acc.num_processes, lambda obj: gather_object([obj]))
        self.plan = (
            previous.plan
            if same
            else plan(self.forest, world_size=acc.num_processes, graphs=graphs, planners=planners, **plan_options)
        )
        calls = self.plan.unit_counts  # [R] units per rank
        # DDP syncs in each rank's last backward pass, so every rank needs a model call; FSDP2 gathers
        # the parameters in every call (of each sharded module), so every rank needs as many: the
        # engine pads with empty calls.
        needed = int(calls.max()) if sharded else 1
        self.engine = TreeEngine(
            unwrapped,
            self.forest,
            self.plan,
            rank=acc.process_index,
            temperature=temperature,
            forward=None if inside_forward else lambda run: model(harts_call=run),
            no_sync=(lambda: acc.no_sync(model)) if syncs else None,
            calls=needed if acc.num_processes > 1 else 0,
            schedule=previous.engine.schedule if same else None,
        )
        self.grad = torch.is_grad_enabled()
        # A rank's only call keeps its graph with no closing call where its backward runs in this
        # forward's sync context: a block of one microbatch (no accelerate no_sync around it).
        keep_graph = len(self.microbatches) == 1
        routers, stats = None, {}
        with acc.autocast():
            if self.grad or router or statistics:  # a recording: the router logits and statistics come with it
                self._recording = self.engine.record(
                    return_entropy=entropy, keep_graph=keep_graph, return_router_logits=router, statistics=statistics
                )
                values, entropies = self._recording.logprobs, self._recording.entropies
                routers = None if not router else self._recording.router_logits[0].detach()  # [layers, N, E]
                stats = {name: v[0].detach() for name, v in self._recording.statistics.items()}
            else:
                values, entropies = (
                    self.engine.logprobs(return_entropy=True) if entropy else (self.engine.logprobs(), None)
                )
        values = values[0].detach()  # [B, L - 1], 0 where this rank does not own the row
        entropies = None if entropies is None else entropies[0].detach()
        if acc.num_processes > 1:
            values = acc.reduce(values, "sum")
            entropies = None if entropies is None else acc.reduce(entropies, "sum")
            routers = None if routers is None else acc.reduce(routers, "sum")
            stats = {name: acc.reduce(v, "sum") for name, v in stats.items()}
        self.statistics = stats  # per name [B, L - 1], every row, no gradient
        if routers is not None:  # a token the plan computes on several ranks (a shared trunk): their mean
            computed = self.engine.computed_tokens()[0].float()  # [N]
            self._copies = (acc.reduce(computed, "sum") if acc.num_processes > 1 else computed)[:, None]  # [N, 1]
            routers = routers / self._copies
        self.router_logits = None if routers is None else routers.requires_grad_(self.grad)
        self.logprobs = values.requires_grad_(self.grad)  # [B, L - 1]: every row; TRL's losses read it
        self.entropy_grad = entropy_grad and self.grad and entropies is not None
        self.entropies = None if entropies is None else entropies.requires_grad_(self.entropy_grad)
        self.forward_seconds, self.backward_seconds = time.perf_counter() - began, 0.0

    def index(self, inputs: dict) -> int | None:
        """The block's microbatch ``inputs`` is (by identity), None if it is none of them."""
        return next((j for j, batch in enumerate(self.microbatches) if batch is inputs), None)

    def values(
        self, j: int, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Microbatch ``j``'s (log-probs, entropies or None) [b, C] in TRL's completion layout."""
        rows = self._rows[j]
        layout = lambda v: None if v is None else to_completion_layout(v[rows], attention_mask, logits_to_keep)
        return layout(self.logprobs), layout(self.entropies)

    def aux_loss(self, j: int) -> torch.Tensor:
        """Microbatch ``j``'s router loss (:meth:`rows_aux_loss` of its rows)."""
        return self.rows_aux_loss(self._rows[j])

    def rows_aux_loss(self, rows: torch.Tensor) -> torch.Tensor:
        """The router loss of a batch of ``rows`` (indices into the step's rows): the family's own
        function over the step's router logits, each compact token weighted by how many of the rows
        pass through it (stock's padded batch holds that many copies of its routing)."""
        weights = self.forest.multiplicity_of(rows.cpu().numpy())
        layers = tuple(self.router_logits.unbind(0))
        return router_aux_loss(
            self.engine.hf, layers, torch.as_tensor(weights, dtype=torch.float32, device=rows.device)
        )

    def row_index(self, sequences: Sequence[np.ndarray]) -> torch.Tensor | None:
        """The step's rows holding ``sequences`` (a row by its tokens: equal rows have equal values),
        None if one of them is not among the step's rows."""
        found = [self._row_of.get(_key(s)) for s in sequences]
        if any(i is None for i in found):
            return None
        return torch.as_tensor(found, dtype=torch.long, device=self.accelerator.device)

    @functools.cached_property
    def _row_of(self) -> dict[bytes, int]:
        """A row's tokens -> its first index among :attr:`sequences` (built on the first lookup: only
        the fused-head trainers look rows up)."""
        return {_key(row): i for i, row in enumerate(self.sequences)}

    def backward(self) -> None:
        """Backpropagate the gradients the block's losses left on the log-probs, entropies and router
        logits (summed over ranks) through every unit of this rank."""
        began = time.perf_counter()
        grads = [self._summed_grad(self.logprobs)]
        entropy_grads = [self._summed_grad(self.entropies)] if self.entropy_grad else None
        router_grads = None
        if self.router_logits is not None:  # each copy of a token takes its share of the mean's gradient
            router_grads = [self._summed_grad(self.router_logits) / self._copies]
        with self.accelerator.autocast():
            self._recording.backward(grads, entropy_grads, router_grads)
        self.backward_seconds = time.perf_counter() - began

    def _summed_grad(self, leaf: torch.Tensor) -> torch.Tensor:
        """The gradient TRL's losses left on ``leaf``, summed over the ranks (every rank calls)."""
        grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        return self.accelerator.reduce(grad, "sum") if self.accelerator.num_processes > 1 else grad

    def stats(self) -> tuple[float, float, float, float]:
        """This rank's (trajectory tokens it trains, compact tokens it computes, seconds, predicted
        seconds) for the step's metrics."""
        rank = self.accelerator.process_index
        rows = torch.cat(self._rows).cpu().numpy()
        return (
            float(self.forest.lengths[rows].sum()),
            float(self.plan.tokens[rank].sum()),
            self.forward_seconds + self.backward_seconds,
            float(self.plan.rank_seconds[rank]),  # the reruns of the slots that keep no graph included
        )
