"""TreeEngine: one rank's row of a :class:`~harts_hf.planner.Plan`, run on a patched model, exactly.

Each unit (one forest's share of a microbatch slot, compiled once at construction by
:func:`harts_hf.schedule.rank_units`: token ids, tree tables, pairs and handoff addresses, all on
the device) is one packed call of the base model over its own compact tokens; the tokens it needs
from earlier slots (ancestor K/V, conv halos, recurrent states and replay inputs) come through its
:class:`~.handoff.Handoff`, passed down on a per-run view of the unit's tree kwarg. The model run
makes no host transfer (``tests/test_host_transfers.py``).

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
  values), at the price of one extra forward per token;
- a per-token objective (``per_token=True``: a sum of per-token terms with fixed normalisers)
  streams instead: a unit no later unit reads from runs forward, loss and backward at once; only
  units with consumers are recorded first and replayed, in reverse order, after them.
Dropout would make two passes over a unit differ: it must be off.

Legend: B_f trajectories of forest f, L_f its longest trajectory, P_f its pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..forest import RolloutForest
from ..modeling.logprobs import (
    model_head,
    stochastic_parts,
    validate_forest,
    validate_temperature,
)
from ..modeling.registry import patched_adapter
from ..modeling.tables import model_tables, run_base
from ..planner.plan import DEFAULT_MAX_TOKENS, Plan, as_forests
from ..planner.plan import plan as make_plan
from ..schedule import TrajectoryRows, Unit, rank_units
from .handoff import Handoff, Store

__all__ = ["TreeEngine"]

LossFn = Callable[..., torch.Tensor]


def _check_no_dropout(hf: nn.Module) -> None:
    if active := stochastic_parts(hf):
        raise ValueError(
            "the engine reruns microbatches, so dropout and router noise must be off: set the config's "
            f"dropout probabilities and jitter to 0, call model.eval() or pass TRL's disable_dropout=True "
            f"(active: {', '.join(active[:3])})"
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
        validate_temperature(temperature)
        self.hf, self.adapter = patched_adapter(model)
        self.forests = as_forests(forests)
        for forest in self.forests:
            validate_forest(self.hf, forest)
        if plan is None:
            budget = DEFAULT_MAX_TOKENS if max_tokens_per_microbatch is None else max_tokens_per_microbatch
            plan = make_plan(self.forests, world_size=1, max_tokens_per_microbatch=budget)
        if plan.forest_digests != tuple(forest.shape_digest for forest in self.forests):
            raise ValueError(
                "the plan was made for other forests (their shapes differ): plan these forests, "
                "harts_hf.plan(forests, ...), and pass that plan"
            )
        self.plan = plan
        self.rank = rank
        self.temperature = temperature
        self.head = model_head(self.hf, self.adapter, head_chunk_tokens)
        self.device = self.hf.get_output_embeddings().weight.device
        self.units: list[Unit] = rank_units(self.forests, plan, rank, model_tables(self.hf, self.adapter), self.device)
        self.owned = [torch.as_tensor(t == rank, device=self.device) for t in plan.traj_rank]
        # Pairs are numbered in forest order (non-root compact tokens): P_f per forest, and per unit
        # the numbers of the pairs it produces.
        self.num_pairs = [int((f.prev >= 0).sum()) for f in self.forests]
        self._layouts = [TrajectoryRows.of(f, self.device) for f in self.forests]
        self._pair_index = [
            torch.as_tensor(self.forests[u.forest].pair_number[u.pairs], device=self.device) for u in self.units
        ]

    def logprobs(
        self, return_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """No-grad per-trajectory log-probs: per forest [B_f, L_f - 1] in TRL's layout (rows this
        rank does not own are 0); with ``return_entropy`` also the entropies, same layout."""
        with torch.no_grad():
            lp, ent = self._record(Store(), return_entropy)
        lp = self._layout(lp)
        return (lp, self._layout(ent)) if return_entropy else lp

    def attached_logprobs(
        self, return_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`logprobs` attached to the autograd graph: the recording pass runs now, and
        backpropagating any loss through the result replays the units in reverse (as
        :meth:`backward` does), accumulating the parameters' ``.grad``. For callers that own the
        loss and its ``backward()`` (TRL's trainer). Single process only: the replay's nested
        backward passes accumulate gradients outside any DDP reducer. Entropies carry no gradient."""
        _check_no_dropout(self.hf)
        store = Store()
        with torch.no_grad():
            values, ents = self._record(store, return_entropy)
        anchor = next((p for p in self.hf.parameters() if p.requires_grad), None)
        if anchor is not None:  # a frozen model has no graph to attach to (as its own forward)
            values = _Replay.apply(self, store, anchor, *values)
        lp = self._layout(list(values))
        return (lp, self._layout(ents)) if return_entropy else lp

    def backward(self, loss_fn: LossFn, *, per_token: bool = False, return_entropy: bool = False) -> torch.Tensor:
        """Backpropagate ``loss_fn(logprobs)`` (``loss_fn(logprobs, entropies)`` with
        ``return_entropy``; entropies carry no gradient) into the model's parameters, exactly as
        ``loss_fn`` over trajectory-wise log-probs would; gradients accumulate in ``.grad``.

        ``logprobs`` is the list :meth:`logprobs` returns, differentiable; ``loss_fn`` must ignore
        rows this rank does not own. ``per_token=True`` promises that ``loss_fn`` is a sum of
        per-token terms, each depending on its own log-prob only (normalisers fixed in advance,
        as TRL's token-level losses are): units then stream, each applying ``loss_fn`` to its own
        log-probs (the others given as constant zeros), and only units that later units read from
        run twice. Returns the loss, detached.
        """
        _check_no_dropout(self.hf)
        if per_token and return_entropy:
            raise ValueError("per_token streaming sees one unit's entropies at a time: it takes no entropies")
        store = Store()
        if per_token or len(self.units) == 1:
            return self._stream(store, loss_fn, return_entropy)
        return self._replay(store, loss_fn, return_entropy)

    def _stream(self, store: Store, loss_fn: LossFn, entropy: bool) -> torch.Tensor:
        """Units nobody reads from: forward, loss, backward at once; the others: recorded now and
        backpropagated in reverse order once their consumers have sent their gradients."""
        lps, ents, deferred = [None] * len(self.units), [None] * len(self.units), []
        for unit in self.units:
            if unit.exports.size:
                with torch.no_grad():
                    lps[unit.index], ents[unit.index] = self._run(unit, Handoff(store, unit, grad=False), entropy)
                deferred.append(unit)
            else:
                lps[unit.index], ents[unit.index] = self._backprop(store, unit, loss_fn, entropy)
        for unit in reversed(deferred):
            self._backprop(store, unit, loss_fn, False)
        with torch.no_grad():
            return self._apply(loss_fn, self._scatter(lps), self._scatter(ents) if entropy else None)

    def _backprop(
        self, store: Store, unit: Unit, loss_fn: LossFn, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``unit`` with grad and backpropagate ``loss_fn`` of its own log-probs plus the
        gradients its consumers sent; returns its (detached) log-probs and entropies."""
        handoff = Handoff(store, unit, grad=True)
        lp, ent = self._run(unit, handoff, entropy)
        loss = self._apply(loss_fn, self._scatter([lp], [unit]), self._scatter([ent], [unit]) if entropy else None)
        self._send(store, handoff, [loss], [torch.ones_like(loss)])
        return lp.detach(), None if ent is None else ent.detach()

    def _replay(self, store: Store, loss_fn: LossFn, entropy: bool) -> torch.Tensor:
        """Record every unit, apply the loss to whole trajectories, replay units in reverse."""
        with torch.no_grad():
            values, ents = self._record(store, entropy)
        values = [v.requires_grad_(True) for v in values]
        loss = self._apply(loss_fn, values, ents)
        if loss.requires_grad:  # else the loss ignores the log-probs: nothing to backpropagate
            loss.backward()
            self._replay_units(store, [torch.zeros_like(v) if v.grad is None else v.grad for v in values])
        return loss.detach()

    def _replay_units(self, store: Store, grads: list[torch.Tensor]) -> None:
        """Every unit with grad, in reverse, backpropagating ``grads`` (per forest [P_f])."""
        for unit in reversed(self.units):
            handoff = Handoff(store, unit, grad=True)
            lp, _ = self._run(unit, handoff, False)
            self._send(store, handoff, [lp], [grads[unit.forest][self._pair_index[unit.index]]])

    def _send(self, store: Store, handoff: Handoff, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Backpropagate ``tensors`` plus the unit's exports (with their consumers' gradients),
        then hand its context gradients to their producers and drop its records."""
        for key, live in handoff.live.items():
            if key in store.grads:
                tensors.append(live)
                grads.append(store.grads[key])
        live = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        if live:
            torch.autograd.backward(*zip(*live))
        store.add_grads(handoff.leaves)
        store.release(handoff.unit)

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
            torch.where(owned[:, None], layout(v), 0.0) for v, layout, owned in zip(values, self._layouts, self.owned)
        ]

    def _scatter(self, per_unit: list[torch.Tensor], units: list[Unit] | None = None) -> list[torch.Tensor]:
        """Pair values of ``units`` (default all) -> per forest [P_f] (0 for the other pairs)."""
        out = [torch.zeros(n, device=self.device) for n in self.num_pairs]
        for unit, value in zip(units or self.units, per_unit):
            out[unit.forest] = out[unit.forest].index_put((self._pair_index[unit.index],), value.float())
        return out

    def _record(self, store: Store, entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        lps, ents = [], []
        for unit in self.units:
            lp, ent = self._run(unit, Handoff(store, unit, grad=False), entropy)
            lps.append(lp)
            ents.append(ent)
        return self._scatter(lps), self._scatter(ents) if entropy else None

    def _run(self, unit: Unit, handoff: Handoff, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[p] log-probs (and entropies) of the unit's pairs."""
        out = run_base(self.hf, self.adapter, unit.input_ids, unit.batch.with_handoff(handoff))
        hidden = out.last_hidden_state[0]  # [N, H]
        return self.head.pair_values(hidden, unit.pair_rows, unit.targets, self.temperature, entropy)


class _Replay(torch.autograd.Function):
    """Identity on recorded pair values whose backward replays the engine's units (the model's
    parameters receive their gradients there; ``anchor``, one of them, only puts the values on the
    graph)."""

    @staticmethod
    def forward(ctx, engine: TreeEngine, store: Store, anchor: torch.Tensor, *values: torch.Tensor):
        ctx.engine, ctx.store = engine, store
        return tuple(v.clone() for v in values)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        engine = ctx.engine
        if ctx.store is None:
            raise RuntimeError(
                "attached_logprobs replays its units once and then frees their records: call attached_logprobs "
                "again for another backward pass"
            )
        grads = [torch.zeros(n, device=engine.device) if g is None else g for g, n in zip(grads, engine.num_pairs)]
        with torch.enable_grad():
            engine._replay_units(ctx.store, grads)
        ctx.store = None
        return (None, None, None, *[None] * len(grads))
