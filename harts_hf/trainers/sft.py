"""``HARTSSFTTrainer``: TRL's ``SFTTrainer`` with each optimizer step's samples run as one prefix forest.

One seam: TRL's ``compute_loss`` calls ``model(**inputs, fused_lm_head=True)`` and reads its
per-token outputs; that call (``_compat.add_tree_fused_head``) reads them from the optimizer step's
HARTS step instead (``fused.py``): every microbatch of the step, on every rank, is one forest under
one plan, every prefix the samples share (a system prompt, the history per-turn samples of one
conversation repeat) computed once, forward and backward, whichever microbatch the sampler put
them in. TRL's loss, its normalisation (``num_items_in_batch``, ``average_tokens_across_devices``),
the label masks (``completion_only_loss``, ``assistant_only_loss``) and the metrics run unchanged
on what it returns.

Evaluation runs each eval batch, from every rank, as one no-grad step. DDP and FSDP2 alike.
Batches without an attention mask (``padding_free`` / packing) and multimodal inputs take TRL's
own path.
"""

from __future__ import annotations

from trl import SFTTrainer

from .config import HARTSSFTConfig
from .fused import HARTSFusedHeadMixin

__all__ = ["HARTSSFTTrainer"]


class HARTSSFTTrainer(HARTSFusedHeadMixin, SFTTrainer):
    """
    [`~trl.SFTTrainer`] that computes each microbatch on the prefix forest of its samples: every shared
    prefix once, forward and backward, with the loss and gradients stock SFT gives. Takes the same arguments
    as `SFTTrainer`; configure with [`HARTSSFTConfig`] (`harts_enable=False` is stock behaviour).
    """

    _tag_names = ("trl", "sft", "harts")

    def __init__(self, model, args: HARTSSFTConfig | None = None, *rest, **kwargs):
        args = args if args is not None else self._default_args(model, HARTSSFTConfig, "SFT")
        super().__init__(model, args, *rest, **kwargs)
        self._init_fused_head({self.model: ("entropy", "is_top1")})  # what SFT installs its head with

    @staticmethod
    def _sample_rows(sample: dict) -> list[list[int]]:
        return [sample["input_ids"]]
