"""Two-process DDP on CPU (gloo): HARTSGRPOTrainer == GRPOTrainer under the same launch, step by step.

The test starts ``torchrun --nproc_per_node 2`` on this file. Each worker trains stock GRPO, then
HARTS GRPO (all-gathered generation batch, one plan over both ranks, each rank training the rows the
plan gives it, filler rows evening the counts), on the deterministic branching rollouts of the
exactness test, and rank 0 saves the parameters after every step. Rollouts are rank-dependent
(each rank rolls out its own prompts), so a 2-process HARTS run is compared with a 2-process stock
run, never with one process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LOSSES = ("dapo", "grpo")
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_two_processes_match_stock(tmp_path):
    from tiny_models import tiny_model

    from harts_hf.envs.tokenizer import build_tokenizer

    tiny_model("qwen3_5").save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        __file__,
        str(tmp_path),
    ]
    run = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for loss in LOSSES:
        stock = torch.load(tmp_path / f"stock-{loss}.pt")
        harts = torch.load(tmp_path / f"harts-{loss}.pt")
        assert len(stock) == len(harts) == 3  # the start, then after each of the 2 steps
        assert (stock[-1] - stock[0]).abs().max() > 1e-3  # the steps moved the weights
        for step, (a, b) in enumerate(zip(stock, harts)):
            assert (a - b).abs().max().item() < TOL, f"{loss}: step {step} differs by {(a - b).abs().max().item()}"
        meta = torch.load(tmp_path / f"harts-{loss}-meta.pt")
        assert meta["ranks_agree"] and meta["plan_imbalance"]  # DDP kept ranks in sync; the plan ran


def _worker(out: Path) -> None:
    from datasets import Dataset
    from test_trainer_exactness import PROMPTS, branching_rollout, config_kwargs, id_reward
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from harts_hf.envs.tokenizer import build_tokenizer
    from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer

    torch.set_num_threads(1)

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.params = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.params.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))

    for loss in LOSSES:
        for name, trainer_cls, config_cls in (
            ("stock", GRPOTrainer, GRPOConfig),
            ("harts", HARTSGRPOTrainer, HARTSGRPOConfig),
        ):
            args = config_cls(**config_kwargs(str(out / name), loss_type=loss))
            snaps = Snapshots()
            trainer = trainer_cls(
                model=str(out / "model"),
                reward_funcs=id_reward,
                args=args,
                processing_class=build_tokenizer(),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
                rollout_func=branching_rollout,
                callbacks=[snaps],
            )
            snaps.params.append(torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()]))
            trainer.train()
            final = snaps.params[-1]
            gathered = trainer.accelerator.gather(final[None])
            if trainer.accelerator.is_main_process:
                torch.save(snaps.params, out / f"{name}-{loss}.pt")
                if name == "harts":
                    imbalance = [
                        h["harts/plan_imbalance"] for h in trainer.state.log_history if "harts/plan_imbalance" in h
                    ]
                    meta = {
                        "ranks_agree": bool((gathered[0] == gathered[1]).all()),
                        "plan_imbalance": imbalance,
                        "rows_per_microbatch": trainer._rows_per_microbatch,
                    }
                    torch.save(meta, out / f"{name}-{loss}-meta.pt")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    if torch.distributed.is_initialized():  # gloo's threads abort the exit ("terminate called ...") otherwise
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
