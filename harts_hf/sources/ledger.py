"""``LedgerEnv``: a deterministic multi-turn tool environment (no network, no randomness at step time).

A task names a few accounts with balances and asks for the total of some of them. The agent acts
with one tool call per turn, as plain text:

    get <account>      -> the account's balance
    add <x> <y>        -> x + y
    answer <number>    -> ends the episode

Everything is a pure function of (task index, actions): the same rollout replays bit for bit.
The reward mixes the outcome (a correct answer) with a format term (the share of action characters
the tool grammar uses), so even a randomly initialised model sees reward differences between
episodes and GRPO has a signal to follow.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SYSTEM_PROMPT", "LedgerEnv"]

SYSTEM_PROMPT = (
    "You are a bookkeeping agent. Think, then call exactly one tool per turn after <|act|>.\n"
    "Tools:\n"
    "  get <account>    returns the balance of <account>\n"
    "  add <x> <y>      returns x + y\n"
    "  answer <number>  submits the final answer and ends the task\n"
    "Accounts are lowercase names; numbers are non-negative integers. Be brief."
)

_NAMES = ("rent", "food", "fuel", "tax", "gym", "loan", "wifi", "bank")
_GRAMMAR = set(string.ascii_lowercase + string.digits + " ")


@dataclass
class LedgerEnv:
    """One episode of the ledger task; :meth:`reset` picks the task, :meth:`step` runs one tool call."""

    max_turns: int = 3
    balances: dict[str, int] = field(default_factory=dict)
    asked: tuple[str, ...] = ()
    turn: int = 0
    done: bool = False
    answered: int | None = None
    grammar_chars: int = 0
    action_chars: int = 0

    def reset(self, task: int) -> str:
        """Start task ``task`` (any int; the same index gives the same task) and return its text."""
        rng = np.random.default_rng(task)
        names = rng.choice(len(_NAMES), size=4, replace=False)
        self.balances = {_NAMES[i]: int(rng.integers(1, 50)) for i in names}
        self.asked = tuple(_NAMES[i] for i in names[:2])
        self.turn, self.done, self.answered = 0, False, None
        self.grammar_chars = self.action_chars = 0
        listing = ", ".join(sorted(self.balances))
        return f"Task {task}: accounts {listing}. What is the total of {' and '.join(self.asked)}?"

    @property
    def target(self) -> int:
        return sum(self.balances[a] for a in self.asked)

    def step(self, action: str) -> str:
        """Run one tool call; returns the observation (the episode ends on ``answer`` or the last turn)."""
        self.turn += 1
        self.action_chars += len(action)
        self.grammar_chars += sum(c in _GRAMMAR for c in action)
        words = action.split()
        observation = self._call(words[0], words[1:]) if words else "error: empty action"
        self.done = self.done or self.turn >= self.max_turns
        return observation

    def _call(self, tool: str, args: list[str]) -> str:
        if tool == "get" and len(args) == 1:
            return str(self.balances[args[0]]) if args[0] in self.balances else f"error: no account {args[0]}"
        if tool == "add" and len(args) == 2 and all(a.isdigit() for a in args):
            return str(int(args[0]) + int(args[1]))
        if tool == "answer" and len(args) == 1 and args[0].isdigit():
            self.answered, self.done = int(args[0]), True
            return "submitted"
        return f"error: unknown call {tool!r}"

    def reward(self) -> float:
        """0.8 for the right answer plus 0.2 times the share of action characters in the tool grammar."""
        correct = float(self.answered == self.target)
        grammar = self.grammar_chars / self.action_chars if self.action_chars else 0.0
        return 0.8 * correct + 0.2 * grammar
