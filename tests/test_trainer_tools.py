"""HARTSGRPOTrainer == TRL's GRPOTrainer in TRL's own multi-turn tool loop (``tools=[...]`` and
``environment_factory``): the same rollouts, losses and parameters after every step.

The model really calls the tool. It is the tiny Qwen3.5-style hybrid (GDN + attention) of the other
trainer tests with its random trunk kept and its LM head fitted (cross-entropy on the trunk's cached
hidden states: half a second, no backward through the layers) to answer each prompt, rendered with
TRL's bundled Qwen3.5 template (the one TRL's ``add_response_schema`` recognises), with a call to
``double`` and, after the tool response, with the result. Each prompt is fitted to two arguments: a
group's rollouts share the prompt and the call's opening, then branch, reach different tool results
and earn different rewards. The tokenizer is character-level with the template's markup, a call's
opening and closing and the rendered tool block as single tokens (rows of about 50 tokens, 7-9 of
them generated). fp32 on CPU, SGD (see ``test_trainer_exactness``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from datasets import Dataset
from tiny_models import tiny_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from trainer_args import sgd_args
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_5_nothink_chat_template

from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

GROUP = 4
ARGUMENTS = {"double 21": (21, 12), "double 7": (7, 70)}
"""Prompt -> the two arguments the fitted model calls ``double`` with (the first is right)."""
TOL = 1e-5

SPECIAL = ("<|endoftext|>", "<bos>", "<|im_end|>", "<|im_start|>")
"""Ids 0-3: padding, begin of sequence (unused by the template) and the chat turn markers; eos is
``<|im_end|>`` (id 2, the tiny models' eos), as in Qwen's tokenizers."""
WORDS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "user",
    "assistant",
    "double",
    "<tool_call>\n<function=double>\n<parameter=n>\n",  # a call's opening and closing, one token each:
    "\n</parameter>\n</function>\n</tool_call>",  # a call is 4-5 generated tokens
)


def double(n: int) -> int:
    """
    Doubles a number.

    Args:
        n: The number to double.
    """
    return 2 * n


def build_tokenizer(blocks: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Printable ASCII and newline one token each, the template's markup and ``blocks`` one token each."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *WORDS, *blocks, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, normalized=False) for t in [*WORDS, *blocks]])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>", padding_side="left"
    )
    tok.chat_template = qwen3_5_nothink_chat_template
    return tok


def tool_tokenizer() -> PreTrainedTokenizerFast:
    """``build_tokenizer`` with the template's system block for ``double`` (the same schema as
    ``Doubler.double``) as one token: the 1,160-character tool preamble of every prompt."""
    text = build_tokenizer().apply_chat_template([{"role": "user", "content": "x"}], tools=[double], tokenize=False)
    return build_tokenizer((text[: text.index("<|im_end|>")],))


def fitted_rows(tok: PreTrainedTokenizerFast) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [4, L] (right-padded) of each prompt's two conversations (prompt, the call, the tool
    response, the result) and the mask [4, L] of the assistant's tokens."""
    render = lambda msgs: tok.apply_chat_template(
        msgs, tools=[double], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    rows, masks = [], []
    for prompt, args in ARGUMENTS.items():
        for n in args:
            user = [{"role": "user", "content": prompt}]
            call = {"type": "function", "function": {"name": "double", "arguments": {"n": n}}}
            turn = [{"role": "assistant", "content": "", "tool_calls": [call]}]
            tool = [{"role": "tool", "name": "double", "content": str(double(n))}]
            head, full = render(user), render(user + turn + tool)
            answer = tok(f"{double(n)}<|im_end|>", add_special_tokens=False)["input_ids"]
            end = full.index(tok.eos_token_id, len(head)) + 1  # the call's <|im_end|>
            rows.append(full + answer)
            masks.append([0] * len(head) + [1] * (end - len(head)) + [0] * (len(full) - end) + [1] * len(answer))
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    return ids, torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)


