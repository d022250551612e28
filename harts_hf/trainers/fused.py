"""TRL's fused LM head (``model(..., labels=labels, fused_lm_head=True)``) on the forest of a padded batch.

TRL 1.16's SFT and DPO trainers read per-token outputs of that call in the shifted layout
[B, S - 1] (column j scores ``labels[:, j + 1]`` from position j, 0 where the label is -100):
``log_probs``, ``entropy``, ``is_top1``, ``mean_logits``, ``label_mask`` and, for MoE models,
``aux_loss`` (``trl.trainer.utils.FusedCausalLMOutput``). :func:`fused_outputs` computes them with
one tree pass over the batch's rows, every shared prefix once, and scatters them back
(``rows.to_shifted_layout``), so the trainer's own loss and metrics run unchanged.

:class:`HARTSFusedHeadMixin` answers the call in a trainer. A training step's loss passes read a
HARTS step (``step.py``, as GRPO's): at the optimizer step's first microbatch (``get_batch_samples``
keeps them all) every rank's rows of every microbatch become one forest under one plan, recorded
once; each loss pass finds its rows in it by their tokens and reads their values from leaf tensors,
its backward fills their gradients (under ``no_sync``: no parameter is in that graph), and after the
last microbatch the step backpropagates through its units once, syncing the gradients in its last
backward pass (DDP, FSDP2: the loss passes still run as the wrapper's forward, in step on every
rank, but their graphs hold no parameter). Calls without grad read no-grad steps, made inside the
call on every rank at once: a model's first call on the training step's rows (DPO's reference
model) makes its step over all of them, on the policy step's forest, plan and schedule; in
evaluation each call is a step over its rows of every rank (the reference's on the policy's
forest). A call with grad the training step does not hold runs :func:`fused_outputs` on its batch.

Legend: B rows, S padded width.
"""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np
import torch
from accelerate.utils import is_peft_model
from transformers.utils import logging

from ..engine import TreeEngine
from ..forest import RolloutForest
from ..modeling import tree_forward
from ..planner import Plan
from ._compat import FusedCausalLMOutput, add_tree_fused_head, router_loss_enabled
from ._compat import metrics as trl_metrics
from .base import HARTSTrainerMixin
from .rows import row_sequences, rows_forest, to_shifted_layout
from .step import HARTSStep

__all__ = ["FUSED_INPUTS", "HARTSFusedHeadMixin", "fused_outputs"]

logger = logging.get_logger(__name__)

FUSED_INPUTS = frozenset({"input_ids", "attention_mask", "labels", "use_cache", "output_router_logits"})
"""The keywords of a fused-head call a forest can serve; any other (packing's position ids,
multimodal inputs, ...) takes TRL's own path."""


def fused_outputs(
    model: torch.nn.Module,
    forest: RolloutForest,
    input_ids: torch.Tensor,  # [B, S]
    attention_mask: torch.Tensor,  # [B, S]
    labels: torch.Tensor,  # [B, S], -100 where not scored
    *,
    statistics: tuple[str, ...] = (),
    output_router_logits: bool = False,
    pieces: Plan | None = None,
) -> FusedCausalLMOutput:
    """The fused head's outputs for the batch whose rows make ``forest`` (``rows.rows_forest``),
    from one pass of the patched ``model`` over it: ``log_probs`` and the per-token ``statistics``
    asked for (names of TRL's fused head: ``entropy``, ``is_top1``, ``mean_logits``,
    ``log_sum_sq_probs``; the others are None, as TRL's). A plan of several slots (``pieces``: the
    forest above the microbatch budget) runs through :class:`~harts_hf.engine.TreeEngine`: its
    recording pass now, its units replayed in reverse inside the caller's ``loss.backward()``."""
    label_mask = scored_labels(input_ids, attention_mask, labels)
    entropy, others = _split_entropy(statistics)
    if pieces is None or pieces.num_slots == 1:
        out = tree_forward(
            model, forest, return_entropy=entropy, statistics=others, output_router_logits=output_router_logits
        )
        values = {"log_probs": out.logprobs, "entropy": out.entropy, **{n: getattr(out, n) for n in others}}
        aux_loss = out.aux_loss
    else:
        recording = TreeEngine(model, forest, pieces).record(return_entropy=entropy, statistics=others)
        entropies = recording.entropies[0] if entropy else None
        values = {"log_probs": recording.attached()[0], "entropy": entropies}
        values |= {n: recording.statistics[n][0] for n in others}
        aux_loss = None
    return fused_result(model, values, aux_loss, label_mask, attention_mask)


