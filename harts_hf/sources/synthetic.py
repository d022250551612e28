"""A built-in synthetic agent-conversation dataset (no download): system, user, assistant turns with
reasoning and tool calls, tool results, a final answer. For tests and recipes."""

from __future__ import annotations

import numpy as np

from .tokenizer import build_tokenizer

__all__ = ["AGENT_CHAT_TEMPLATE", "agent_conversations", "agent_tokenizer"]

AGENT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}<|act|>{{ c['function']['name'] }}"
    "({{ c['function']['arguments']['row'] }}){% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Renders reasoning and tool calls, every message the same wherever it stands (prefix-stable);
guards the keys ``datasets`` fills with None; ``<|assistant|>`` is the generation prompt, so TRL's
prompt-completion and preference formats leave it in the prompt (not trained)."""

WORDS = ("ledger", "balance", "entry", "check", "total", "note", "sum", "row", "file", "value")
"""The vocabulary of the synthetic messages (the preference set draws its rejected turns from it too)."""


def agent_conversations(n: int, *, turns: int = 3, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations in TRL's messages format, each ``turns`` tool-using assistant turns (with
    ``reasoning_content`` and one ``tool_calls`` entry, then the tool's result) and a final answer."""
    if n < 1 or turns < 0:
        raise ValueError(f"need n >= 1 conversations and turns >= 0, got n={n}, turns={turns}")
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(rng.choice(WORDS, k))
    out = []
    for _ in range(n):
        messages = [
            {"role": "system", "content": "You keep a ledger. Use the tool to read it."},
            {"role": "user", "content": f"Task: {words(4)}."},
        ]
        for turn in range(turns):
            row = int(rng.integers(0, 100))
            call = {"type": "function", "function": {"name": "read_row", "arguments": {"row": row}}}
            messages.append(
                {"role": "assistant", "content": "", "reasoning_content": f"I need {words(3)}.", "tool_calls": [call]}
            )
            messages.append({"role": "tool", "name": "read_row", "content": f"row {row}: {words(2)}"})
        messages.append({"role": "assistant", "content": f"Done: {words(3)}.", "reasoning_content": "All read."})
        out.append(messages)
    return out


def agent_tokenizer():
    """The in-code character tokenizer (``harts_hf.sources.build_tokenizer``) with :data:`AGENT_CHAT_TEMPLATE`."""
    tok = build_tokenizer()
    tok.chat_template = AGENT_CHAT_TEMPLATE
    return tok
