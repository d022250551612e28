"""``HARTSSFTTrainer``: TRL's ``SFTTrainer`` with each microbatch's samples run as their prefix forest.

One seam: TRL's ``compute_loss`` calls ``model(**inputs, fused_lm_head=True)`` and reads its
per-token outputs; that call (``_compat.add_tree_fused_head``) runs one tree pass over the
microbatch's rows instead (``fused.py``): every prefix the samples share (a system prompt, the
history per-turn samples of one conversation repeat) once, forward and backward. TRL's loss, its
normalisation (``num_items_in_batch``, ``average_tokens_across_devices``), the label masks
(``completion_only_loss``, ``assistant_only_loss``) and the metrics run unchanged on what it returns.

Batches without an attention mask (``padding_free`` / packing) and multimodal inputs take TRL's
own path. A microbatch whose forest is above the microbatch budget is refused for now: cutting it
into pieces (the engine's plan, as GRPO's HARTS step does) is the next step.
"""

from __future__ import annotations

import torch
from accelerate.utils import is_peft_model
from transformers.utils import logging
from trl import SFTTrainer

from ._compat import add_tree_fused_head
from .base import HARTSTrainerMixin
from .config import HARTSSFTConfig
from .fused import FUSED_INPUTS, fused_outputs
from .rows import rows_forest

__all__ = ["HARTSSFTTrainer"]

logger = logging.get_logger(__name__)


class HARTSSFTTrainer(HARTSTrainerMixin, SFTTrainer):
    """
    [`~trl.SFTTrainer`] that computes each microbatch on the prefix forest of its samples: every shared
    prefix once, forward and backward, with the loss and gradients stock SFT gives. Takes the same arguments
    as `SFTTrainer`; configure with [`HARTSSFTConfig`] (`harts_enable=False` is stock behaviour).
    """

    _tag_names = ("trl", "sft", "harts")

    def __init__(self, model, args: HARTSSFTConfig | None = None, *rest, **kwargs):
        args = args if args is not None else self._default_args(model, HARTSSFTConfig, "SFT")
        super().__init__(model, args, *rest, **kwargs)
        self._declined: set[frozenset] = set()  # input kinds told once that they take TRL's path
        if not self._harts_enabled:
            return
        self._prepare_harts((self.model,))
        policy = self.accelerator.unwrap_model(self.model)
        add_tree_fused_head(policy.get_base_model() if is_peft_model(policy) else policy, self._fused_on_forest)

    def _fused_on_forest(self, model: torch.nn.Module, inputs: dict):
        """The fused head's outputs from one tree pass over the microbatch's rows, or None (TRL's path)
        for inputs a forest cannot serve."""
        keys = frozenset(k for k, v in inputs.items() if v is not None)
        if keys - FUSED_INPUTS or not {"input_ids", "attention_mask", "labels"} <= keys:
            if keys not in self._declined:
                self._declined.add(keys)
                logger.warning(
                    f"HARTSSFTTrainer runs padded batches (input_ids, attention_mask, labels) as forests; a batch "
                    f"with {sorted(keys - FUSED_INPUTS) or 'no attention mask'} takes TRL's path (no prefix sharing)"
                )
            return None
        forest = rows_forest(inputs["input_ids"], inputs["attention_mask"])
        if (slots := self._plan(forest).num_slots) > 1:
            ((name, budget),) = self.args.harts_budget.items()
            raise ValueError(
                f"a microbatch of {forest.num_trajectories} samples is {forest.num_compact_tokens:,} tokens as a forest "
                f"({slots} microbatches under harts_{name}={budget:,}): raise the budget or lower "
                "per_device_train_batch_size (HARTSSFTTrainer does not cut a microbatch into pieces yet)"
            )
        return fused_outputs(
            model,
            forest,
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs["labels"],
            output_router_logits=bool(inputs.get("output_router_logits")),
        )
