"""One-turn :class:`LedgerEnv` episodes for trainers that generate completions themselves.

TRL 1.16's ``RLOOTrainer`` takes no ``rollout_func``: it samples one completion per prompt with
the policy and scores it with reward functions. The ledger environment then plays one turn: the
prompt is the system prompt and the task (TRL's conversational format, rendered by the in-code
tokenizer's template up to ``<|assistant|>``), the completion is the turn (reasoning, ``<|act|>``,
one tool call), and :func:`ledger_turn_reward` runs that call in the task's environment. A group's
completions share the prompt, the prefix the forest computes once.
"""

from __future__ import annotations

from functools import cache

from datasets import Dataset

from .ledger import SYSTEM_PROMPT, LedgerEnv
from .tokenizer import SPECIAL_TOKENS, build_tokenizer

__all__ = ["ledger_prompts", "ledger_turn_reward"]

_ACT, _EOS = SPECIAL_TOKENS.index("<|act|>"), SPECIAL_TOKENS.index("<eos>")


def ledger_prompts(num_tasks: int, start: int = 0) -> Dataset:
    """``prompt`` (system prompt + task, conversational) and ``task`` (its index) per row."""
    tasks = list(range(start, start + num_tasks))
    prompts = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": LedgerEnv().reset(t)}] for t in tasks
    ]
    return Dataset.from_dict({"prompt": prompts, "task": tasks})


@cache
def _tokenizer():
    return build_tokenizer()


def _action(ids: list[int]) -> str:
    """The tool call of a completion: the text after its first ``<|act|>`` up to ``<eos>`` (all of it
    when there is no ``<|act|>``: a turn without reasoning)."""
    start = ids.index(_ACT) + 1 if _ACT in ids else 0
    end = ids.index(_EOS, start) if _EOS in ids[start:] else len(ids)
    return _tokenizer().decode(ids[start:end], skip_special_tokens=True)


def ledger_turn_reward(completion_ids: list[list[int]], task: list[int], **kwargs) -> list[float]:
    """TRL reward function: the :meth:`LedgerEnv.reward` of each completion's tool call on its task
    (one-turn episodes: a right ``answer`` scores 0.8, the tool grammar's share of the call 0.2)."""
    rewards = []
    for ids, index in zip(completion_ids, task):
        env = LedgerEnv(max_turns=1)
        env.reset(int(index))
        env.step(_action(list(ids)))
        rewards.append(env.reward())
    return rewards
