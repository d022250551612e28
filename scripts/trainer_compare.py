"""Step time of a stock TRL trainer (padded rows) vs its HARTS twin (one HARTS step per optimizer
step: every microbatch of every rank one forest under one plan) on synthetic agent conversations,
same seeds, SGD, TRL's default random sampler (``--sampler sequential``: whole conversations in
order). Prints an optimizer step's tokens, its forest against the microbatch budget, and the median
step of each trainer. Launch it with ``accelerate launch`` (e.g. ``--config_file
recipes/accelerate/cpu_ddp.yaml``) for several processes.

- ``--trainer sft``: the conversations' per-turn samples (``harts_hf.sources.turn_samples``);
- ``--trainer dpo``: their per-turn preference pairs (``harts_hf.sources.agent_preference_pairs``),
  chosen and rejected rows sharing the history, with the reference model's pass.

    python scripts/trainer_compare.py                      # SFT, bench "default" model, 10 turns, 4 conversations
    python scripts/trainer_compare.py --trainer dpo --size quick --turns 6 --conversations 6
    python scripts/trainer_compare.py --size quick --accumulation 4 --max-tokens 512   # a step 4x+ the budget
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from harts_hf.lab.models import build_model
from harts_hf.sources import (
    agent_conversations,
    agent_preference_pairs,
    agent_tokenizer,
    conversation_forest,
    turn_samples,
)
from harts_hf.trainers import HARTSDPOConfig, HARTSDPOTrainer, HARTSSFTConfig, HARTSSFTTrainer, end_distributed

TRAINERS = {  # kind: (stock config, stock trainer, HARTS config, HARTS trainer)
    "sft": (SFTConfig, SFTTrainer, HARTSSFTConfig, HARTSSFTTrainer),
    "dpo": (DPOConfig, DPOTrainer, HARTSDPOConfig, HARTSDPOTrainer),
}


class _Clock(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []

    def on_step_begin(self, *args, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.seconds.append(time.perf_counter() - self._began)


def _rows(kind: str, args: argparse.Namespace, order: list[int]) -> tuple[list[dict], list[dict]]:
    """(the dataset's examples, the first optimizer step's samples (dataset indices ``order``) as
    prompt + completion messages)."""
    if kind == "sft":
        samples = turn_samples(agent_conversations(args.conversations, turns=args.turns, seed=0))
        return samples, [samples[i] for i in order]
    pairs = agent_preference_pairs(args.conversations, turns=args.turns, seed=0)
    first = [pairs[i] for i in order]
    rows = [{"prompt": p["prompt"], "completion": p[side]} for side in ("chosen", "rejected") for p in first]
    return pairs, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="sft")
    parser.add_argument("--size", default="default", help="bench model size (harts_hf.lab.SIZES)")
    parser.add_argument("--turns", type=int, default=10, help="tool turns per conversation (samples: turns + 1)")
    parser.add_argument("--conversations", type=int, default=4, help="conversations (samples: turns + 1 each)")
    parser.add_argument("--accumulation", type=int, default=1, help="microbatches per optimizer step")
    parser.add_argument("--sampler", choices=["random", "sequential"], default="random", help="TRL's (default: random)")
    parser.add_argument("--max-tokens", type=int, default=None, help="HARTS microbatch budget (default: TRL's config)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (the first one warms up)")
    args = parser.parse_args()
    state = PartialState(cpu=True)
    per_microbatch = args.turns + 1
    per_step = per_microbatch * args.accumulation * state.num_processes
    total = args.conversations * (args.turns + 1)
    order = (
        list(range(total)) if args.sampler == "sequential" else torch.randperm(total).tolist()
    )  # a draw like the sampler's
    examples, step_rows = _rows(args.trainer, args, order[:per_step])
    tokenizer = agent_tokenizer()
    forest = conversation_forest(tokenizer, step_rows)
    budget = (
        f"{forest.num_compact_tokens / args.max_tokens:.1f}x the budget of {args.max_tokens}" if args.max_tokens else ""
    )
    if state.is_main_process:
        print(
            f"{args.trainer}: {len(examples)} examples, {per_microbatch} per microbatch x {args.accumulation} x "
            f"{state.num_processes} processes per step ({args.sampler} sampler); a step's {forest.num_trajectories} "
            f"rows: {forest.num_trajectory_tokens} tokens, {forest.num_compact_tokens} as a forest (compression "
            f"{forest.compression:.2f}) {budget}"
        )
    stock_config, stock_trainer, harts_config, harts_trainer = TRAINERS[args.trainer]
    model_dir = Path(tempfile.gettempdir()) / f"trainer_compare_{args.size}"  # DPO reloads its reference from it
    if state.is_main_process:
        build_model("qwen3_5", args.size).model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    state.wait_for_everyone()
    for config_cls, trainer_cls in ((stock_config, stock_trainer), (harts_config, harts_trainer)):
        clock = _Clock()
        config = config_cls(
            output_dir=tempfile.mkdtemp(),
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=per_microbatch,
            gradient_accumulation_steps=args.accumulation,
            max_steps=args.steps,
            learning_rate=1e-3,
            optim="sgd",
            report_to=[],
            seed=0,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10**6,
            gradient_checkpointing=False,
            max_length=None,
            train_sampling_strategy=args.sampler,
            **(
                {"harts_max_tokens_per_microbatch": args.max_tokens}
                if args.max_tokens and "HARTS" in config_cls.__name__
                else {}
            ),
        )
        trainer = trainer_cls(
            model=str(model_dir),
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_list(examples),
            callbacks=[clock],
        )
        trainer.train()
        steady = clock.seconds[1:] or clock.seconds  # the first step warms up
        if state.is_main_process:
            print(f"{trainer_cls.__name__}: median step {statistics.median(steady):.3f} s over {len(steady)} steps")
        del trainer


if __name__ == "__main__":
    main()
    end_distributed()  # a multi-process run frees its process group while Python still runs
