"""``HARTSGRPOTrainer``: TRL's ``GRPOTrainer`` with every log-prob forward run on rollout forests.

Only seams are overridden; TRL's generation, rewards, advantages and every loss stay TRL's:

- ``_get_per_token_logps_and_entropies`` (policy, old policy and reference passes): the rows
  become a :class:`~harts_hf.RolloutForest` and one tree pass computes each shared prefix once
  (a forest above ``harts_max_tokens_per_microbatch`` runs as planned pieces through
  :class:`~harts_hf.engine.TreeEngine`); the result is mapped back to TRL's ``[B, C]``
  completion layout (``rows.py``).
- ``_prepare_inputs``: the generation batch is arranged by prefix instead of shuffled row by row
  (``arrange.py``), and with several processes planned over the ranks (every rank keeps stock's row
  count); options whose loss depends on the grouping keep TRL's shuffle.
- ``compute_loss`` / ``training_step``: timing, and the step's metrics over all ranks.

Multimodal rows (pixel values and friends) take TRL's own path.
"""

from __future__ import annotations

import time

import torch
from accelerate.utils import is_peft_model
from transformers.utils import logging
from trl import GRPOTrainer

from ..engine import TreeEngine
from ..forest import RolloutForest
from ..modeling import patch_model
from ..planner import Plan, plan
from ._compat import (
    FOREST_KWARG,
    add_tree_forward,
    entropy_bonus_enabled,
    grouping_dependent_options,
    replace_row_shuffle,
)
from .arrange import arrange
from .config import HARTSGRPOConfig
from .rows import rows_forest, to_completion_layout

__all__ = ["HARTSGRPOTrainer"]

logger = logging.get_logger(__name__)

PASS_STATS = ("trajectory_tokens", "compact_tokens", "seconds", "predicted_seconds")
"""What every rank reports of each training microbatch (``training_step`` gathers them)."""


