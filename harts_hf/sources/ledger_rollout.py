"""Episodes of :class:`LedgerEnv` played by the trainer's policy, as per-turn or whole-episode samples.

Each turn the policy writes reasoning, then (after ``<|act|>``) one tool call ended by ``<eos>``;
the environment answers with a ``<|tool|>`` observation. Generation is batched over all live
episodes of a turn (left-padded ``model.generate``, sampling at the trainer's temperature).

``mode="per_turn"`` (the agentic default): one sample per turn, whose context keeps earlier turns'
tool calls and observations but drops their reasoning, the way agent scaffolds trim history. The
samples of an episode form a caterpillar (a trunk of turns with a side leaf per turn) and the
episodes of a task share the system prompt and task: the shape prefix forests compress.
``mode="episode"``: one sample per episode, TRL's multi-turn row (every turn, reasoning kept,
observations masked).

Legend: E episodes alive in a turn, W context width, T new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from datasets import Dataset
from trl.models import unwrap_model_for_generation

from .episodes import Sample, episode_rollout
from .ledger import SYSTEM_PROMPT, LedgerEnv
from .tokenizer import SPECIAL_TOKENS

__all__ = ["MODES", "LedgerRunner", "ledger_dataset", "ledger_rollout"]

MODES = ("per_turn", "episode")
_ID = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def ledger_dataset(num_tasks: int, start: int = 0) -> Dataset:
    """The prompt column TRL's dataloader walks: one task index per row."""
    return Dataset.from_dict({"prompt": [str(i) for i in range(start, start + num_tasks)]})


@dataclass
class _Episode:
    env: LedgerEnv
    trunk: list[int]  # context kept for later turns (per_turn mode) / whole history (episode mode)
    prompt_len: int
    mask: list[int]  # episode mode: env mask of trunk[prompt_len:]
    logprobs: list[float]
    samples: list[tuple[list[int], list[int], list[int], list[float]]]


@dataclass
class LedgerRunner:
    """An :data:`~harts_hf.sources.episodes.EpisodeRunner` for :class:`LedgerEnv`.

    Args:
        max_turns: tool calls per episode (an ``answer`` ends it earlier).
        reasoning_tokens, action_tokens: generation limits per turn.
        mode: ``"per_turn"`` or ``"episode"`` (see the module docstring).
    """

    max_turns: int = 3
    reasoning_tokens: int = 24
    action_tokens: int = 12
    mode: str = "per_turn"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")

    @property
    def samples_per_episode(self) -> int:
        return self.max_turns if self.mode == "per_turn" else 1

    def __call__(self, tasks: Sequence[str], episodes_per_task: int, trainer) -> list[list[list[Sample]]]:
        tok = trainer.processing_class
        episodes = []
        for task in tasks:
            for _ in range(episodes_per_task):
                env = LedgerEnv(self.max_turns)
                text = env.reset(int(task))
                ids = tok.apply_chat_template(
                    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
                )["input_ids"]
                episodes.append(_Episode(env, list(ids), len(ids), [], [], []))
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            for _ in range(self.max_turns):
                live = [e for e in episodes if not e.env.done]
                if not live:
                    break
                self._turn(live, model, tok, trainer.temperature)
        out = [self._samples(e) for e in episodes]
        return [out[i : i + episodes_per_task] for i in range(0, len(out), episodes_per_task)]

    def _turn(self, live: list[_Episode], model, tok, temperature: float) -> None:
        heads = [e.trunk + [_ID["<|assistant|>"]] for e in live]
        reasoning = _generate(model, heads, self.reasoning_tokens, _ID["<|act|>"], temperature, len(tok))
        acts = [h + r + _closing(r, "<|act|>") for h, (r, _) in zip(heads, reasoning)]
        actions = _generate(model, acts, self.action_tokens, _ID["<eos>"], temperature, len(tok))
        for e, head, (r, r_lp), (a, a_lp) in zip(live, heads, reasoning, actions):
            r_end, a_end = _closing(r, "<|act|>"), _closing(a, "<eos>")
            completion = r + r_end + a + a_end
            mask = [1] * len(r) + [0] * len(r_end) + [1] * len(a) + [0] * len(a_end)
            logprobs = r_lp + [0.0] * len(r_end) + a_lp + [0.0] * len(a_end)
            text = tok.decode(a, skip_special_tokens=True)
            observation = tok("<|tool|>" + e.env.step(text))["input_ids"]
            if self.mode == "per_turn":
                e.samples.append((head, completion, mask, logprobs))
                e.trunk = head + [_ID["<|act|>"]] + a + [_ID["<eos>"]] + observation
            else:
                e.trunk = head + completion + observation
                e.mask += [0] + mask + [0] * len(observation)
                e.logprobs += [0.0] + logprobs + [0.0] * len(observation)

    def _samples(self, e: _Episode) -> list[Sample]:
        reward = e.env.reward()
        if self.mode == "episode":
            return [Sample(e.trunk[: e.prompt_len], e.trunk[e.prompt_len :], e.mask, e.logprobs, reward)]
        return [Sample(p, c, m, lp, reward) for p, c, m, lp in e.samples]


def _closing(generated: list[int], token: str) -> list[int]:
    """The stop token the scaffold appends when generation did not end with it (env-written)."""
    return [] if generated and generated[-1] == _ID[token] else [_ID[token]]


@torch.no_grad()
def _generate(
    model, contexts: list[list[int]], max_new: int, stop: int, temperature: float, vocab: int
) -> list[tuple[list[int], list[float]]]:
    """Sample up to ``max_new`` tokens per context (stopping at ``stop``): (ids, sampling log-probs)."""
    width = max(len(c) for c in contexts)
    device = model.device
    ids = torch.zeros(len(contexts), width, dtype=torch.long, device=device)  # [E, W] left-padded
    mask = torch.zeros_like(ids)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :] = torch.as_tensor(c, device=device)
        mask[i, width - len(c) :] = 1
    banned = [_ID[t] for t in ("<pad>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")]
    banned += list(range(vocab, model.get_output_embeddings().weight.shape[0]))
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        eos_token_id=stop,
        pad_token_id=0,
        suppress_tokens=banned,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, width:]  # [E, T]
    scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)  # [E, T]
    result = []
    for row, lp in zip(new.tolist(), scores.tolist()):
        end = row.index(stop) + 1 if stop in row else len(row)
        result.append((row[:end], lp[:end]))
    return result


def ledger_rollout(runner: LedgerRunner):
    """TRL ``rollout_func`` playing ``runner``'s episodes (``num_generations`` must be a multiple of
    ``runner.samples_per_episode``)."""
    return episode_rollout(runner, runner.samples_per_episode)