def _split_entropy(statistics: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
    """(whether the entropy is asked for, the other statistics): the engine records them apart."""
    return "entropy" in statistics, tuple(name for name in statistics if name != "entropy")


def scored_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, S - 1] the label mask of a fused-head call; refuses labels a forest cannot score."""
    target = labels[:, 1:]
    label_mask = target != -100
    scored = label_mask & attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    if (label_mask != scored).any() or (target[label_mask] != input_ids[:, 1:][label_mask]).any():
        raise ValueError(
            "the labels must be the input ids (or -100) at real tokens for a forest to score them: compute the "
            "loss on shifted input ids as TRL's collators do, or pass harts_enable=False"
        )
    return label_mask


def fused_result(
    model: torch.nn.Module,
    values: dict[str, torch.Tensor | None],
    aux_loss: torch.Tensor | None,
    label_mask: torch.Tensor,
    attention_mask: torch.Tensor,
) -> FusedCausalLMOutput:
    """The fused head's outputs from per-row ``values`` ([B, L - 1] trajectory layout, by TRL's names)."""
    zero = lambda v: torch.zeros((), dtype=v.dtype, device=v.device)
    shifted = lambda v: torch.where(label_mask, to_shifted_layout(v, attention_mask), zero(v))
    outputs = {name: None if v is None else shifted(v) for name, v in values.items()}
    if outputs.get("is_top1") is not None:  # the engine's layout holds it as 0. / 1.
        outputs["is_top1"] = outputs["is_top1"].bool()
    loss = -outputs["log_probs"].sum() / label_mask.sum().clamp(min=1)
    if aux_loss is not None:  # as TRL's fused forward: the config's coefficient
        loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(loss=loss, label_mask=label_mask, aux_loss=aux_loss, **outputs)


class HARTSFusedHeadMixin(HARTSTrainerMixin):
    """A TRL trainer whose passes call the fused head (SFT, DPO): each such call on a padded batch
    runs as one tree pass over its rows (:func:`fused_outputs`); its ``__init__`` calls
    :meth:`_init_fused_head` after TRL's."""

    def _init_fused_head(self, models: dict[torch.nn.Module | None, tuple[str, ...]]) -> None:
        """Answer the fused-head calls of each of ``models`` with the per-token statistics TRL
        installed its head with for it (``add_fused_lm_head(outputs=...)``)."""
        self._declined: set[frozenset] = set()  # input kinds told once that they take TRL's path
        self._passes: list[tuple[int, int, int]] = []  # this step's (trajectory tokens, compact, slots) per pass
        self._block: list[dict] = []  # the optimizer step's microbatches on this rank (get_batch_samples)
        self._step: HARTSStep | None = None  # the HARTS step over them, while their loss passes run
        self._no_grad_steps: dict[torch.nn.Module | None, HARTSStep] = {}  # per model its step over them; None: eval's
        self._statistics = models.get(self.model, ())  # what the policy's head computes
        if not self._harts_enabled:
            return
        self._prepare_harts(tuple(models))
        self._warn_if_the_sampler_loses_sharing()
        for model, statistics in models.items():
            if model is not None:
                model = self.accelerator.unwrap_model(model)
                answer = functools.partial(self._fused_on_forest, statistics=statistics)
                add_tree_fused_head(model.get_base_model() if is_peft_model(model) else model, answer)

    _batch_keys: frozenset[str] = FUSED_INPUTS
    """What the trainer's collated microbatches may hold for one HARTS step to serve their loss passes:
    their rows are ``input_ids`` under ``attention_mask`` (anything else, e.g. packing's position ids or
    images, leaves each microbatch its own pass)."""

    @staticmethod
    def _sample_rows(sample: dict) -> list[list[int]]:
        """The rows one training sample puts in a padded batch (its trainer declares them)."""
        raise NotImplementedError

    def _warn_if_the_sampler_loses_sharing(self, batches: int = 16) -> None:
        """Measure, on the first ``batches`` optimizer steps' worth of the training data, the prefix
        sharing per step (its HARTS step's forest) in dataset order and under TRL's default random
        sampler; warn once when the sampler makes a step compute over 1.2x the tokens the order would
        (a conversation's per-turn samples spread over steps share nothing)."""
        args, data = self.args, self.train_dataset
        size = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        if args.train_sampling_strategy != "random" or not hasattr(data, "__len__") or len(data) < 2 * size:
            return
        count = min(batches, len(data) // size) * size
        shuffled = np.random.default_rng(args.seed).permutation(len(data))[:count]

        def compression(order: np.ndarray) -> float:
            forests = [
                RolloutForest.from_sequences([r for i in order[s : s + size] for r in self._sample_rows(data[int(i)])])
                for s in range(0, count, size)
            ]
            return sum(f.num_trajectory_tokens for f in forests) / sum(f.num_compact_tokens for f in forests)

        ordered, random = compression(np.arange(count)), compression(shuffled)
        if ordered / random > 1.2:
            logger.warning(
                f"{type(self).__name__}: TRL's random sampler shares {random:.2f}x per optimizer step where this data in "
                f"order shares {ordered:.2f}x (measured on {count} samples): each step computes "
                f"{ordered / random:.2f}x the tokens; set train_sampling_strategy='sequential' to keep a "
                "conversation's samples together"
            )

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """TRL's microbatches of an optimizer step, kept: the rows of its HARTS step."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._block = batches
        return batches, num_items

    def _step_of(self, model: torch.nn.Module, inputs: dict) -> HARTSStep | None:
        """The HARTS step serving training microbatch ``inputs`` (made at its optimizer step's first
        microbatch, over all of them), None where the microbatches take the per-microbatch path
        (inputs a forest cannot serve)."""
        block = self._block
        if not (self._harts_enabled and block and inputs is block[0]):
            return self._step if any(inputs is b for b in block) else None
        self._step, self._no_grad_steps = None, {}
        servable = all(set(b) <= self._batch_keys and {"input_ids", "attention_mask"} <= set(b) for b in block)
        if not servable:
            return None
        entropy, others = _split_entropy(self._statistics)
        self._step = HARTSStep(
            self,
            model,
            block,
            self._plan_options(),
            entropy=entropy,
            statistics=others,
            router=router_loss_enabled(self),
        )
        return self._step

    def _from_step(
        self, model: torch.nn.Module, inputs: dict, statistics: tuple[str, ...]
    ) -> FusedCausalLMOutput | None:
        """A pass's outputs from a HARTS step's values (its rows looked up by their tokens): a loss
        pass's from the training step, a pass without grad from a no-grad step (:meth:`_no_grad_step`);
        None when the step does not hold them."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        sequences = row_sequences(input_ids, attention_mask)
        if not torch.is_grad_enabled():
            step = self._no_grad_step(model, inputs, sequences, statistics)
        elif set(statistics) <= set(self._statistics):
            step = self._step
        else:
            return None
        rows = None if step is None else step.row_index(sequences)
        if rows is None:
            return None
        values = {"log_probs": step.logprobs[rows]}
        values |= {name: (step.entropies if name == "entropy" else step.statistics[name])[rows] for name in statistics}
        aux_loss = step.rows_aux_loss(rows) if inputs.get("output_router_logits") else None
        label_mask = scored_labels(input_ids, attention_mask, inputs["labels"])
        return fused_result(model, values, aux_loss, label_mask, attention_mask)

    def _no_grad_step(
        self, model: torch.nn.Module, inputs: dict, sequences: list[np.ndarray], statistics: tuple[str, ...]
    ) -> HARTSStep:
        """The no-grad step answering a call of ``model`` without grad, made inside that call on every
        rank at once (TRL makes such calls in step on every rank: DDP's reference model, FSDP2's
        gathers, the evaluation loop's gathers). Within a training step whose rows hold the call's
        (DPO's reference model, LoRA's policy without its adapter), ``model``'s step over all of them,
        made at its first call; otherwise (evaluation) a step over the call's rows of every rank. Each
        reuses the forest, plan and schedule of the step before it over the same rows (the training
        step's; in evaluation, the policy's pass before the reference's)."""
        training = self._step is not None and self._step.row_index(sequences) is not None
        if training and (made := self._no_grad_steps.get(model)) is not None:
            return made
        entropy, others = _split_entropy(statistics)
        batches = self._block if training else [{key: inputs[key] for key in ("input_ids", "attention_mask")}]
        made = HARTSStep(
            self,
            model,
            batches,
            self._plan_options(inside_forward=True),
            entropy=entropy,
            statistics=others,
            router=bool(inputs.get("output_router_logits")),
            previous=self._step if training else self._no_grad_steps.get(None),
            inside_forward=True,
        )
        self._no_grad_steps[model if training else None] = made  # None: the last step outside training
        self._passes.append((*made.stats()[:2], made.plan.num_slots))
        return made

    def _fused_on_forest(
        self, model: torch.nn.Module, inputs: dict, statistics: tuple[str, ...]
    ) -> FusedCausalLMOutput | None:
        """The fused head's outputs: from the HARTS step where it holds the batch's rows, else from
        one tree pass over them; None (TRL's path) for inputs a forest cannot serve."""
        keys = frozenset(k for k, v in inputs.items() if v is not None)
        if keys - FUSED_INPUTS or not {"input_ids", "attention_mask", "labels"} <= keys:
            if keys not in self._declined:
                self._declined.add(keys)
                logger.warning(
                    f"{type(self).__name__} runs padded batches (input_ids, attention_mask, labels) as forests; a "
                    f"batch with {sorted(keys - FUSED_INPUTS) or 'no attention mask'} takes TRL's path (no prefix "
                    "sharing)"
                )
            return None
        if (served := self._from_step(model, inputs, statistics)) is not None:
            return served
        forest = rows_forest(inputs["input_ids"], inputs["attention_mask"])
        pieces = self._plan(forest)
        self._passes.append((forest.num_trajectory_tokens, forest.num_compact_tokens, pieces.num_slots))
        self._check_attached_pieces(forest, pieces, router=bool(inputs.get("output_router_logits")))
        # The seam may stand in front of accelerate's mixed-precision forward (DPO's reference model is
        # prepared before the seam is installed), which it then bypasses: the pass enters the
        # accelerator's autocast itself, as every forward of a prepared model runs under it.
        with self.accelerator.autocast():
            return fused_outputs(
                model,
                forest,
                inputs["input_ids"],
                inputs["attention_mask"],
                inputs["labels"],
                statistics=statistics,
                output_router_logits=bool(inputs.get("output_router_logits")),
                pieces=pieces,
            )

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step, and the sharing its fused-head passes (policy, reference) achieved, logged as
        the rollout trainers log theirs: ``harts/compression``, ``harts/trajectory_tokens``,
        ``harts/compact_tokens``, ``harts/microbatches`` (slots of the passes) and
        ``harts/tokens_per_second`` (trajectory tokens of the passes per second of the step)."""
        self._passes.clear()
        start = time.perf_counter()
        step = self._step_of(model, inputs)
        # a loss pass the step serves uses no parameter: its backward only fills the step's leaves, and
        # syncs nothing; the step's own backward, after the last microbatch, syncs once
        with self.accelerator.no_sync(model) if step is not None else contextlib.nullcontext():
            output = super().training_step(model, inputs, num_items_in_batch)
        if step is not None and inputs is self._block[-1]:
            step.backward()
            self._step, self._no_grad_steps = None, {}
            tokens, compact, *_ = step.stats()
            self._passes.append((tokens, compact, step.plan.num_slots))
        if self._passes:
            tokens, compact, slots = (float(sum(column)) for column in zip(*self._passes))
            metrics = trl_metrics(self)
            metrics["harts/compression"].append(tokens / compact)
            metrics["harts/trajectory_tokens"].append(tokens)
            metrics["harts/compact_tokens"].append(compact)
            metrics["harts/microbatches"].append(slots)
            metrics["harts/tokens_per_second"].append(tokens / (time.perf_counter() - start))
        return output