def tool_model(tok: PreTrainedTokenizerFast) -> torch.nn.Module:
    """The tiny Qwen3.5 with its LM head fitted to ``fitted_rows`` (the trunk stays random)."""
    model = tiny_model("qwen3_5")
    ids, mask = fitted_rows(tok)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1][mask[:, 1:]]  # [N, D]
    targets = ids[:, 1:][mask[:, 1:]]  # [N]
    head = model.lm_head.weight
    opt = torch.optim.Adam([head], lr=0.2)
    for _ in range(200):
        loss = torch.nn.functional.cross_entropy(hidden @ head.T, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    coin_flips = len(ids) * math.log(2) / len(targets)  # the loss left: each row's argument is one of two
    assert loss.item() < 1.25 * coin_flips, (loss.item(), coin_flips)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen3_5_tools")
    tok = tool_tokenizer()
    tool_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


class Doubler:
    """An ``environment_factory`` environment: ``double`` as a method, the reward its own."""

    def __init__(self, calls: list):
        self.calls = calls

    def reset(self, answer: int, **kwargs) -> None:
        self.answer, self.result = answer, None

    def double(self, n: int) -> int:
        """
        Doubles a number.

        Args:
            n: The number to double.
        """
        self.calls.append(n)
        self.result = 2 * n
        return self.result

    def get_reward(self) -> float:
        return float(self.result == self.answer)


@dataclass
class Run:
    """One training run: the trainer, its logged losses, its parameters after every optimizer step,
    the tool's calls and every rollout the rewards saw (completion ids and messages)."""

    trainer: GRPOTrainer
    losses: list[float] = field(default_factory=list)
    params: list[list[torch.Tensor]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    rollouts: list[tuple] = field(default_factory=list)


class Snapshots(TrainerCallback):
    def __init__(self, params: list):
        self.params = params

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append([p.detach().clone() for p in model.parameters()])


def train(trainer_cls, config_cls, kind: str, model_dir: str, output_dir: str, **overrides) -> Run:
    """Two steps of ``trainer_cls`` on the two prompts (one group each), the tool given as ``kind``."""
    run = Run(trainer=None)

    def answered(completions, completion_ids, answer, **kwargs) -> list[float]:
        run.rollouts.append((completion_ids, completions))
        return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer)]

    def seen(completions, completion_ids, **kwargs) -> list[float]:
        run.rollouts.append((completion_ids, completions))
        return [0.0] * len(completions)

    @functools.wraps(double)  # the same tool schema
    def counted(n: int) -> int:
        run.calls.append(n)
        return double(n)

    if kind == "tools":
        tool_args = dict(reward_funcs=answered, tools=[counted])
    else:  # the environment's own reward (``Doubler.get_reward``); ``seen`` only records the rollouts
        tool_args = dict(reward_funcs=seen, environment_factory=lambda: Doubler(run.calls))
    args = config_cls(
        **sgd_args(
            output_dir,
            **(
                dict(
                    per_device_train_batch_size=2 * GROUP,
                    num_generations=GROUP,
                    max_steps=2,
                    learning_rate=0.01,
                    max_completion_length=32,
                )
                | overrides
            ),
        )
    )
    prompts = [[{"role": "user", "content": p}] for p in ARGUMENTS] * 2
    answers = [double(args[0]) for args in ARGUMENTS.values()] * 2
    run.trainer = trainer_cls(
        model=model_dir,
        args=args,
        processing_class=tool_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}),
        callbacks=[Snapshots(run.params)],
        **tool_args,
    )
    run.trainer.train()
    run.losses = [h["loss"] for h in run.trainer.state.log_history if "loss" in h]
    return run


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "kind, overrides",
    [
        pytest.param("tools", {}, id="tools"),  # TRL's defaults
        pytest.param("environment_factory", dict(beta=0.1), id="environment_factory-beta"),  # + a reference pass
    ],
)
def test_tool_loop_same_as_trl(kind, overrides, model_dir, tmp_path):
    stock = train(GRPOTrainer, GRPOConfig, kind, model_dir, str(tmp_path / "stock"), **overrides)
    harts = train(HARTSGRPOTrainer, HARTSGRPOConfig, kind, model_dir, str(tmp_path / "harts"), **overrides)

    # The same rollouts, in which the model called the tool (both arguments) and TRL inserted its results.
    assert len(stock.calls) >= 2 * GROUP and set(stock.calls) > {21}, stock.calls
    assert harts.calls == stock.calls
    assert len(harts.rollouts) == len(stock.rollouts) == 2
    for (h_ids, h_msgs), (s_ids, s_msgs) in zip(harts.rollouts, stock.rollouts):
        assert h_ids == s_ids and h_msgs == s_msgs
    messages = [m for _, step in stock.rollouts for msgs in step for m in msgs]
    assert len(stock.calls) >= sum(m["role"] == "tool" for m in messages) >= 2 * GROUP  # (overlong ones dropped)
    assert min(logged(stock.trainer, "tools/call_frequency")) > 0.5
    batch = harts.trainer._buffered_inputs[0]  # the last step's rows: tool results attended, not trained
    tok = harts.trainer.processing_class
    rows = list(zip(batch["completion_ids"], batch["completion_mask"].bool(), batch["tool_mask"].bool()))
    results = [tok.decode(ids[m & ~t]) for ids, m, t in rows]
    assert sum("<tool_response>" in r for r in results) >= GROUP, results
    assert not any("<tool_response>" in tok.decode(ids[m & t]) for ids, m, t in rows)

    # The same losses and parameters after every step; every step moved the weights.
    np.testing.assert_allclose(harts.losses, stock.losses, rtol=TOL, atol=TOL)
    assert len(stock.params) == len(harts.params) == 2
    for got, ref in zip(harts.params, stock.params):
        assert max_diff(got, ref) < TOL
    start = list(AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    assert min(max_diff(a, b) for a, b in zip(stock.params, [start, *stock.params])) > 1e-4

    # HARTS ran every step as one forest over the step's rows, and the rows shared prefixes.
    assert logged(harts.trainer, "harts/rows") == [2 * GROUP] * 2
    assert min(logged(harts.trainer, "harts/compression")) > 1.2
