"""``HARTSRLOOTrainer``: TRL's ``RLOOTrainer`` with every log-prob forward run on rollout forests
(the seams: ``rollout.py``). RLOO's loss is sequence-level (the ratio of summed log-probs), which
the HARTS step serves as it serves GRPO's: TRL's loss runs on whole rows' values, and the engine
backpropagates the gradients it leaves on them."""

from __future__ import annotations

from trl import RLOOTrainer

from .config import HARTSRLOOConfig
from .rollout import HARTSRolloutMixin

__all__ = ["HARTSRLOOTrainer"]


class HARTSRLOOTrainer(HARTSRolloutMixin, RLOOTrainer):
    """
    [`~trl.RLOOTrainer`] that computes log-probs on the prefix forest of its rows (a group's shared
    prompt once, forward and backward), with the values and gradients stock RLOO gives. Takes the
    same arguments as `RLOOTrainer`; configure with [`HARTSRLOOConfig`] (`harts_enable=False` is
    stock behaviour).
    """

    _tag_names = ("trl", "rloo", "harts")

    def __init__(self, model, reward_funcs=None, args: HARTSRLOOConfig | None = None, *rest, **kwargs):
        args = args if args is not None else self._default_args(model, HARTSRLOOConfig, "RLOO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._init_rollout()
