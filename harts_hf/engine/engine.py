"""TreeEngine: one rank's row of a :class:`~harts_hf.planner.Plan`, run on a patched model, exactly.

The engine runs a :class:`~harts_hf.schedule.Schedule`, compiled once at construction. Each of its
units (one forest's share of a microbatch slot: token ids, tree tables, pairs and handoff
addresses, all on the device) is one packed call of the base model over its own compact tokens;
the tokens it needs from earlier slots (ancestor K/V, conv halos, recurrent states and replay
inputs) come through its :class:`~.handoff.Handoff`, passed down on a per-run view of the unit's
tree kwarg. The model run makes no host transfer (``tests/test_host_transfers.py``).

Backward (one path, bounded, exact for every objective): a recording pass computes every model
call once, keeping its boundary values (inputs at the rows later units read, states at their
chunk-aligned restarts); the last calls run with grad and keep their graphs, as many as the plan's
byte budget holds alive together (``Schedule.graph_calls``; the last always), and so do those the
plan keeps in host memory (``Schedule.host_calls``, their saved tensors there: :mod:`.offload`);
the others run without grad. The loss is applied to the complete per-trajectory log-probs (so sequence-level
objectives such as GSPO's see whole trajectories); its gradients w.r.t. them then flow back
through the calls in reverse call order: the kept calls first, from their graphs, then every
other unit rerun with grad, each backpropagating its log-prob gradients plus the boundary
gradients its consumers sent and sending its own context gradients to its producers. Every unit is
backpropagated once; the graphs alive at once fit the budget (one microbatch's where it holds no
more), at the price of one extra forward per token of every unit that did not keep its graph.
:meth:`TreeEngine.backward` (a loss function), :meth:`Recording.backward` (gradients a caller
gathered: the trainer's HARTS step) and :meth:`Recording.attached` (an autograd graph) are three
doors to that one path.
Dropout would make two passes over a unit differ: it must be off.

Between ranks: a unit may read its context from a unit of another rank in an earlier slot: the
producer's rank sends the rows after its call and the reader's rank receives them at the same call
index (calls align by slot), and the replay sends their gradients back after the reader's rerun
(:mod:`.exchange`; point to point over the default process group, whose ranks are the plan's).
Spans of one slot on several ranks (a context-parallel group, at the same call) stream their
handoffs layer call by layer call inside the call, and their gradients inside its backward
(:mod:`.stream`).
A pair whose predictor another rank computes is computed there, so the pair values, and their
gradients, are then summed over ranks (each pair on one home rank) at the end of the recording and
the start of the replay. Plans without cross-rank handoffs exchange nothing: ranks share only
gradients, through the wrapper.

Data parallel: each unit's model call can run as the forward of the wrapper the caller trains
(``forward``), so DDP / FSDP2 see ordinary forward and backward passes, and every backward pass but
the last runs inside ``no_sync`` (accelerate's ``accelerator.no_sync(model)``): the step's
gradients are synchronised once, by the wrapper, in its last backward pass. A kept call runs its
forward in its backward's context. Where call 0 keeps its graph too (DDP), every call runs inside
``no_sync`` (a forward outside it would make the next backward pass sync) and a closing sync call
follows: a forward of the wrapper, outside ``no_sync``, of every parameter times 0, in whose
backward the wrapper syncs the gradients the step accumulated (every parameter takes part, no model
compute), where call 0 was rerun before. Under FSDP2 call 0 is still rerun (its parameter groups
allow one pending forward with grad before a backward).

Legend: B_f trajectories of forest f, L_f its longest trajectory, P_f its pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..forest import RolloutForest
from ..modeling.logprobs import (
    model_head,
    run_unit,
    stochastic_parts,
    validate_forest,
    validate_router_logits,
    validate_temperature,
)
from ..modeling.registry import patched_adapter
from ..modeling.tables import model_tables
from ..ops.precision import AutocastState
from ..planner.memory import MemoryModel
from ..planner.plan import DEFAULT_MAX_TOKENS, Plan, as_forests
from ..planner.plan import plan as make_plan
from ..schedule import Schedule, Unit
from .exchange import Exchanger
from .handoff import Handoff
from .offload import HostCall, HostGraphs
from .store import Store

__all__ = ["Recording", "TreeEngine"]

LossFn = Callable[..., torch.Tensor]
Forward = Callable[[Callable[[], Any]], Any]  # runs a closure as the (wrapped) model's forward


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
        model: a model patched with :func:`harts_hf.patch_model` (unwrapped: no DDP/FSDP wrapper).
        forests: the forests ``plan`` was made for (one, or one per group).
        plan: the plan; None plans one rank under ``max_tokens_per_microbatch`` or
            ``max_bytes_per_microbatch``, context priced by ``memory_model``.
        rank: the row of the plan this process runs.
        max_tokens_per_microbatch: the budget when ``plan`` is None (default
            :data:`~harts_hf.planner.DEFAULT_MAX_TOKENS`): the memory of that many own tokens.
        max_bytes_per_microbatch: the budget in bytes instead (``plan`` None).
        memory_model: what a microbatch holds (``plan`` None; default
            :data:`~harts_hf.planner.TOKEN_MEMORY`, context at an own token's price): pass the
            model's, ``harts_hf.engine.memory_model(model)``, to cut trajectories longer than the budget.
        temperature: divides the logits before the log-softmax (as TRL does).
        head_chunk_tokens: pairs per checkpointed LM-head chunk (default: 16 MiB of logits).
        forward: runs a closure as the forward of the wrapper being trained, e.g.
            ``lambda run: wrapped(harts_call=run)`` (``harts_hf.trainers``); None calls ``model``.
        no_sync: a context in which backward passes skip the wrapper's gradient sync (e.g.
            ``lambda: accelerator.no_sync(wrapped)``): every backward pass but the last runs in it.
        calls: the model calls every pass makes, at least: a rank with fewer units runs padding
            calls (a two-token chain whose gradient is zero) after its units (and, where the plan
            hands context between ranks, inside slots, so that every slot starts at one call), so that a wrapper
            whose every call is collective (FSDP2 gathers the parameters in each, DDP syncs in the
            last) sees as many on every rank.
        schedule: an earlier engine's :class:`~harts_hf.schedule.Schedule`, reused where it is
            ``rank``'s of this ``plan`` and serves this model (the same tables, calls and device);
            compiled afresh otherwise.

    ``exchanged_bytes``: the bytes of cross-rank handoffs this rank has sent ("values" in the
    recordings, "grads" in the replays), summed over its passes (0 for a plan without them).
    """

    def __init__(
        self,
        model: nn.Module,
        forests: RolloutForest | Sequence[RolloutForest],
        plan: Plan | None = None,
        *,
        rank: int = 0,
        max_tokens_per_microbatch: int | None = None,
        max_bytes_per_microbatch: float | None = None,
        memory_model: MemoryModel | None = None,
        temperature: float = 1.0,
        head_chunk_tokens: int | None = None,
        forward: Forward | None = None,
        no_sync: Callable[[], AbstractContextManager] | None = None,
        calls: int = 0,
        schedule: Schedule | None = None,
    ):
        validate_temperature(temperature)
        self.hf, self.adapter = patched_adapter(model)
        self.forests = as_forests(forests)
        for forest in self.forests:
            validate_forest(self.hf, forest)
        if plan is None:
            if max_bytes_per_microbatch is None and max_tokens_per_microbatch is None:
                max_tokens_per_microbatch = DEFAULT_MAX_TOKENS
            plan = make_plan(
                self.forests,
                world_size=1,
                max_tokens_per_microbatch=max_tokens_per_microbatch,
                max_bytes_per_microbatch=max_bytes_per_microbatch,
                memory_model=memory_model,
            )
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
        self._forward: Forward = forward or (lambda run: run())
        self._no_sync = no_sync
        tables = model_tables(self.hf, self.adapter)
        if schedule is None or not schedule.serves(plan, rank, tables, calls, self.device):
            schedule = Schedule.compile(self.forests, plan, rank, tables, self.device, calls)
        self.schedule = schedule
        self.exchanged_bytes = {"values": 0, "grads": 0}  # cross-rank handoffs sent (class docstring)
        self.host = HostGraphs(self.device)  # graphs the plan keeps in host memory (offload.py)
        self._joined = False  # whether this engine's ranks met once (_exchanger)

    @property
    def units(self) -> tuple[Unit, ...]:
        """The rank's model calls (its schedule's units)."""
        return self.schedule.units

    @property
    def calls(self) -> int:
        """Model calls per pass, padding included."""
        return self.schedule.calls

    @property
    def owned(self) -> tuple[torch.Tensor, ...]:
        """Per forest [B_f] bool: the trajectories whose loss this rank computes."""
        return self.schedule.owned

    def computed_tokens(self) -> list[torch.Tensor]:
        """Per forest [N_f] bool: the compact tokens this rank's units compute (a shared trunk may be
        computed on several ranks)."""
        out = [torch.zeros(f.num_compact_tokens, dtype=torch.bool, device=self.device) for f in self.forests]
        for unit, tokens in zip(self.units, self.schedule.token_index):
            out[unit.forest][tokens] = True
        return out

    def logprobs(
        self, return_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """No-grad per-trajectory log-probs: per forest [B_f, L_f - 1] in TRL's layout (rows this
        rank does not own are 0); with ``return_entropy`` also the entropies, same layout."""
        with torch.no_grad():
            lp, ent, *_ = self._record(Store(), return_entropy)
        lp = self._as_rows(lp)
        return (lp, self._as_rows(ent)) if return_entropy else lp

    def record(
        self,
        return_entropy: bool = False,
        *,
        keep_graph: bool = False,
        return_router_logits: bool = False,
        statistics: tuple[str, ...] = (),
    ) -> Recording:
        """The recording pass alone: the :class:`Recording` of every unit, whose values are
        :meth:`logprobs`' and whose :meth:`Recording.backward` backpropagates gradients w.r.t. them
        through the units later (a caller that owns the loss and gathers its gradients first: the
        trainer's HARTS step). Made with grad enabled, the last model calls (as many as the plan's
        budget holds, the last always) run with grad and keep their graphs for that backward instead
        of being replayed, each in its backward pass's sync context; with ``no_sync``, where call 0
        keeps its graph, all of them inside ``no_sync`` and a closing sync call ends the backward
        (under FSDP2 call 0 is rerun). ``keep_graph``: the caller's context is the gradient-sync
        context of the backward, so a rank's only call keeps its graph there, with no closing call.
        ``return_router_logits``: also the MoE layers' router logits of every compact token this
        rank computes (for the router loss), differentiable through the same backward.
        ``statistics``: also these per-token head statistics (``logprobs.PAIR_STATISTICS`` other
        than the entropy; no gradient), :attr:`Recording.statistics`."""
        _check_no_dropout(self.hf)
        if return_router_logits:
            validate_router_logits(self.adapter)
        store = Store()
        keep, host, closing = self._graph_calls(keep_graph)
        values, ents, routers, stats, kept = self._record(
            store, return_entropy, return_router_logits, statistics, keep=keep, host=host, closing=closing
        )
        return Recording(self, store, values, ents, routers, stats, kept, closing)

    def attached_logprobs(
        self, return_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`logprobs` attached to the autograd graph (:meth:`Recording.attached` of a recording
        made now); entropies carry no gradient."""
        recording = self.record(return_entropy)
        lp = recording.attached()
        return (lp, recording.entropies) if return_entropy else lp

    def backward(self, loss_fn: LossFn, *, return_entropy: bool = False) -> torch.Tensor:
        """Backpropagate ``loss_fn(logprobs)`` (``loss_fn(logprobs, entropies)`` with
        ``return_entropy``; entropies carry no gradient) into the model's parameters, exactly as
        ``loss_fn`` over trajectory-wise log-probs would; gradients accumulate in ``.grad``.

        ``logprobs`` is the list :meth:`logprobs` returns, differentiable; ``loss_fn`` must ignore
        rows this rank does not own. It is the engine's one backward path, for a caller that owns the
        loss: :meth:`record` (the last call keeps its graph), the loss over whole trajectories, then
        :meth:`Recording.backward` with its gradients. Returns the loss, detached.
        """
        recording = self.record(return_entropy, keep_graph=True)
        lp = [v.requires_grad_() for v in recording.logprobs]
        loss = loss_fn(lp) if not return_entropy else loss_fn(lp, recording.entropies)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor")
        if loss.requires_grad:  # else the loss ignores the log-probs: nothing to backpropagate
            grads = torch.autograd.grad(loss, lp, allow_unused=True)
            recording.backward([torch.zeros_like(v) if g is None else g for g, v in zip(grads, lp)])
        return loss.detach()

    def _graph_calls(self, keep_graph: bool) -> tuple[int, frozenset[int], bool]:
        """How many of the last calls keep their graphs in a recording made now, which earlier calls
        keep theirs in host memory, and whether a closing sync call ends its backward: the calls of
        the slots the plan keeps (``Plan.graph_slots`` and ``Plan.host_graphs``, by
        ``Schedule.graph_calls`` and ``Schedule.host_calls``), none without grad. Under a
        data-parallel wrapper (``no_sync``) call 0's backward is the last and syncs; where call 0
        keeps its graph, its forward (which decides a DDP backward's sync) runs inside ``no_sync``
        as every other, and the closing sync call syncs instead (:meth:`_sync_call`), unless it is
        the rank's only call and ``keep_graph`` says the caller's context is the sync context.
        Under FSDP2 only the last call keeps its graph, whatever the plan says: its parameter
        groups allow one pending forward with grad before a backward (a second trips their
        ``pre_backward`` state check), so call 0 is rerun there (a plan made with ``graphs=`` for
        the wrapper prices what each does: ``planner.graphs.GRAPH_RULES``)."""
        if not torch.is_grad_enabled():
            return 0, frozenset(), False
        sharded = isinstance(self.hf, FSDPModule)
        keep = min(self.schedule.graph_calls(), 1) if sharded else self.schedule.graph_calls()
        host = frozenset() if sharded else self.schedule.host_calls()
        first = keep == self.calls or 0 in host  # call 0 keeps its graph
        every = first and self._no_sync is not None and not (keep_graph and self.calls == 1)
        if every and sharded:
            return keep - 1, host, False
        return keep, host, every

    def _replay_units(
        self,
        store: Store,
        grads: list[torch.Tensor],
        entropy_grads: list[torch.Tensor] | None = None,
        router_grads: list[torch.Tensor] | None = None,
        *,
        kept: dict[int, _GradRun] | None = None,
        closing: bool = False,
    ) -> None:
        """Every model call with grad, in reverse, backpropagating ``grads`` (per forest [P_f]) and,
        given, ``entropy_grads`` (the same, w.r.t. the pairs' entropies) and ``router_grads`` (per
        forest [layers, N_f, E], w.r.t. the router logits); the ``kept`` calls (by call index) from
        their graphs, the others rerun; then, ``closing``, the sync call."""
        entropy, router = entropy_grads is not None, router_grads is not None
        exchanger = self._exchanger()
        calls, kept = self.schedule.call_order(), kept or {}
        for done, unit in enumerate(reversed(calls)):  # the exact reverse of the recording's order
            index, padding = len(calls) - 1 - done, unit is self.schedule.padding
            with self._sync_last(done, closing):
                if index in kept:
                    run = kept.pop(index)  # its graph goes with its backward
                else:  # a padding call records nothing any unit reads
                    streams = None if padding or exchanger is None else exchanger.streams
                    handoff = Handoff(Store() if padding else store, unit, grad=True, streams=streams)
                    self._gather(index)
                    outputs = self._run(unit, handoff, entropy and not padding, router and not padding)
                    run = _GradRun(handoff, outputs[:3])
                self._gather(index)  # again for its backward: its forward freed each layer's after use
                if run.host is not None:
                    run.host.fetch()
                if padding:
                    torch.autograd.backward(run.outputs[0], torch.zeros_like(run.outputs[0]))
                else:
                    self._send_unit(store, run, grads, entropy_grads, router_grads)
            if exchanger is not None:
                exchanger.after_replay(index, store)
        if closing:
            self._sync_call()

    def _sync_call(self) -> None:
        """The closing sync call, outside ``no_sync``: a forward of the wrapper that returns every
        trainable parameter's first element times 0, then its backward, so the wrapper syncs there
        the gradients every earlier backward pass accumulated (every parameter takes part and gains
        an exact 0; no model compute)."""
        params = [p for p in self.hf.parameters() if p.requires_grad]
        if params:
            zero = self._forward(lambda: torch.stack([p.reshape(-1)[:1].float().sum() for p in params]).sum() * 0)
            zero.backward()

    def _gather(self, index: int) -> None:
        """Under FSDP2, before call ``index`` of a pass where a context-parallel group streams, gather
        every parameter at once, on every rank at the same point (``Exchange.group_calls``): FSDP2
        gathers a layer's parameters when the layer starts (forward and backward), a collective every
        rank must join, which inside a group's wavefront (the readers a layer behind) would hold each
        rank at every layer until the others arrive. Gathered, those gathers find nothing to do and the
        layers free their parameters after use as usual; only the last backward's gradient
        reduce-scatter still meets at each layer. The price: all parameters held whole at the call's
        start (the memory FSDP2 saves, for the call's duration)."""
        if isinstance(self.hf, FSDPModule) and index in self.schedule.exchange.group_calls:
            for module in self.hf.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()

    def _exchanger(self) -> Exchanger | None:
        """What moves this pass's cross-rank handoffs (None: the plan has none). Every rank of a plan
        with them makes one, at the same points (it also checks the process group)."""
        if self.schedule.pair_home is None:
            return None
        exchanger = Exchanger(self.schedule, self.hf, self.device, self.exchanged_bytes)
        if not self._joined:  # NCCL: a group's first communication must involve all its ranks, not a pair
            dist.barrier()
            self._joined = True
        return exchanger

    def _send_unit(
        self,
        store: Store,
        run: _GradRun,
        grads: list[torch.Tensor],
        entropy_grads: list[torch.Tensor] | None,
        router_grads: list[torch.Tensor] | None,
    ) -> None:
        """Backpropagate a unit's run: its outputs with their shares of the pass's gradients."""
        unit = run.handoff.unit
        lp, ent, logits = run.outputs
        pairs = self.schedule.pair_index[unit.index]
        tensors, unit_grads = [lp], [grads[unit.forest][pairs]]
        if entropy_grads is not None:
            tensors.append(ent)
            unit_grads.append(entropy_grads[unit.forest][pairs])
        if router_grads is not None:
            tensors.append(logits)
            unit_grads.append(router_grads[unit.forest][:, self.schedule.token_index[unit.index]].to(logits.dtype))
        self._send(store, run.handoff, tensors, unit_grads)

    def _sync_last(self, done: int, closing: bool = False) -> AbstractContextManager:
        """``no_sync`` for every backward pass of a step but the last (``done`` passes so far), and
        for the last too where a ``closing`` sync call follows it."""
        last = done == self.calls - 1 and not closing
        return contextlib.nullcontext() if self._no_sync is None or last else self._no_sync()

    def _send(self, store: Store, handoff: Handoff, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Backpropagate ``tensors`` plus the unit's exports (with their consumers' gradients),
        then hand its context gradients to their producers and drop its records."""
        for key, live in handoff.live.items():
            if key in store.grads:
                tensors.append(live)
                grads.append(store.grads[key])
        for marker in handoff.markers.values():  # its group's gradients, received as the backward reaches them
            tensors.append(marker)
            grads.append(torch.ones_like(marker))
        live = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        handoff.start_backward()
        if live:
            torch.autograd.backward(*zip(*live))
        store.add_grads(handoff.leaves)
        handoff.finish()
        store.release(handoff.unit.number)

    def _as_rows(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per forest [P_f] pair values -> TRL's [B_f, L_f - 1] rows, 0 in the rows other ranks own."""
        return [
            torch.where(owned[:, None], layout(v), 0.0)
            for v, layout, owned in zip(values, self.schedule.rows, self.owned)
        ]

    def _scatter(self, per_unit: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pair values of every unit -> per forest [P_f] (0 for the pairs other ranks compute)."""
        out = [torch.zeros(n, device=self.device) for n in self.schedule.num_pairs]
        for unit, value in zip(self.units, per_unit):
            out[unit.forest] = out[unit.forest].index_put((self.schedule.pair_index[unit.index],), value.float())
        return out

    def _share(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per forest [P_f] pair values of this rank -> every rank's, where the plan hands context
        between ranks (a trajectory's pairs then run on several ranks: each pair counted on its home
        rank, summed over ranks); as they are otherwise. Every rank calls it at the same point."""
        if self.schedule.pair_home is None:
            return values
        return self._all_reduce([torch.where(home, v, 0.0) for v, home in zip(values, self.schedule.pair_home)])

    def _share_grads(self, grads: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """The adjoint of :meth:`_share`: per forest [P_f] gradients w.r.t. the shared pair values
        (this rank's rows') -> summed over ranks, on the home pairs of this rank (0 elsewhere)."""
        if self.schedule.pair_home is None or grads is None:
            return grads
        return [torch.where(home, g, 0.0) for g, home in zip(self._all_reduce(grads), self.schedule.pair_home)]

    @staticmethod
    def _all_reduce(values: list[torch.Tensor]) -> list[torch.Tensor]:
        out = [v.clone() for v in values]
        for v in out:
            dist.all_reduce(v)
        return out

    def _scatter_tokens(self, per_unit: list[torch.Tensor], like: torch.Tensor) -> list[torch.Tensor]:
        """Router logits [layers, n, E] of every unit -> per forest [layers, N_f, E] (0 for the tokens
        other ranks compute; ``like``: a unit's or padding call's, for the shape)."""
        layers, _, experts = like.shape
        out = [like.new_zeros(layers, f.num_compact_tokens, experts) for f in self.forests]
        for unit, value in zip(self.units, per_unit):
            out[unit.forest] = out[unit.forest].index_copy(1, self.schedule.token_index[unit.index], value)
        return out

    def _record(
        self,
        store: Store,
        entropy: bool,
        router: bool = False,
        statistics: tuple[str, ...] = (),
        *,
        keep: int = 0,
        host: frozenset[int] = frozenset(),
        closing: bool = False,
    ) -> tuple[
        list[torch.Tensor],
        list[torch.Tensor] | None,
        list[torch.Tensor] | None,
        dict[str, list[torch.Tensor]],
        dict[int, _GradRun],
    ]:
        """Every model call of the rank (its units, then its padding calls) without grad, but the last
        ``keep`` and the ``host`` calls (their saved tensors in host memory: :mod:`.offload`), which
        run with grad, each in the sync context of its backward pass in the replay (``closing``: a
        sync call follows them all), and are returned with their graphs, by call index; the values
        come detached."""
        calls = self.schedule.call_order()
        exchanger = self._exchanger()
        lps, ents, routers, stats, kept, like = [], [], [], [], {}, None
        for i, unit in enumerate(calls):
            grad = i >= len(calls) - keep or i in host
            padding = unit is self.schedule.padding
            self._gather(i)
            with (
                torch.set_grad_enabled(grad),
                self._sync_last(len(calls) - 1 - i, closing) if grad else contextlib.nullcontext(),
                self.host.saving() if i in host else contextlib.nullcontext() as saved,
            ):
                streams = None if padding or exchanger is None else exchanger.streams
                handoff = Handoff(Store() if padding else store, unit, grad=grad, recording=True, streams=streams)
                wanted = () if padding else statistics
                lp, ent, logits, values = self._run(unit, handoff, entropy and not padding, router, wanted)
            if exchanger is not None:
                exchanger.after_record(i, store)
            if grad:
                kept[i] = _GradRun(handoff, (lp, ent, logits), saved)
            like = like if like is not None or logits is None else logits.detach()  # any call's: the shape only
            if padding:
                continue
            routers.append(None if logits is None else logits.detach())
            lps.append(lp.detach())
            ents.append(None if ent is None else ent.detach())
            stats.append({name: value.detach() for name, value in values.items()})
        values, ents = self._share(self._scatter(lps)), self._share(self._scatter(ents)) if entropy else None
        per_name = {name: self._share(self._scatter([v[name] for v in stats])) for name in statistics}
        return values, ents, self._scatter_tokens(routers, like) if router else None, per_name, kept

    def _run(
        self, unit: Unit, handoff: Handoff, entropy: bool, router: bool = False, statistics: tuple[str, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
        """[p] log-probs (and entropies) of the unit's pairs, the LM head inside the forward (a DDP
        wrapper that looks for unused parameters walks back from what its forward returns), with
        ``router`` the MoE layers' router logits of its own tokens [layers, n, E], and the [p] head
        ``statistics`` (``logprobs.PAIR_STATISTICS`` other than the entropy) by name."""
        batch = unit.batch.with_handoff(handoff)
        wanted = ("entropy",) * entropy + statistics

        def run() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
            lp, stats, routers = run_unit(
                self.hf, self.adapter, self.head, unit, batch, self.temperature, wanted, router
            )
            return lp, stats.pop("entropy", None), None if routers is None else torch.stack(routers), stats

        return self._forward(run)


class _GradRun(NamedTuple):
    """One run of a model call with grad: its handoff and (log-probs, entropies, router logits),
    the graph alive until its backward (its saved tensors in host memory where ``host`` holds them)."""

    handoff: Handoff
    outputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    host: HostCall | None = None


class Recording:
    """The recorded units of one pass (:meth:`TreeEngine.record`): ``logprobs`` (and
    ``entropies``, None unless asked) per forest [B_f, L_f - 1] in TRL's layout (rows this rank
    does not own are 0), ``router_logits`` (None unless asked) per forest [layers, N_f, E] (0 for the
    tokens other ranks compute), ``statistics`` (the head statistics asked for, by name, in the
    log-probs' layout), the boundary values the replay reads (``store``), the runs of the last
    calls that kept their graphs (``kept``, by call index; empty if none did) and whether a closing
    sync call ends the backward (``closing``: :meth:`TreeEngine._graph_calls`)."""

    def __init__(
        self,
        engine: TreeEngine,
        store: Store,
        values: list[torch.Tensor],
        ents: list[torch.Tensor] | None,
        router_logits: list[torch.Tensor] | None = None,
        statistics: dict[str, list[torch.Tensor]] | None = None,
        kept: dict[int, _GradRun] | None = None,
        closing: bool = False,
    ):
        self.engine, self._store, self._kept, self._closing, self._pending = engine, store, kept, closing, True
        self._autocast = AutocastState.current(engine.device)  # the replay runs the units under it again
        self.values = values  # per forest [P_f] pair values
        self.router_logits = router_logits
        self.logprobs = engine._as_rows(values)
        self.entropies = None if ents is None else engine._as_rows(ents)
        self.statistics = {name: engine._as_rows(v) for name, v in (statistics or {}).items()}

    def attached(self) -> list[torch.Tensor]:
        """:attr:`logprobs` attached to the autograd graph: backpropagating any loss through them
        replays the units in reverse (as :meth:`backward` does), accumulating the parameters'
        ``.grad``. For callers that own the loss and its ``backward()``, in one process (the replay
        runs inside that backward pass, where a data-parallel wrapper cannot sync: use
        :meth:`backward` there)."""
        values = self.values
        anchor = next((p for p in self.engine.hf.parameters() if p.requires_grad), None)
        if anchor is not None:  # a frozen model has no graph to attach to (as its own forward)
            values = _Replay.apply(self, anchor, *values)
        return self.engine._as_rows(list(values))

    @property
    def boundary_bytes(self) -> int:
        """Bytes of the boundary values kept for the replay (what later units read as context)."""
        return sum(self.boundary_bytes_by_call().values())

    def boundary_bytes_by_call(self) -> dict[Hashable, int]:
        """:attr:`boundary_bytes` by layer call, named ``(module, kind, n)`` (``harts_hf.engine.handoff``)."""
        out: dict[Hashable, int] = {}
        for (_, call, _), value in ({} if self._store is None else self._store.values).items():
            out[call] = out.get(call, 0) + value.nbytes
        return out

    def backward(
        self,
        grads: list[torch.Tensor],
        entropy_grads: list[torch.Tensor] | None = None,
        router_grads: list[torch.Tensor] | None = None,
    ) -> None:
        """Backpropagate ``grads`` (per forest [B_f, L_f - 1], w.r.t. ``logprobs``; rows this rank
        does not own are ignored) and, given, ``entropy_grads`` (the same, w.r.t. ``entropies``) and
        ``router_grads`` (w.r.t. ``router_logits``; tokens this rank does not compute are ignored)
        through every unit, in reverse slot order, once."""
        to_pairs = lambda row_grads: self._pair_grads(row_grads) if row_grads is not None else None
        self.backward_pairs(to_pairs(grads), to_pairs(entropy_grads), router_grads)

    def _pair_grads(self, row_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients w.r.t. the rows -> w.r.t. the pair values (each forest's rows' adjoint)."""
        schedule = self.engine.schedule
        return [
            rows.pair_grads(g.to(v.dtype), v.numel(), owned)
            for g, v, rows, owned in zip(row_grads, self.values, schedule.rows, schedule.owned)
        ]

    def backward_pairs(
        self,
        grads: list[torch.Tensor],
        entropy_grads: list[torch.Tensor] | None = None,
        router_grads: list[torch.Tensor] | None = None,
    ) -> None:
        """:meth:`backward` from gradients w.r.t. the pair values (per forest [P_f])."""
        if not self._pending:
            raise RuntimeError(
                "a recording replays its units once and then frees their records: record again (or call "
                "attached_logprobs again) for another backward pass"
            )
        if entropy_grads is not None and self.entropies is None:
            raise ValueError("entropy gradients need a recording made with return_entropy=True")
        if router_grads is not None and self.router_logits is None:
            raise ValueError("router gradients need a recording made with return_router_logits=True")
        # Pair gradients where pairs are shared between ranks: summed, then each rank's home pairs.
        grads, entropy_grads = self.engine._share_grads(grads), self.engine._share_grads(entropy_grads)
        with torch.enable_grad(), self._autocast.restored():
            self.engine._replay_units(
                self._store, grads, entropy_grads, router_grads, kept=self._kept, closing=self._closing
            )
        self._store, self._kept, self._pending = None, None, False


class _Replay(torch.autograd.Function):
    """Identity on recorded pair values whose backward replays the recording's units (the model's
    parameters receive their gradients there; ``anchor``, one of them, only puts the values on the
    graph)."""

    @staticmethod
    def forward(ctx, recording: Recording, anchor: torch.Tensor, *values: torch.Tensor):
        ctx.recording = recording
        return tuple(v.clone() for v in values)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        values = ctx.recording.values
        ctx.recording.backward_pairs([torch.zeros_like(v) if g is None else g for g, v in zip(grads, values)])
        return (None, None, *[None] * len(grads))
