"""Training data as forests: agent conversations as per-turn SFT samples, and built-in synthetic sets
(conversations, per-turn preference pairs)."""

from .conversations import (
    REASONING_KEY,
    TemplateBreak,
    check_prefix_stable,
    conversation_forest,
    prefix_breaks,
    sample_ids,
    turn_samples,
)
from .preferences import agent_preference_pairs
from .synthetic import AGENT_CHAT_TEMPLATE, agent_conversations, agent_tokenizer

__all__ = [
    "AGENT_CHAT_TEMPLATE",
    "REASONING_KEY",
    "TemplateBreak",
    "agent_conversations",
    "agent_preference_pairs",
    "agent_tokenizer",
    "check_prefix_stable",
    "conversation_forest",
    "prefix_breaks",
    "sample_ids",
    "turn_samples",
]
