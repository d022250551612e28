"""What a recipe trains on: the model and the built-in data, one dataclass per trainer kind, read by
TrlParser beside the trainer's config.

Each class builds its trainer's data (:meth:`~ModelArguments.train_inputs`: the keyword arguments
besides ``model``, ``args``, ``processing_class`` and ``callbacks``), refuses settings that data
cannot run (:meth:`~ModelArguments.check`) and names the run for its opening line
(:meth:`~ModelArguments.describe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from datasets import Dataset
from transformers import TrainingArguments

from ...checks import require_positive_ints
from ...sources import (
    LedgerRunner,
    agent_conversations,
    agent_preference_pairs,
    ledger_dataset,
    ledger_prompts,
    ledger_rollout,
    ledger_turn_reward,
    sample_reward,
    turn_samples,
)

__all__ = [
    "BUILTIN_PREFIX",
    "AgenticArguments",
    "ConversationArguments",
    "LedgerTurnArguments",
    "ModelArguments",
    "PreferenceArguments",
    "builtin_model",
]


BUILTIN_PREFIX = "builtin:"


def builtin_model(name: str) -> tuple[str, str]:
    """(family, size) of a ``builtin:FAMILY-SIZE`` model name, or a one-line ValueError naming the
    valid ones (checked before any work)."""
    from ...lab.models import BENCH_FAMILIES, SIZES

    family, _, size = name[len(BUILTIN_PREFIX) :].rpartition("-")
    if family not in BENCH_FAMILIES or size not in SIZES:
        raise ValueError(
            f"model_name_or_path {name!r}: a built-in model is {BUILTIN_PREFIX}FAMILY-SIZE with FAMILY one of "
            f"{', '.join(sorted(BENCH_FAMILIES))} and SIZE one of {', '.join(sorted(SIZES))}"
        )
    return family, size


@dataclass
class ModelArguments:
    """The model of a recipe and how much its console prints; subclasses add the data."""

    model_name_or_path: str = field(
        default="builtin:qwen3_5-quick",
        metadata={
            "help": "Hub id or local path of a causal LM, or builtin:FAMILY-SIZE for a freshly initialised "
            "model of harts_hf.lab.models (e.g. builtin:qwen3_5-quick, a tiny Qwen3.5-style hybrid)."
        },
    )
    seed_model: int = field(default=0, metadata={"help": "Initialisation seed of builtin: models."})
    verbose: bool = field(
        default=False,
        metadata={"help": "Also print TRL's full metrics dict every logged step (it always goes to report_to)."},
    )

    def train_inputs(self) -> dict:
        """The trainer's data arguments (``train_dataset``, and reward functions for RL)."""
        raise NotImplementedError

    def check(self, training_args: TrainingArguments) -> None:
        """Refuse trainer settings this data cannot run (nothing by default)."""

    def describe(self) -> str:
        """The model and data of a run, for its opening line."""
        raise NotImplementedError


@dataclass
class AgenticArguments(ModelArguments):
    """GRPO on the built-in tool environment: episodes played by ``rollout_func``."""

    env_mode: str = field(default="per_turn", metadata={"help": "per_turn (one sample per turn) or episode."})
    max_turns: int = field(default=3, metadata={"help": "Tool calls per episode."})
    episodes_per_task: int = field(default=4, metadata={"help": "Episodes per task (the GRPO group)."})
    num_tasks: int = field(default=256, metadata={"help": "Ledger tasks in the training set."})
    reasoning_tokens: int = field(default=16, metadata={"help": "Reasoning tokens generated per turn."})
    action_tokens: int = field(default=10, metadata={"help": "Tool-call tokens generated per turn."})

    def __post_init__(self) -> None:
        require_positive_ints(
            "AgenticArguments",
            max_turns=self.max_turns,
            episodes_per_task=self.episodes_per_task,
            num_tasks=self.num_tasks,
            reasoning_tokens=self.reasoning_tokens,
            action_tokens=self.action_tokens,
        )

    def runner(self) -> LedgerRunner:
        return LedgerRunner(self.max_turns, self.reasoning_tokens, self.action_tokens, self.env_mode)

    def train_inputs(self) -> dict:
        return {
            "reward_funcs": sample_reward,
            "train_dataset": ledger_dataset(self.num_tasks),
            "rollout_func": ledger_rollout(self.runner()),
        }

    def check(self, training_args: TrainingArguments) -> None:
        """A GRPO group is one task: all its episodes' samples."""
        runner = self.runner()
        group = self.episodes_per_task * runner.samples_per_episode
        if training_args.num_generations != group:
            raise ValueError(
                f"num_generations must be episodes_per_task x samples per episode = {group} "
                f"({self.episodes_per_task} x {runner.samples_per_episode}), got {training_args.num_generations}"
            )

    def describe(self) -> str:
        return (
            f"{self.model_name_or_path} on the built-in ledger tool environment ({self.num_tasks} tasks, "
            f"{self.episodes_per_task} episodes per task, up to {self.max_turns} tool calls, {self.env_mode} samples)"
        )


