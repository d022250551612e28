"""A built-in synthetic preference set (no download): per-turn pairs of agent conversations, in TRL's
conversational preference format, for DPO recipes and tests.

Each assistant turn of :func:`~harts_hf.sources.agent_conversations` is one pair: ``prompt`` the
conversation before the turn (earlier reasoning dropped, as :func:`~harts_hf.sources.turn_samples`
does), ``chosen`` [the turn], ``rejected`` [the other move]: a turn that should read the ledger
answers at once, the final answer reads the ledger once more. The pairs of a conversation share
its history, one tree of per-turn branches, as its SFT samples do.
"""

from __future__ import annotations

import numpy as np

from .conversations import turn_samples
from .synthetic import WORDS, agent_conversations

__all__ = ["agent_preference_pairs"]


def _rejected(turn: dict, rng: np.random.Generator) -> dict:
    """The move the chosen ``turn`` did not make: an answer instead of a tool call, and the reverse."""
    words = " ".join(rng.choice(WORDS, 3))
    if turn.get("tool_calls"):
        return {"role": "assistant", "content": f"Done: {words}.", "reasoning_content": "No need to read it."}
    call = {"type": "function", "function": {"name": "read_row", "arguments": {"row": int(rng.integers(0, 100))}}}
    return {"role": "assistant", "content": "", "reasoning_content": f"I need {words}.", "tool_calls": [call]}


def agent_preference_pairs(n: int, *, turns: int = 3, seed: int = 0) -> list[dict[str, list[dict]]]:
    """``n`` conversations' per-turn preference pairs (``turns + 1`` each, in conversation order):
    ``{"prompt": [messages], "chosen": [assistant turn], "rejected": [assistant turn]}``."""
    rng = np.random.default_rng(seed + 1)  # not the conversations' stream: the same seed gives the same conversations
    return [
        {"prompt": s["prompt"], "chosen": s["completion"], "rejected": [_rejected(s["completion"][0], rng)]}
        for s in turn_samples(agent_conversations(n, turns=turns, seed=seed))
    ]
