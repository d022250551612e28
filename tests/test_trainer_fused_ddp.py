"""HARTSSFTTrainer == SFTTrainer and HARTSDPOTrainer == DPOTrainer under the same launch, step by step, on
CPU (gloo): DDP and FSDP2, each under 2 and 3 processes.

Each launch starts ``torchrun --nproc_per_node N`` on this file once. Each worker trains the
single-process tests' cases (``test_trainer_sft``'s prompt-completion samples and per-turn text,
``test_trainer_dpo``'s multi-turn pairs), stock then HARTS, on its shard of the data (TRL's
distributed sampler), and rank 0 saves the parameters after every step, the logged history and
evaluations, and what its fused-head passes were (``trainer_args.pass_counts``). Every optimizer
step's microbatches of every rank are one forest under one plan (the HARTS step; *-pieces: cut into
pieces, two microbatches per step, evaluated at the start and after every step), DPO's reference
log-probs one no-grad step over the same forest; each eval batch of every rank one no-grad step;
the wrapper syncs the gradients once per step.

Under 3 processes the microbatches are smaller so that every rank has rows in every step; the DPO
data (8 pairs, 6 a step) make the last batch of an epoch short, which accelerate's sampler fills
with the epoch's first pairs (``even_batches``): a rank's rows may repeat another's. A rank never
holds no rows of a microbatch under TRL's sampler (that would leave stock's ranks out of step).
FSDP2 is reached as in ``test_trainer_fsdp2`` (``fsdp2_cpu``): the models are sharded where
accelerate would shard them (DPO's first case under TRL's default gradient checkpointing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import torchrun
from trainer_args import eval_keys

TOL = 1e-5
# run -> that test file's case; *-pieces: two microbatches per step, its forest (every rank's rows) cut into pieces
CASES = {
    "sft": "prompt-completion",
    "sft-pieces": "text-two-microbatches-pieces",
    "dpo": "sigmoid-checkpointing",
    "dpo-pieces": "ipo-wpo-ld_alpha-two-microbatches-pieces",  # the reference passes in pieces too (no grad)
}
SFT_KEYS = ["loss", "entropy", "mean_token_accuracy", "num_tokens"]
DPO_KEYS = ["loss", "rewards/margins", "entropy"]
KEYS = {"sft": SFT_KEYS, "sft-pieces": SFT_KEYS, "dpo": DPO_KEYS, "dpo-pieces": DPO_KEYS}
LAUNCHES = {f"{wrapper}-{world}": (world, wrapper) for wrapper in ("ddp", "fsdp2") for world in (2, 3)}
PER_DEVICE = {  # (world, run) -> per_device_train_batch_size where the case's own leaves a rank no rows
    (3, "sft"): 4,
    (3, "sft-pieces"): 2,
    (3, "dpo"): 2,
    (3, "dpo-pieces"): 1,
}


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_processes_match_stock(launch, tmp_path):
    world, wrapper = LAUNCHES[launch]
    torchrun(__file__, world, str(tmp_path), wrapper)
    for kind in CASES:
        stock, harts = torch.load(tmp_path / f"{kind}-stock.pt"), torch.load(tmp_path / f"{kind}-harts.pt")
        assert stock["world"] == harts["world"] == world  # the trainers ran data-parallel
        assert stock["sharded"] == harts["sharded"] == (wrapper == "fsdp2")
        passes, steps = harts["passes"], len(harts["params"]) - 1
        assert passes["trained"] and not stock["passes"]["trained"]  # HARTS ran its passes as forests, stock none
        # one step per optimizer step for the policy, every pass a HARTS step (no per-microbatch pass)
        assert passes["per_microbatch"] == 0 and len(passes["trained"]) == steps
        assert min(passes["trained"]) > 1 if kind.endswith("pieces") else max(passes["trained"]) == 1
        if kind.startswith("dpo"):  # a reference step per optimizer step and per eval batch, on the policy's forest
            assert passes["no_grad"] - passes["reused"] == passes["reused"] - steps
        else:  # a step per eval batch
            assert passes["reused"] == 0
        assert len(stock["evals"]) == len(harts["evals"]) == (steps + 1 if kind.endswith("pieces") else 0)
        for a, b in zip(stock["evals"], harts["evals"], strict=True):
            np.testing.assert_allclose([b[k] for k in eval_keys(a)], [a[k] for k in eval_keys(a)], rtol=TOL, atol=1e-6)
        assert len(stock["params"]) == len(harts["params"]) > 2  # the start, then every step
        assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
        for step, (a, b) in enumerate(zip(stock["params"], harts["params"], strict=True)):
            assert (a - b).abs().max().item() < TOL, f"{kind} step {step} differs by {(a - b).abs().max().item()}"
        for a, b in zip(stock["history"], harts["history"], strict=True):
            np.testing.assert_allclose([b[k] for k in KEYS[kind]], [a[k] for k in KEYS[kind]], rtol=TOL, atol=1e-6)


def _worker(out: Path, wrapper: str, runs: dict[str, str] = CASES) -> None:
    """Train ``runs`` (run -> its test file's case; an ``sft`` run's in ``test_trainer_sft``, else
    ``test_trainer_dpo``'s), stock then HARTS, under ``wrapper``; rank 0 saves each run's records."""
    import contextlib

    import test_trainer_dpo
    import test_trainer_sft
    from fsdp2_cpu import fsdp2_trainers
    from torch.distributed.fsdp import FSDPModule
    from trainer_args import pass_counts, saved_model, spy_fused_outputs

    from harts_hf.sources import agent_tokenizer

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # torchrun's
    model_dir = saved_model(out / f"model-rank{rank}", agent_tokenizer())  # the same tiny model on every rank
    for kind, case in runs.items():
        options = {"per_device_train_batch_size": PER_DEVICE[world, kind]} if (world, kind) in PER_DEVICE else {}
        for harts in (False, True):
            with pytest.MonkeyPatch.context() as patch:
                forests, _, steps = spy_fused_outputs(patch)
                sharded = fsdp2_trainers(patch) if wrapper == "fsdp2" else contextlib.nullcontext()
                work = out / f"{kind}-{harts}-rank{rank}"
                with sharded:
                    if kind.startswith("sft"):
                        run = test_trainer_sft.train(case, harts, work, **options)
                    else:
                        run = test_trainer_dpo.train(case, harts, model_dir, work, **options)
            if rank == 0:
                record = {
                    "params": run["params"],
                    "history": run["history"],
                    "evals": run["evals"],
                    "passes": pass_counts(forests, steps),
                    "world": torch.distributed.get_world_size(),
                    "sharded": isinstance(run["model"], FSDPModule),
                }
                torch.save(record, out / f"{kind}-{'harts' if harts else 'stock'}.pt")


if __name__ == "__main__":
    from harts_hf.trainers.teardown import end_distributed

    _worker(Path(sys.argv[1]), sys.argv[2])
    end_distributed()  # gloo's threads abort the exit ("terminate called ...") otherwise
