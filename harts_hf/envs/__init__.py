"""Agentic rollouts for TRL trainers: the sample interface, a deterministic tool environment, a tokenizer.

``episode_rollout`` turns episodes that yield several samples each (per-turn samples, branches,
sub-agent calls) into a TRL ``rollout_func``; ``LedgerEnv`` + ``LedgerRunner`` are the built-in
multi-turn tool environment (no network) the ``train`` command and the tests use;
``ledger_prompts`` + ``ledger_turn_reward`` play it one turn per episode for trainers that generate
themselves (TRL's RLOO).
"""

from .episodes import EpisodeRunner, Sample, episode_rollout, sample_reward
from .ledger import SYSTEM_PROMPT, LedgerEnv
from .ledger_rollout import MODES, LedgerRunner, ledger_dataset, ledger_rollout
from .ledger_turn import ledger_prompts, ledger_turn_reward
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "MODES",
    "SPECIAL_TOKENS",
    "SYSTEM_PROMPT",
    "EpisodeRunner",
    "LedgerEnv",
    "LedgerRunner",
    "Sample",
    "build_tokenizer",
    "episode_rollout",
    "ledger_dataset",
    "ledger_prompts",
    "ledger_rollout",
    "ledger_turn_reward",
    "sample_reward",
]
