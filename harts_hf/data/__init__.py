"""Training data as forests: agent conversations as per-turn SFT samples, and a built-in synthetic set."""

from .conversations import (
    REASONING_KEY,
    TemplateBreak,
    check_prefix_stable,
    conversation_forest,
    prefix_breaks,
    sample_ids,
    turn_samples,
)
from .synthetic import AGENT_CHAT_TEMPLATE, agent_conversations, agent_tokenizer

__all__ = [
    "AGENT_CHAT_TEMPLATE",
    "REASONING_KEY",
    "TemplateBreak",
    "agent_conversations",
    "agent_tokenizer",
    "check_prefix_stable",
    "conversation_forest",
    "prefix_breaks",
    "sample_ids",
    "turn_samples",
]
