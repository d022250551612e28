"""TreeEngine: one rank's row of a :class:`~harts_hf.planner.Plan`, run on a patched model, exactly.

Each unit (one forest's share of a microbatch slot, ``units.py``) is one packed call of the base
model over its own compact tokens; the tokens it needs from earlier slots (ancestor K/V, conv
halos, recurrent states and replay inputs) come through its :class:`~.handoff.Handoff`.

Backward policy (bounded, exact for every objective):
- a plan of ONE unit (the forest fits one microbatch) runs forward with grad, applies the loss to
  the log-probs and backpropagates, holding one graph;
- otherwise a recording pass computes every unit once without grad (keeping its boundary values:
  inputs at the rows later units read, states at their chunk-aligned restarts), the loss is
  applied to the complete per-trajectory log-probs (so sequence-level objectives such as GSPO's
  see whole trajectories), and units then rerun with grad in reverse slot order, each
  backpropagating its log-prob gradients plus the boundary gradients its consumers sent, and
  sending its own context gradients to its producers. Every unit is backpropagated once; at most
  one unit's graph is alive, so peak activation memory is one microbatch's (plus the boundary
  values), at the price of one extra forward per token.
Dropout would make the two passes differ: it must be off.

Legend: B_f trajectories of forest f, L_f its longest trajectory, P_f its pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..forest import RolloutForest
from ..modeling.logprobs import model_head, run_base, to_layout, validate_forest
from ..modeling.patch import patched_adapter
from ..planner.plan import DEFAULT_MAX_TOKENS, Plan, as_forests
from ..planner.plan import plan as make_plan
from .handoff import Handoff, Store
from .units import Unit, rank_units

__all__ = ["TreeEngine"]

LossFn = Callable[..., torch.Tensor]


def _check_no_dropout(hf: nn.Module) -> None:
    if not hf.training:
        return
    active = [n for n, m in hf.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if active or getattr(hf.config, "attention_dropout", 0.0):
        raise ValueError(
            "the engine reruns microbatches, so dropout must be off: set the config's dropout "
            f"probabilities to 0 or call model.eval() (active: {active[:3] or ['attention_dropout']})"
        )


class TreeEngine:
    """Runs ``rank``'s slots of ``plan`` over ``forests`` on a patched ``model`` (module docstring).

    Args:
        model: a model patched with :func:`harts_hf.patch_model` (unwrapped: no DDP/FSDP wrapper;
            data-parallel callers reduce the gradients themselves).
        forests: the forests ``plan`` was made for (one, or one per group).
        plan: the plan; None plans one rank under ``max_tokens_per_microbatch``.
        rank: the row of the plan this process runs.
        max_tokens_per_microbatch: the budget when ``plan`` is None (default
            :data:`~harts_hf.planner.DEFAULT_MAX_TOKENS`).
        temperature: divides the logits before the log-softmax (as TRL does).
        head_chunk_tokens: pairs per checkpointed LM-head chunk (default: 64 MiB of logits).
    """

    def __init__(
        self,
        model: nn.Module,
        forests: RolloutForest | Sequence[RolloutForest],
        plan: Plan | None = None,
        *,
        rank: int = 0,
        max_tokens_per_microbatch: int | None = None,
        temperature: float = 1.0,
        head_chunk_tokens: int | None = None,
    ):
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.hf, self.adapter = patched_adapter(model)
        self.forests = as_forests(forests)
        for forest in self.forests:
            validate_forest(self.hf, forest)
        if plan is None:
            budget = max_tokens_per_microbatch or DEFAULT_MAX_TOKENS
            plan = make_plan(self.forests, world_size=1, max_tokens_per_microbatch=budget)
        if len(plan.traj_rank) != len(self.forests) or [t.size for t in plan.traj_rank] != [
            f.num_trajectories for f in self.forests
        ]:
            raise ValueError("the plan was made for other forests (trajectory counts differ)")
        self.plan = plan
        self.rank = rank
        self.temperature = temperature
        self.head = model_head(self.hf, self.adapter, head_chunk_tokens)
        self.device = self.hf.get_output_embeddings().weight.device
        self.units: list[Unit] = rank_units(self.forests, plan, rank, self.device)
        self.owned = [torch.as_tensor(t == rank, device=self.device) for t in plan.traj_rank]
        self._pair_of = []  # per forest: [num compact tokens] pair number of each target token
        for forest in self.forests:
            pair_of = np.full(forest.num_compact_tokens, -1, dtype=np.int64)
            pairs = np.flatnonzero(forest.prev >= 0)
            pair_of[pairs] = np.arange(pairs.size)
            self._pair_of.append(pair_of)
        self._handoff: Handoff | None = None

    @property
    def num_pairs(self) -> list[int]:
        return [int((f.prev >= 0).sum()) for f in self.forests]

    def logprobs(
        self, return_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """No-grad per-trajectory log-probs: per forest [B_f, L_f - 1] in TRL's layout (rows this
        rank does not own are 0); with ``return_entropy`` also the entropies, same layout."""
        with torch.no_grad():
            lp, ent = self._record(Store(self.forests, self.units), return_entropy)
        lp = self._layout(lp)
        return (lp, self._layout(ent)) if return_entropy else lp

    def backward(self, loss_fn: LossFn, *, return_entropy: bool = False) -> torch.Tensor:
        """Backpropagate ``loss_fn(logprobs)`` (``loss_fn(logprobs, entropies)`` with
        ``return_entropy``; entropies carry no gradient) into the model's parameters, exactly as
        ``loss_fn`` over trajectory-wise log-probs would; gradients accumulate in ``.grad``.

        ``logprobs`` is the list :meth:`logprobs` returns, differentiable; ``loss_fn`` must ignore
        rows this rank does not own. Returns the loss, detached.
        """
        _check_no_dropout(self.hf)
        if len(self.units) == 1:
            with self._hooks():
                lp, ent = self._run(
                    self.units[0],
                    Handoff(Store(self.forests, self.units), self.units[0], grad=True),
                    return_entropy,
                )
                values, ents = (
                    self._scatter([lp]),
                    self._scatter([ent]) if return_entropy else None,
                )
                loss = self._apply(loss_fn, values, ents)
                loss.backward()
            return loss.detach()
        store = Store(self.forests, self.units)
        with torch.no_grad():
            values, ents = self._record(store, return_entropy)
        values = [v.requires_grad_(True) for v in values]
        loss = self._apply(loss_fn, values, ents)
        loss.backward()
        with self._hooks():
            for unit in reversed(self.units):
                handoff = Handoff(store, unit, grad=True)
                lp, _ = self._run(unit, handoff, False)
                grad = values[unit.forest].grad[
                    torch.as_tensor(self._pair_of[unit.forest][unit.pairs], device=self.device)
                ]
                tensors, grads = [lp], [grad]
                for key, live in handoff.live.items():
                    if key in store.grads:
                        tensors.append(live)
                        grads.append(store.grads[key])
                live = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
                if live:
                    torch.autograd.backward(*zip(*live))
                store.add_grads(handoff.leaves)
                store.release(unit)
        return loss.detach()

    def _apply(
        self,
        loss_fn: LossFn,
        values: list[torch.Tensor],
        ents: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        lp = self._layout(values)
        loss = loss_fn(lp) if ents is None else loss_fn(lp, [e.detach() for e in self._layout(ents)])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor")
        return loss

    def _layout(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        return [
            torch.where(owned[:, None], to_layout(v, forest), 0.0)
            for v, forest, owned in zip(values, self.forests, self.owned)
        ]

    def _scatter(self, per_unit: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-unit pair values -> per forest [P_f] (0 for pairs computed on other ranks)."""
        out = [torch.zeros(n, device=self.device) for n in self.num_pairs]
        for unit, value in zip(self.units, per_unit):
            index = torch.as_tensor(self._pair_of[unit.forest][unit.pairs], device=self.device)
            out[unit.forest] = out[unit.forest].index_put((index,), value.float())
        return out

    def _record(self, store: Store, entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        lps, ents = [], []
        with self._hooks():
            for unit in self.units:
                lp, ent = self._run(unit, Handoff(store, unit, grad=False), entropy)
                lps.append(lp)
                ents.append(ent)
        return self._scatter(lps), self._scatter(ents) if entropy else None

    def _run(self, unit: Unit, handoff: Handoff, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[p] log-probs (and entropies) of the unit's pairs."""
        self._handoff = unit.batch.handoff = handoff
        out = run_base(
            self.hf,
            self.adapter,
            self.forests[unit.forest].tokens[unit.tokens],
            unit.batch,
        )
        hidden = out.last_hidden_state[0]  # [N, H]
        targets = torch.as_tensor(self.forests[unit.forest].tokens[unit.pairs], device=self.device)
        return self.head.pair_values(hidden, unit.pair_rows, targets, self.temperature, entropy)

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        """Pre-hooks on every base-model module naming each tree call after the module that ran
        last before it; checkpoint recomputation reruns the same modules, so it finds the same names."""

        def enter(name: str) -> Callable:
            return lambda module, args: self._handoff.enter(name) if self._handoff is not None else None

        handles = [m.register_forward_pre_hook(enter(n)) for n, m in self.hf.base_model.named_modules()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for unit in self.units:
                unit.batch.handoff = None
            self._handoff = None
