"""Agent conversations as forests: per-turn SFT samples, the forest they make, and whether the chat
template keeps the history they share token for token.

Reasoning-agent SFT trains every assistant turn, and Qwen3-family templates render an earlier
assistant turn without its reasoning, so each turn is its own sample (TRL's conversational
prompt-completion format: the messages before the turn, then the turn) and the samples of one
conversation repeat its history: one tree of per-turn branches (the caterpillar shape). The sharing
holds only if the template renders a shared history the same way in every sample;
:func:`prefix_breaks` finds where it does not, :func:`check_prefix_stable` refuses with the first
differing token.

Legend: T samples of a conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..forest import RolloutForest

__all__ = [
    "REASONING_KEY",
    "TemplateBreak",
    "check_prefix_stable",
    "conversation_forest",
    "prefix_breaks",
    "sample_ids",
    "turn_samples",
]

REASONING_KEY = "reasoning_content"
ROLES = frozenset({"system", "user", "assistant", "tool"})


def _check(conversation: Sequence[Mapping], index: int) -> None:
    roles = [m.get("role") for m in conversation]
    if unknown := sorted({str(r) for r in roles} - ROLES):
        raise ValueError(
            f"conversation {index} has messages of roles {unknown}: a message's role is one of {sorted(ROLES)}"
        )
    if "assistant" not in roles:
        raise ValueError(f"conversation {index} has no assistant turn: it gives nothing to train")
    for i, role in enumerate(roles):
        called = i > 0 and (
            roles[i - 1] == "tool" or (roles[i - 1] == "assistant" and conversation[i - 1].get("tool_calls"))
        )
        if role == "tool" and not called:
            raise ValueError(
                f"conversation {index}, message {i}: a tool result must follow an assistant turn with tool_calls "
                "(or another tool result)"
            )


def turn_samples(conversations: Sequence[Sequence[Mapping]], *, reasoning: str = "last") -> list[dict[str, list[dict]]]:
    """One sample per assistant turn of every conversation, in TRL's conversational
    prompt-completion format: ``prompt`` the messages before the turn, ``completion`` [the turn].
    ``reasoning="last"``: assistant turns inside a prompt lose their ``reasoning_content`` (as
    Qwen3-family templates render earlier turns), so each turn's reasoning is trained in its own
    sample; ``"all"`` keeps it."""
    if reasoning not in ("last", "all"):
        raise ValueError(f'reasoning must be "last" or "all", got {reasoning!r}')
    samples = []
    for index, conversation in enumerate(conversations):
        _check(conversation, index)
        history = []
        for m in conversation:
            if m["role"] == "assistant":
                samples.append({"prompt": list(history), "completion": [dict(m)]})
            keep = reasoning == "all" or m["role"] != "assistant"
            history.append(dict(m) if keep else {k: v for k, v in m.items() if k != REASONING_KEY})
    return samples


def sample_ids(tokenizer, sample: Mapping[str, list]) -> list[int]:
    """The token ids of a sample as its chat template renders the whole conversation."""
    return list(
        tokenizer.apply_chat_template(sample["prompt"] + sample["completion"], tokenize=True, return_dict=False)
    )


def conversation_forest(
    tokenizer, samples: Sequence[Mapping[str, list]], *, max_length: int | None = None
) -> RolloutForest:
    """The prefix forest of the samples' token ids (its ``compression`` is what sharing saves);
    a sample longer than ``max_length`` (the model's context) is refused, naming it."""
    ids = [sample_ids(tokenizer, s) for s in samples]
    if max_length is not None and (long := [i for i, row in enumerate(ids) if len(row) > max_length]):
        raise ValueError(
            f"sample {long[0]} is {len(ids[long[0]]):,} tokens, longer than max_length={max_length:,} (the model's "
            f"context; {len(long)} such sample(s)): drop or split those conversations, or train a model with a "
            "longer context"
        )
    return RolloutForest.from_sequences(ids)


@dataclass(frozen=True)
class TemplateBreak:
    """Sample ``sample`` renders the messages it shares with sample ``sample - 1`` differently from
    token ``position`` on (``expected`` is the shared history's id there, ``got`` the sample's; -1 past its end)."""

    sample: int
    position: int
    expected: int
    got: int


def prefix_breaks(tokenizer, samples: Sequence[Mapping[str, list]]) -> list[TemplateBreak]:
    """Every consecutive pair of samples whose shared messages (the longest common run of equal
    messages) the template does not render as the start of both samples' token ids."""
    breaks = []
    for t in range(1, len(samples)):
        before = samples[t - 1]["prompt"] + samples[t - 1]["completion"]
        after = samples[t]["prompt"] + samples[t]["completion"]
        common = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        if common == 0:
            continue
        shared = np.asarray(tokenizer.apply_chat_template(after[:common], tokenize=True, return_dict=False))
        for s in (t - 1, t):
            ids = np.asarray(sample_ids(tokenizer, samples[s]))
            head = ids[: shared.size]
            if head.size == shared.size and (head == shared).all():
                continue
            pos = int(np.flatnonzero(np.append(head != shared[: head.size], True))[0])
            breaks.append(TemplateBreak(s, pos, int(shared[pos]), int(ids[pos]) if pos < ids.size else -1))
            break
    return breaks


def check_prefix_stable(tokenizer, samples: Sequence[Mapping[str, list]]) -> None:
    """Refuse samples whose chat template re-renders a shared history differently (the forest would
    silently share nothing past that token)."""
    if breaks := prefix_breaks(tokenizer, samples):
        b = breaks[0]
        raise ValueError(
            f"the chat template is not prefix-stable: sample {b.sample} renders the history it shares with its "
            f"neighbour differently from token {b.position} on (id {b.got} where the shared history has "
            f"{b.expected}; {len(breaks)} such pair(s)), so the samples share nothing past it. Tokenize "
            "incrementally (render each turn once and concatenate the ids: token-in-token-out), drop earlier "
            'reasoning the way the template does (turn_samples(..., reasoning="last")), or use a template that '
            "renders earlier turns as they were"
        )
