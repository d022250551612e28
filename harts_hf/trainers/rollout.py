"""What HARTSGRPOTrainer and HARTSRLOOTrainer share: TRL's rollout trainers (``GRPOTrainer``,
``RLOOTrainer``) with every log-prob forward run on rollout forests.

The two TRL trainers have the same seams (``_get_per_token_logps_and_entropies``, ``_compute_loss``,
``training_step``, ``_buffered_inputs``), so one mixin overrides them; TRL's generation, row
shuffle, rewards, advantages and every loss stay TRL's:

- ``_compute_loss`` / ``training_step``: each optimizer step runs as a HARTS step (``step.py``):
  the log-probs of the step's rows, from every rank, come first, from one plan over the ranks and
  their token-budgeted slots; TRL's loss then runs per TRL microbatch on exactly stock's rows, and
  the engine backpropagates the step once.
- ``_get_per_token_logps_and_entropies``: the loss passes read the step's values (log-probs,
  entropies, each microbatch's router aux loss); the no-grad passes (old policy, reference,
  evaluation) are no-grad HARTS steps over every rank's rows; a pass with grad outside a training
  loss makes the microbatch's rows a :class:`~harts_hf.RolloutForest`, one tree pass computing each
  shared prefix once (a forest above the microbatch budget runs as planned pieces through
  :class:`~harts_hf.engine.TreeEngine`); the result is mapped back to TRL's ``[B, C]`` completion
  layout (``rows.py``).

Multimodal rows (pixel values and friends) take TRL's own path.
"""

from __future__ import annotations

import time

import torch

from ..engine import TreeEngine
from ..forest import RolloutForest
from ..planner import Plan
from ._compat import FOREST_KWARG, add_step_time, buffered_block, router_loss_enabled
from ._compat import metrics as trl_metrics
from .base import HARTSTrainerMixin
from .rows import rows_forest, to_completion_layout
from .step import HARTSStep, block_length

__all__ = ["HARTSRolloutMixin"]

PASS_STATS = ("trajectory_tokens", "compact_tokens", "seconds", "predicted_seconds")
"""What every rank reports of each training microbatch (``training_step`` gathers them)."""