@dataclass
class LedgerTurnArguments(ModelArguments):
    """RLOO on the built-in tool environment, one turn per episode: TRL 1.16's RLOOTrainer samples
    the completions itself (it takes no ``rollout_func``) and a reward function plays the call."""

    num_tasks: int = field(default=256, metadata={"help": "Ledger tasks in the training set."})

    def __post_init__(self) -> None:
        require_positive_ints("LedgerTurnArguments", num_tasks=self.num_tasks)

    def train_inputs(self) -> dict:
        return {"reward_funcs": ledger_turn_reward, "train_dataset": ledger_prompts(self.num_tasks)}

    def describe(self) -> str:
        where = "one-turn episodes of the built-in ledger tool environment"
        return f"{self.model_name_or_path} on {where} ({self.num_tasks} tasks)"


@dataclass
class ConversationArguments(ModelArguments):
    """SFT on the built-in agent conversations cut into per-turn samples (earlier reasoning dropped).

    The samples stay in conversation order and ``train_sampling_strategy: sequential`` keeps that
    order, so with a batch of whole conversations each microbatch holds its conversations' samples
    and the history they repeat is computed once; TRL's default random sampler would spread a
    conversation over microbatches, sharing nothing.
    """

    samples: ClassVar[str] = "per-turn samples"

    num_conversations: int = field(default=64, metadata={"help": "Synthetic agent conversations in the training set."})
    turns: int = field(default=3, metadata={"help": "Tool turns per conversation (then a final answer)."})
    conversation_seed: int = field(default=0, metadata={"help": "Seed of the synthetic conversations."})

    def __post_init__(self) -> None:
        require_positive_ints(type(self).__name__, num_conversations=self.num_conversations, turns=self.turns)

    @property
    def samples_per_conversation(self) -> int:
        return self.turns + 1

    def rows(self) -> list[dict]:
        return turn_samples(agent_conversations(self.num_conversations, turns=self.turns, seed=self.conversation_seed))

    def train_inputs(self) -> dict:
        return {"train_dataset": Dataset.from_list(self.rows())}

    def check(self, training_args: TrainingArguments) -> None:
        """In conversation order, a microbatch must hold whole conversations."""
        batch, per = training_args.per_device_train_batch_size, self.samples_per_conversation
        if training_args.train_sampling_strategy == "sequential" and batch % per:
            raise ValueError(
                f"per_device_train_batch_size must be a multiple of the {self.samples} per conversation = turns + 1 "
                f"= {per} (whole conversations per microbatch), got {batch}"
            )

    def describe(self) -> str:
        return (
            f"{self.model_name_or_path} on {self.samples} of the built-in agent conversations "
            f"({self.num_conversations} conversations of {self.turns} tool turns and an answer)"
        )


@dataclass
class PreferenceArguments(ConversationArguments):
    """DPO on per-turn preference pairs of the built-in agent conversations
    (:func:`~harts_hf.sources.agent_preference_pairs`), in conversation order as for SFT."""

    samples: ClassVar[str] = "per-turn preference pairs"

    def rows(self) -> list[dict]:
        return agent_preference_pairs(self.num_conversations, turns=self.turns, seed=self.conversation_seed)
