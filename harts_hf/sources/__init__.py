"""Where forests come from, in one home: agent conversations and preference pairs (SFT / DPO data),
the built-in multi-turn tool environment (rollouts for GRPO / RLOO), and synthetic workloads
(benchmarks and test shapes).

``turn_samples`` / ``conversation_forest`` turn agent conversations into per-turn samples and their
forest; ``episode_rollout`` turns episodes that yield several samples each (per-turn samples,
branches, sub-agent calls) into a TRL ``rollout_func``; ``LedgerEnv`` + ``LedgerRunner`` are the
built-in tool environment (no network) the ``train`` command and the tests use; ``ledger_prompts``
+ ``ledger_turn_reward`` play it one turn per episode for trainers that generate themselves (TRL's
RLOO); ``get_workload`` generates the SWE-like agentic benchmark and small tree shapes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .conversations import (
    REASONING_KEY,
    TemplateBreak,
    check_prefix_stable,
    conversation_forest,
    prefix_breaks,
    sample_ids,
    turn_samples,
)
from .episodes import EpisodeRunner, Sample, episode_rollout, sample_reward
from .ledger import SYSTEM_PROMPT, LedgerEnv
from .ledger_rollout import MODES, LedgerRunner, ledger_dataset, ledger_rollout
from .ledger_turn import ledger_prompts, ledger_turn_reward
from .preferences import agent_preference_pairs
from .shapes import caterpillar, deep_chain, grpo_group, long_trajectory, random_tree
from .stats import forest_stats
from .swe_like import CPU_SCALE, swe_like
from .synthetic import AGENT_CHAT_TEMPLATE, agent_conversations, agent_tokenizer
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from .workload import Workload

__all__ = [
    "AGENT_CHAT_TEMPLATE",
    "CHAT_TEMPLATE",
    "CPU_SCALE",
    "MODES",
    "REASONING_KEY",
    "SPECIAL_TOKENS",
    "SYSTEM_PROMPT",
    "WORKLOADS",
    "EpisodeRunner",
    "LedgerEnv",
    "LedgerRunner",
    "Sample",
    "TemplateBreak",
    "Workload",
    "agent_conversations",
    "agent_preference_pairs",
    "agent_tokenizer",
    "build_tokenizer",
    "caterpillar",
    "check_prefix_stable",
    "conversation_forest",
    "deep_chain",
    "episode_rollout",
    "forest_stats",
    "get_workload",
    "grpo_group",
    "ledger_dataset",
    "ledger_prompts",
    "ledger_rollout",
    "ledger_turn_reward",
    "long_trajectory",
    "prefix_breaks",
    "random_tree",
    "sample_ids",
    "sample_reward",
    "swe_like",
    "turn_samples",
]

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "swe-like": swe_like,
    "grpo-group": grpo_group,
    "caterpillar": caterpillar,
    "random-tree": random_tree,
    "deep-chain": deep_chain,
    "long-trajectory": long_trajectory,
}


def get_workload(name: str, **kwargs) -> Workload:
    """Generate the workload registered as ``name`` with the generator's keyword arguments."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(sorted(WORKLOADS))}")
    params = inspect.signature(WORKLOADS[name]).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(f"workload {name!r} takes no {', '.join(unknown)}; it takes {', '.join(params)}")
    return WORKLOADS[name](**kwargs)