class HARTSRolloutMixin(HARTSTrainerMixin):
    """The forest seams of a TRL rollout trainer (module docstring); its ``__init__`` calls
    :meth:`_init_rollout` after TRL's."""

    def _init_rollout(self) -> None:
        self._step_stats = torch.zeros(self.accelerator.num_processes, len(PASS_STATS), dtype=torch.float64)
        self._harts_step: HARTSStep | None = None
        self._loss_call: tuple | None = None  # (model, inputs) of the loss pass that is running
        self._served = -1  # the HARTS step's microbatch the last loss pass read
        self._no_grad_step: HARTSStep | None = (
            None  # the last no-grad pass: the next one over its rows reuses its schedule
        )
        if self._harts_enabled:
            self._prepare_harts((self.model, self.ref_model))

    def _entropy_grad(self) -> bool:
        """Whether the training loss backpropagates through the entropies (GRPO's entropy bonus)."""
        return False

    # ------------------------------------------------------------------ the forward seam
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **media,
    ):
        """TRL's (log-probs [B, C], entropies [B, C] or None, aux loss or None): the HARTS step's values
        for a loss pass, else from one forest pass over the rows.

        ``batch_size`` (TRL's row chunking of no-grad passes) is not needed: the forest is the unit.
        """
        if not self._harts_enabled or any(v is not None for v in media.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **media
            )
        if torch.is_grad_enabled():
            step = self._step_of_loss_pass(input_ids)
            j = self._served  # the block's microbatch this pass computes
        else:  # old policy, reference, evaluation: the rows of every rank under one plan
            batch = {"input_ids": input_ids, "attention_mask": attention_mask}
            options = self._plan_options()
            step = HARTSStep(
                self,
                model,
                [batch],
                options,
                entropy=compute_entropy,
                router=compute_aux_loss,
                temperature=self.temperature,
                previous=self._no_grad_step,
            )
            self._no_grad_step, j = step, 0
        if step is not None:
            logps, entropies = step.values(j, attention_mask, logits_to_keep)
            return logps, entropies if compute_entropy else None, step.aux_loss(j) if compute_aux_loss else None
        forest = rows_forest(input_ids, attention_mask)
        start = time.perf_counter()
        pieces = self._plan(forest)
        if pieces.num_slots == 1:
            options = {
                "temperature": self.temperature,
                "return_entropy": compute_entropy,
                "output_router_logits": compute_aux_loss,
            }
            with self.accelerator.autocast():
                out = model(**{FOREST_KWARG: forest, "harts_options": options})
            logprobs, entropy, aux_loss = out.logprobs, out.entropy, out.aux_loss
        else:
            logprobs, entropy = self._engine_pass(model, forest, pieces, compute_entropy, compute_aux_loss)
            aux_loss = None
        if torch.is_grad_enabled():
            self._record_train_pass(forest, pieces, time.perf_counter() - start)
        logps = to_completion_layout(logprobs, attention_mask, logits_to_keep)
        entropies = to_completion_layout(entropy, attention_mask, logits_to_keep) if compute_entropy else None
        return logps, entropies, aux_loss if compute_aux_loss else None

    def _step_of_loss_pass(self, input_ids: torch.Tensor) -> HARTSStep | None:
        """The HARTS step serving the running loss pass (made at its block's first microbatch), None
        where the pass takes the per-microbatch path (eval, the one-pass options)."""
        if self._loss_call is None or not self.model.training:
            return None
        model, inputs = self._loss_call
        if inputs["prompt_ids"].size(0) != input_ids.size(0):
            return None
        step = self._harts_step
        j = step.index(inputs) if step is not None else None
        if j is None:
            block = buffered_block(self, inputs, block_length)
            self._no_grad_step = None  # the generation's passes are over: free their schedule
            options = self._plan_options()
            step = self._harts_step = HARTSStep(
                self,
                model,
                block,
                options,
                entropy_grad=self._entropy_grad(),
                router=router_loss_enabled(self),
                temperature=self.temperature,
            )
            j = 0
        self._served = j
        return step

    def _engine_pass(
        self, model, forest: RolloutForest, pieces: Plan, compute_entropy: bool, compute_aux_loss: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A microbatch forest above the budget with grad outside a HARTS step: the engine runs the
        planned pieces; TRL's ``loss.backward()`` replays them (one process)."""
        self._check_attached_pieces(forest, pieces, router=compute_aux_loss)
        engine = TreeEngine(self.accelerator.unwrap_model(model), forest, pieces, temperature=self.temperature)
        with self.accelerator.autocast():
            lps, ents = engine.attached_logprobs(return_entropy=True)
        return lps[0], ents[0] if compute_entropy else None

    def _record_train_pass(self, forest: RolloutForest, p: Plan, seconds: float) -> None:
        """This microbatch's forest and its plan, for the step's metrics (``training_step``)."""
        metrics = trl_metrics(self, "train" if self.model.training else "eval")
        metrics["harts/rounds"].append(float(p.rounds.sum()))
        metrics["harts/microbatches"].append(float(p.num_slots))
        self._pass = (forest.num_trajectory_tokens, forest.num_compact_tokens, seconds, p.step_seconds)

    # ------------------------------------------------------------------ the step
    def _compute_loss(self, model, inputs):
        self._loss_call = (model, inputs)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_call = None

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's step; a HARTS step backpropagates after its block's last microbatch. Gathers every
        rank's figures and, at the end of each optimizer step, logs the step's (``_log_step``)."""
        if not self._harts_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        self._pass = (0, 0, 0.0, 0.0)
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        metrics = trl_metrics(self)
        step = self._harts_step
        if step is not None and (self._served == len(step.microbatches) - 1 or self.accelerator.sync_gradients):
            step.backward()
            add_step_time(self, step.backward_seconds)
            self._harts_step = None
            self._pass = step.stats()
            metrics["harts/rounds"].append(float(step.plan.rounds.sum()))
            metrics["harts/microbatches"].append(float(step.plan.num_slots))
            metrics["harts/reruns"].append(float(step.plan.rerun.sum()))  # microbatches rerun, every rank's
            metrics["harts/host_graphs"].append(float(step.plan.host_graphs.sum()))  # kept in host memory instead
            metrics["harts/rows"].append(float(step.forest.num_trajectories))
            metrics["harts/forward_seconds"].append(step.forward_seconds)
            metrics["harts/backward_seconds"].append(step.backward_seconds)
        elif step is None and self._pass[1]:  # the per-microbatch path: its forward, then the rest
            tokens, compact, forward, predicted = self._pass
            self._pass = (tokens, compact, time.perf_counter() - start, predicted)
            metrics["harts/forward_seconds"].append(forward)
            metrics["harts/backward_seconds"].append(self._pass[2] - forward)
        mine = torch.tensor([self._pass], dtype=torch.float64)
        self._step_stats += self.accelerator.gather(mine.to(self.accelerator.device)).cpu()
        if self.accelerator.sync_gradients:
            self._log_step(self._step_stats)
            self._step_stats.zero_()
        return output

    def _log_step(self, stats: torch.Tensor) -> None:
        """The optimizer step's figures over every rank, from ``stats`` [R, len(PASS_STATS)] summed over
        its microbatches: compression and tokens of what the ranks computed, trajectory tokens per
        second of the slowest rank's forward + backward, the rank imbalance measured and predicted
        (max / mean of the ranks' seconds) and the step time measured and predicted (slowest rank)."""
        tokens, compact, seconds, predicted = stats.unbind(1)
        if compact.sum() == 0:
            return
        metrics = trl_metrics(self)
        metrics["harts/compression"].append(float(tokens.sum() / compact.sum()))
        metrics["harts/compact_tokens"].append(float(compact.sum()))
        metrics["harts/trajectory_tokens"].append(float(tokens.sum()))
        metrics["harts/tokens_per_second"].append(float(tokens.sum() / seconds.max()))
        metrics["harts/rank_imbalance"].append(float(seconds.max() / seconds.mean()))
        metrics["harts/plan_imbalance"].append(float(predicted.max() / predicted.mean()))
        metrics["harts/step_seconds"].append(float(seconds.max()))  # ranks run in lockstep: the slowest
        metrics["harts/predicted_step_seconds"].append(float(predicted.max()))
