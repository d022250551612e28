"""``HARTSDPOTrainer``: TRL's ``DPOTrainer`` with each optimizer step's chosen and rejected rows run as one forest.

TRL's DPO batch is the chosen rows then the rejected rows of the same prompts; a pair shares its
prompt (in multi-turn DPO the whole conversation so far), so the forest computes it once for
both, and once more for the reference model. The seam is SFT's: TRL's ``_compute_loss`` (and
``compute_ref_log_probs``) call ``model(..., labels=labels, fused_lm_head=True)`` on the policy and
on the reference model, and read per-token ``log_probs`` (and the policy's ``entropy``,
``mean_logits``, ``is_top1``, WPO's ``log_sum_sq_probs``) from it. In training the policy's calls
read the optimizer step's HARTS step (every microbatch of every rank, one plan) and the reference
model's one no-grad step over the same forest, plan and schedule, made at its first call; in
evaluation one tree pass answers each call (``fused.py``). Every DPO loss type, ``ld_alpha``, the f-divergences and the metrics run unchanged on
those values.

``precompute_ref_log_probs`` runs inside TRL's ``__init__``, before the seam is installed: those
reference log-probs take TRL's own path (once, without grad).
"""

from __future__ import annotations

from trl import DPOTrainer

from .config import HARTSDPOConfig
from .fused import FUSED_INPUTS, HARTSFusedHeadMixin

__all__ = ["HARTSDPOTrainer"]


class HARTSDPOTrainer(HARTSFusedHeadMixin, DPOTrainer):
    """
    [`~trl.DPOTrainer`] that computes each microbatch's chosen and rejected rows on their prefix forest:
    the prompt they share once, forward and backward, with the loss and gradients stock DPO gives. Takes the
    same arguments as `DPOTrainer`; configure with [`HARTSDPOConfig`] (`harts_enable=False` is stock behaviour).
    """

    _tag_names = ("trl", "dpo", "harts")
    _batch_keys = FUSED_INPUTS | {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}  # DPO's collator

    def __init__(self, model, ref_model=None, args: HARTSDPOConfig | None = None, *rest, **kwargs):
        args = args if args is not None else self._default_args(model, HARTSDPOConfig, "DPO")
        super().__init__(model, ref_model, args, *rest, **kwargs)
        # the statistics TRL installs each model's fused head with
        policy = ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())
        self._init_fused_head({self.model: policy, self.ref_model: ()})

    @staticmethod
    def _sample_rows(sample: dict) -> list[list[int]]:
        """Chosen and rejected rows: the prompt then each completion (one batch holds both)."""
        return [sample["prompt_ids"] + sample["chosen_ids"], sample["prompt_ids"] + sample["rejected_ids"]]
