"""What every harts-hf trainer shares: the patched models, the plan options and the memory model.

A trainer is ``class HARTSXTrainer(HARTSTrainerMixin, XTrainer)`` with a ``HARTSXConfig``
(``config.HARTSArguments``); after TRL's ``__init__`` it calls :meth:`_prepare_harts` with the
models its passes run.
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType, broadcast_object_list, is_peft_model

from ..engine import memory_model
from ..forest import RolloutForest
from ..modeling import patch_model
from ..planner import MemoryModel, Plan, plan
from ..modeling._compat import decoder_layer_modules
from ._compat import add_tree_forward
from .config import HARTSArguments

__all__ = ["HARTSTrainerMixin"]


class HARTSTrainerMixin:
    """Planning and model preparation for a TRL trainer whose config has :class:`HARTSArguments`."""

    _memory: MemoryModel | None = None  # the policy's, probed in its first pass

    @staticmethod
    def _default_args(model, config_class: type, trainer: str) -> HARTSArguments:
        """TRL's default config for ``model`` when none is given: ``<name>-HARTS-<trainer>`` as the output dir."""
        name = model if isinstance(model, str) else model.config.name_or_path or "model"
        return config_class(f"{name.split('/')[-1]}-HARTS-{trainer}")

    @property
    def _harts_enabled(self) -> bool:
        return isinstance(self.args, HARTSArguments) and self.args.harts_enable

    def _prepare_harts(self, models: tuple[torch.nn.Module | None, ...]) -> None:
        """Refuse DeepSpeed (its engine drives the backward), patch ``models`` and let their forward
        run the engine's unit calls (``model(harts_call=run)``, seen by DDP / FSDP2)."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(
                f"{type(self).__name__} runs its passes through its own plan, which DeepSpeed's engine does not let "
                "it drive: train with DDP or FSDP2 (accelerate config), or pass harts_enable=False"
            )
        if self.args.harts_max_host_bytes:
            self._check_host_graphs()
        for m in models:
            if m is None:
                continue
            m = self.accelerator.unwrap_model(m)
            base = m.get_base_model() if is_peft_model(m) else m
            patch_model(base)
            add_tree_forward(base)

    def _check_host_graphs(self) -> None:
        """Refuse ``harts_max_host_bytes`` where there is no host memory apart from the budget's (a
        CPU run) or the wrapper keeps one graph (FSDP2)."""
        acc = self.accelerator
        if acc.device.type != "cuda" or acc.distributed_type == DistributedType.FSDP:
            where = (
                "FSDP2, which keeps one graph,"
                if acc.device.type == "cuda"
                else "a CPU run, whose memory is the host's,"
            )
            raise ValueError(
                "harts_max_host_bytes keeps the graphs the budget cannot hold in a GPU host's memory, with one "
                f"process or DDP on a GPU; {where} cannot: leave it unset"
            )

    def _plan(self, forest: RolloutForest) -> Plan:
        """This rank's own forest, planned alone (the per-microbatch path, which runs inside the
        model's forward: the fused head's seam)."""
        return plan(forest, world_size=1, **self._plan_options(inside_forward=True))

    def _check_attached_pieces(self, forest: RolloutForest, pieces: Plan, router: bool) -> None:
        """A forest above the budget outside a HARTS step runs in pieces replayed inside TRL's own
        ``loss.backward()`` (``Recording.attached``): one process only where it has a backward (a
        data-parallel wrapper cannot sync inside it; a no-grad pass, a reference model's, has none)
        and without the router aux loss (it needs the forest in one pass). Anything else is refused
        here, with the numbers."""
        several = self.accelerator.num_processes > 1 and torch.is_grad_enabled()
        if pieces.num_slots == 1 or not (several or router):
            return
        ((name, budget),) = self.args.harts_budget.items()
        why = "under several processes" if several else "with the router aux loss"
        raise ValueError(
            f"a microbatch of {forest.num_trajectories} rows is {forest.num_compact_tokens:,} tokens as a forest "
            f"({pieces.num_slots} microbatches under harts_{name}={budget:,}); {type(self).__name__} cuts such a "
            f"microbatch into pieces in one process without the router aux loss only, not {why}: raise the budget "
            "or lower per_device_train_batch_size"
        )

    def _plan_options(self, inside_forward: bool = False) -> dict:
        return dict(
            **self.args.harts_budget,
            memory_model=self._memory_model(inside_forward),
            cost_model=self.args.harts_planner_cost_model,
            chunk_size=self.args.harts_chunk_size,
            handoffs=self.args.harts_handoffs,
            context_parallel=self.args.harts_context_parallel,
            max_host_bytes=self.args.harts_max_host_bytes or 0.0,
            layers=len(decoder_layer_modules(self.accelerator.unwrap_model(self.model_wrapped))),
        )

    def _memory_model(self, inside_forward: bool = False) -> MemoryModel:
        """``harts_memory_model`` if given, else the policy's, probed through its training wrapper in
        the first pass that plans (every rank at once: under FSDP2 the probe gathers parameters),
        without gradient sync; every rank takes rank 0's, as every rank must make the same plan.
        ``inside_forward``: the caller runs inside the wrapper's forward already (its autocast and
        gathered root hold), so the probe calls the model directly:
        accelerate's mixed-precision forward enters ONE ``torch.autocast`` object per call, which
        is not re-entrant, and a nested call would leave autocast on for the rest of the process."""
        if self._memory is None and self.args.harts_memory_model is not None:
            self._memory = MemoryModel(**self.args.harts_memory_model)
        if self._memory is None:
            acc, wrapped = self.accelerator, self.model_wrapped
            unwrapped = acc.unwrap_model(wrapped)
            base = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
            if inside_forward:
                self._memory = memory_model(base)
            else:
                with acc.no_sync(wrapped), acc.autocast():
                    self._memory = memory_model(base, forward=lambda run: wrapped(harts_call=run))
            if acc.num_processes > 1:  # every rank plans alike: rank 0's figures (a probe's vary by process)
                self._memory = broadcast_object_list([self._memory])[0]
        return self._memory
