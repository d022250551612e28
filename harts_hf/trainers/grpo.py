"""``HARTSGRPOTrainer``: TRL's ``GRPOTrainer`` with every log-prob forward run on rollout forests
(the seams: ``rollout.py``)."""

from __future__ import annotations

from trl import GRPOTrainer

from ._compat import entropy_bonus_enabled
from .config import HARTSGRPOConfig
from .rollout import HARTSRolloutMixin

__all__ = ["HARTSGRPOTrainer"]


class HARTSGRPOTrainer(HARTSRolloutMixin, GRPOTrainer):
    """
    [`~trl.GRPOTrainer`] that computes log-probs and entropies on the prefix forest of its rows:
    every shared prefix (system prompt, task, earlier turns, branches) once, forward and backward,
    with the values and gradients trajectory-wise training gives. Takes the same arguments as
    `GRPOTrainer`; configure with [`HARTSGRPOConfig`] (`harts_enable=False` is stock behaviour).

    Agentic rollouts come through TRL's own `rollout_func` (see `harts_hf.sources`): an episode may
    return several rows (per-turn samples that drop earlier reasoning, branches, sub-agent calls);
    their shared prefixes become one tree.
    """

    _tag_names = ("trl", "grpo", "harts")

    def __init__(self, model, reward_funcs=None, args: HARTSGRPOConfig | None = None, *rest, **kwargs):
        args = args if args is not None else self._default_args(model, HARTSGRPOConfig, "GRPO")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._init_rollout()

    def _entropy_grad(self) -> bool:
        return entropy_bonus_enabled(self)
