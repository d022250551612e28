"""Step time of a stock TRL trainer (padded rows) vs its HARTS twin (one forest per microbatch) on
synthetic agent conversations, one conversation per microbatch (a sequential sampler: TRL's default
shuffle mixes conversations, and so splits what they share), same seeds, SGD. Prints the
microbatch's tokens, compression and the median step of each trainer.

- ``--trainer sft``: the conversations' per-turn samples (``harts_hf.sources.turn_samples``);
- ``--trainer dpo``: their per-turn preference pairs (``harts_hf.sources.agent_preference_pairs``),
  chosen and rejected rows sharing the history, with the reference model's pass.

    python scripts/trainer_compare.py                      # SFT, bench "default" model, 10 turns, 4 conversations
    python scripts/trainer_compare.py --trainer dpo --size quick --turns 6 --conversations 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

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
from harts_hf.trainers import HARTSDPOConfig, HARTSDPOTrainer, HARTSSFTConfig, HARTSSFTTrainer

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


def _rows(kind: str, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(the dataset's examples, one microbatch's samples as prompt + completion messages)."""
    if kind == "sft":
        samples = turn_samples(agent_conversations(args.conversations, turns=args.turns, seed=0))
        return samples, samples[: args.turns + 1]
    pairs = agent_preference_pairs(args.conversations, turns=args.turns, seed=0)
    first = pairs[: args.turns + 1]
    rows = [{"prompt": p["prompt"], "completion": p[side]} for side in ("chosen", "rejected") for p in first]
    return pairs, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="sft")
    parser.add_argument("--size", default="default", help="bench model size (harts_hf.lab.SIZES)")
    parser.add_argument("--turns", type=int, default=10, help="tool turns per conversation (samples: turns + 1)")
    parser.add_argument("--conversations", type=int, default=4, help="conversations: one optimizer step each")
    args = parser.parse_args()
    examples, microbatch = _rows(args.trainer, args)
    per_step = args.turns + 1
    tokenizer = agent_tokenizer()
    forest = conversation_forest(tokenizer, microbatch)
    print(
        f"{args.trainer}: {len(examples)} examples, {per_step} per microbatch ({forest.num_trajectories} rows): "
        f"{forest.num_trajectory_tokens} tokens, {forest.num_compact_tokens} as a forest "
        f"(compression {forest.compression:.2f})"
    )
    stock_config, stock_trainer, harts_config, harts_trainer = TRAINERS[args.trainer]
    model_dir = Path(tempfile.mkdtemp())  # DPO reloads its reference model from the checkpoint
    build_model("qwen3_5", args.size).model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for config_cls, trainer_cls in ((stock_config, stock_trainer), (harts_config, harts_trainer)):
        clock = _Clock()
        config = config_cls(
            output_dir=tempfile.mkdtemp(),
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=per_step,
            max_steps=args.conversations,
            learning_rate=1e-3,
            optim="sgd",
            report_to=[],
            seed=0,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10**6,
            gradient_checkpointing=False,
            max_length=None,
            train_sampling_strategy="sequential",  # whole conversations per microbatch
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
        print(f"{trainer_cls.__name__}: median step {statistics.median(steady):.3f} s over {len(steady)} steps")


if __name__ == "__main__":
    main()
