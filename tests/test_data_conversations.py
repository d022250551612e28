"""Agent conversations as per-turn SFT samples: the forest they make, the template-stability check
on a template that keeps the shared history and on one that does not, and bad conversations."""

from __future__ import annotations

import pytest

from harts_hf.sources import (
    AGENT_CHAT_TEMPLATE,
    agent_conversations,
    check_prefix_stable,
    conversation_forest,
    prefix_breaks,
    sample_ids,
    turn_samples,
)
from harts_hf.sources.tokenizer import build_tokenizer

STABLE = AGENT_CHAT_TEMPLATE  # every message the same wherever it stands
# Shows an assistant turn's reasoning only when it is the last message (what a Qwen3-style template
# does to earlier turns): the same history renders differently once a turn follows it.
LAST_ONLY = STABLE.replace("{% if m.get('reasoning_content') %}", "{% if loop.last and m.get('reasoning_content') %}")


def tokenizer(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def test_per_turn_samples_share_their_history():
    conversations = agent_conversations(3, turns=3, seed=1)
    samples = turn_samples(conversations)
    assert len(samples) == 3 * 4  # three tool turns and the answer, per conversation
    first = samples[1]  # the second turn: the first turn is in its prompt, without its reasoning
    assert "reasoning_content" not in first["prompt"][2] and first["completion"][0]["reasoning_content"]
    tok = tokenizer(STABLE)
    assert prefix_breaks(tok, samples) == []
    check_prefix_stable(tok, samples)
    forest = conversation_forest(tok, samples)
    assert forest.num_trajectories == 12 and len(forest.roots) == 1 and forest.compression > 1.8
    ids = sample_ids(tok, samples[2])
    assert forest.trajectory(2).tolist() == ids


def test_a_template_that_rerenders_the_history_is_refused_with_the_first_differing_token():
    samples = turn_samples(agent_conversations(2, turns=2, seed=2), reasoning="all")
    tok = tokenizer(LAST_ONLY)
    breaks = prefix_breaks(tok, samples)
    assert breaks and breaks[0].sample == 1  # sample 0's turn, last there, loses its reasoning in sample 1
    shared = sample_ids(tok, samples[0])
    think = tok.convert_tokens_to_ids("<")  # where the reasoning starts
    assert shared[breaks[0].position] == think and breaks[0].expected == think
    with pytest.raises(ValueError, match=r"not prefix-stable: sample 1 .* from token \d+ on.*token-in-token-out"):
        check_prefix_stable(tok, samples)
    # keeping only the last turn's reasoning, as the template itself does, makes the samples agree again
    assert prefix_breaks(tok, turn_samples(agent_conversations(2, turns=2, seed=2))) == []


@pytest.mark.parametrize(
    "conversation, message",
    [
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "a"},
            ],
            "tool result must follow an assistant turn with tool_calls",
        ),
        ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "a"}], "roles"),
    ],
)
def test_bad_conversations_get_one_clear_error(conversation, message):
    with pytest.raises(ValueError, match=message):
        turn_samples([conversation])


def test_a_sample_longer_than_the_context_is_refused_by_name():
    samples = turn_samples(agent_conversations(2, turns=2, seed=0))
    longest = max(len(sample_ids(tokenizer(STABLE), s)) for s in samples)
    assert conversation_forest(tokenizer(STABLE), samples, max_length=longest).num_trajectories == len(samples)
    with pytest.raises(ValueError, match=rf"sample \d+ is [\d,]+ tokens, longer than max_length={longest - 1}"):
        conversation_forest(tokenizer(STABLE), samples, max_length=longest - 1)