class HARTSGRPOTrainer(GRPOTrainer):
    """
    [`~trl.GRPOTrainer`] that computes log-probs and entropies on the prefix forest of its rows:
    every shared prefix (system prompt, task, earlier turns, branches) once, forward and backward,
    with the values and gradients trajectory-wise training gives. Takes the same arguments as
    `GRPOTrainer`; configure with [`HARTSGRPOConfig`] (`harts_enable=False` is stock behaviour).

    Agentic rollouts come through TRL's own `rollout_func` (see `harts_hf.envs`): an episode may
    return several rows (per-turn samples that drop earlier reasoning, branches, sub-agent calls);
    their shared prefixes become one tree.
    """

    _tag_names = ("trl", "grpo", "harts")

    def __init__(self, model, reward_funcs=None, args: HARTSGRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = HARTSGRPOConfig(f"{name.split('/')[-1]}-HARTS-GRPO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._step_stats = torch.zeros(self.accelerator.num_processes, len(PASS_STATS), dtype=torch.float64)
        if not self._harts_enabled:
            return
        self._trl_grouping = grouping_dependent_options(self)
        if self._trl_grouping and args.harts_group_rows:
            logger.warning(
                f"{' and '.join(self._trl_grouping)} depend(s) on which rows share a microbatch: HARTS keeps TRL's "
                "row shuffle (and every rank its own rows), so prefixes are shared within each microbatch only. "
                "A loss type normalised by a global count (dapo, TRL's default) lets HARTS group rows by prefix."
            )
        for m in (self.model, self.ref_model):
            if m is None:
                continue
            m = self.accelerator.unwrap_model(m)
            base = m.get_base_model() if is_peft_model(m) else m
            patch_model(base)
            add_tree_forward(base)

    @property
    def _harts_enabled(self) -> bool:
        return isinstance(self.args, HARTSGRPOConfig) and self.args.harts_enable

    # ------------------------------------------------------------------ planning
    def _plan(self, forest: RolloutForest, world_size: int = 1) -> Plan:
        return plan(forest, world_size=world_size, **self._plan_options())

    def _plan_options(self) -> dict:
        return dict(
            max_tokens_per_microbatch=self.args.harts_max_tokens_per_microbatch,
            cost_model=self.args.harts_planner_cost_model,
            chunk_size=self.args.harts_chunk_size,
        )

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
        """TRL's (log-probs [B, C], entropies [B, C] or None, aux loss or None), from one forest pass.

        ``batch_size`` (TRL's row chunking of no-grad passes) is not needed: the forest is the unit.
        """
        if not self._harts_enabled or any(v is not None for v in media.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **media
            )
        forest = rows_forest(input_ids, attention_mask)
        start = time.perf_counter()
        if forest.num_compact_tokens <= self.args.harts_max_tokens_per_microbatch:
            options = {
                "temperature": self.temperature,
                "return_entropy": compute_entropy,
                "output_router_logits": compute_aux_loss,
            }
            with self.accelerator.autocast():
                out = model(**{FOREST_KWARG: forest, "harts_options": options})
            logprobs, entropy, aux_loss = out.logprobs, out.entropy, out.aux_loss
        else:
            logprobs, entropy = self._engine_pass(model, forest, compute_entropy, compute_aux_loss)
            aux_loss = None
        if torch.is_grad_enabled():
            self._record_train_pass(forest, time.perf_counter() - start)
        logps = to_completion_layout(logprobs, attention_mask, logits_to_keep)
        entropies = to_completion_layout(entropy, attention_mask, logits_to_keep) if compute_entropy else None
        return logps, entropies, aux_loss if compute_aux_loss else None

    def _engine_pass(
        self, model, forest: RolloutForest, compute_entropy: bool, compute_aux_loss: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A microbatch whose forest exceeds the budget: the engine runs the planned pieces (one
        graph alive at a time); with grad, TRL's ``loss.backward()`` replays them."""
        budget = self.args.harts_max_tokens_per_microbatch
        if compute_aux_loss:
            raise ValueError(
                f"the router aux loss needs the microbatch's forest in one pass, but it has more than "
                f"harts_max_tokens_per_microbatch={budget} compact tokens: raise it or lower per_device_train_batch_size"
            )
        if torch.is_grad_enabled() and entropy_bonus_enabled(self):
            raise ValueError(
                f"the entropy bonus (entropy_coef / use_adaptive_entropy) needs entropy gradients, which the engine "
                f"does not give to a microbatch forest above harts_max_tokens_per_microbatch={budget} compact tokens: "
                "raise the budget or lower per_device_train_batch_size"
            )
        if torch.is_grad_enabled() and self.accelerator.num_processes > 1:
            raise ValueError(
                f"a microbatch forest above harts_max_tokens_per_microbatch={budget} compact tokens is split by the "
                "engine, which runs single-process only: raise the budget or lower per_device_train_batch_size"
            )
        engine = TreeEngine(
            self.accelerator.unwrap_model(model), forest, self._plan(forest), temperature=self.temperature
        )
        with self.accelerator.autocast():
            if torch.is_grad_enabled():
                lps, ents = engine.attached_logprobs(return_entropy=True)
            else:
                lps, ents = engine.logprobs(return_entropy=True)
        return lps[0], ents[0] if compute_entropy else None

    def _record_train_pass(self, forest: RolloutForest, seconds: float) -> None:
        """This microbatch's forest, for the step's metrics (``training_step``)."""
        p = self._plan(forest)
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["harts/rounds"].append(float(p.rounds.sum()))
        metrics["harts/microbatches"].append(float(p.num_slots))
        metrics["harts/forward_seconds"].append(seconds)
        self._pass = (forest.num_trajectory_tokens, forest.num_compact_tokens, seconds, p.step_seconds)

    # ------------------------------------------------------------------ row arrangement
    def _prepare_inputs(self, generation_batch):
        start = time.perf_counter()
        try:
            if not (self._harts_enabled and self.args.harts_group_rows and self.model.training) or self._trl_grouping:
                return super()._prepare_inputs(generation_batch)
            with replace_row_shuffle(self._arrange):
                return super()._prepare_inputs(generation_batch)
        finally:
            self._prepare_seconds = time.perf_counter() - start

    def _arrange(self, batch: dict) -> dict:
        simple = all(not isinstance(v, list) for v in batch.values())  # multimodal lists stay local
        across = self.accelerator if self.args.harts_distribute and simple else None
        batch, moved = arrange(
            batch, self.args.steps_per_generation, self.args.gradient_accumulation_steps, across, **self._plan_options()
        )
        if moved is not None:
            self._metrics["train"]["harts/moved_rows"].append(moved)
        return batch

    # ------------------------------------------------------------------ loss and timing
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        start = time.perf_counter()
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._loss_seconds = time.perf_counter() - start
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's step; gathers every rank's microbatch figures and, at the end of each optimizer step,
        logs the step's (``_log_step``)."""
        if not self._harts_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        self._pass, self._loss_seconds, self._prepare_seconds = (0, 0, 0.0, 0.0), 0.0, 0.0
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        backward = max(time.perf_counter() - start - self._prepare_seconds - self._loss_seconds, 0.0)
        self._metrics["train"]["harts/backward_seconds"].append(backward)
        tokens, compact, forward, predicted = self._pass
        mine = torch.tensor([[tokens, compact, forward + backward, predicted]], dtype=torch.float64)
        self._step_stats += self.accelerator.gather(mine.to(self.accelerator.device)).cpu()
        if self.accelerator.sync_gradients:
            self._log_step(self._step_stats)
            self._step_stats.zero_()
        return output

    def _log_step(self, stats: torch.Tensor) -> None:
        """The optimizer step's figures over every rank, from ``stats`` [R, len(PASS_STATS)] summed over
        its microbatches: compression and tokens of what the ranks computed, trajectory tokens per
        second of the slowest rank's forward + backward, and the rank imbalance measured and predicted
        (max / mean of the ranks' seconds)."""
        tokens, compact, seconds, predicted = stats.unbind(1)
        if compact.sum() == 0:
            return
        metrics = self._metrics["train"]
        metrics["harts/compression"].append(float(tokens.sum() / compact.sum()))
        metrics["harts/compact_tokens"].append(float(compact.sum()))
        metrics["harts/trajectory_tokens"].append(float(tokens.sum()))
        metrics["harts/tokens_per_second"].append(float(tokens.sum() / seconds.max()))
        metrics["harts/rank_imbalance"].append(float(seconds.max() / seconds.mean()))
        metrics["harts/plan_imbalance"].append(float(predicted.max() / predicted.mean()))
