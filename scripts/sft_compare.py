"""Step time of stock SFTTrainer (padded rows) vs HARTSSFTTrainer (one forest per microbatch) on
per-turn samples of synthetic agent conversations, one conversation per microbatch (a sequential
sampler: TRL's default shuffle mixes conversations, and so splits what they share), same seeds,
SGD. Prints the microbatch's tokens, compression and the median step of each trainer.

    python scripts/sft_compare.py                          # bench "default" model, 10 turns, 4 conversations
    python scripts/sft_compare.py --size quick --turns 6 --conversations 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from harts_hf.bench.models import build_model
from harts_hf.data import agent_conversations, agent_tokenizer, conversation_forest, turn_samples
from harts_hf.trainers import HARTSSFTConfig, HARTSSFTTrainer


class _Clock(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []

    def on_step_begin(self, *args, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.seconds.append(time.perf_counter() - self._began)


def _in_order(trainer_cls: type) -> type:
    class InOrder(trainer_cls):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return InOrder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="default", help="bench model size (harts_hf.bench.SIZES)")
    parser.add_argument("--turns", type=int, default=10, help="tool turns per conversation (samples: turns + 1)")
    parser.add_argument("--conversations", type=int, default=4, help="conversations: one optimizer step each")
    args = parser.parse_args()
    samples = turn_samples(agent_conversations(args.conversations, turns=args.turns, seed=0))
    per_step = args.turns + 1
    tokenizer = agent_tokenizer()
    forest = conversation_forest(tokenizer, samples[:per_step])
    print(
        f"{len(samples)} samples, {per_step} per microbatch: {forest.num_trajectory_tokens} tokens, "
        f"{forest.num_compact_tokens} as a forest (compression {forest.compression:.2f})"
    )
    for name, config_cls, trainer_cls in (
        ("stock SFTTrainer", SFTConfig, SFTTrainer),
        ("HARTSSFTTrainer", HARTSSFTConfig, HARTSSFTTrainer),
    ):
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
        )
        trainer = _in_order(trainer_cls)(
            model=build_model("qwen3_5", args.size).model,
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_list(samples),
            callbacks=[clock],
        )
        trainer.train()
        steady = clock.seconds[1:] or clock.seconds  # the first step warms up
        print(f"{name}: median step {statistics.median(steady):.3f} s over {len(steady)} steps")


if __name__ == "__main__":
    main()
