"""DDP on CPU (gloo), 2 processes: HARTSSFTTrainer == SFTTrainer and HARTSDPOTrainer == DPOTrainer under the
same launch, step by step.

The test starts ``torchrun --nproc_per_node 2`` on this file once. Each worker trains the single-process
tests' cases (``test_trainer_sft``'s prompt-completion samples, ``test_trainer_dpo``'s multi-turn pairs
under checkpointing), stock then HARTS, on its shard of the data (TRL's distributed sampler), and
rank 0 saves the parameters after every step, the logged history and how many fused-head calls ran
as forests. Every optimizer step's microbatches of both ranks are one forest under one plan (the HARTS
step; sft-pieces: cut into pieces, two microbatches per step); DDP syncs the gradients once per step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import torchrun

TOL = 1e-5
# run -> that test file's case; *-pieces: two microbatches per step, its forest (both ranks' rows) cut into pieces
CASES = {
    "sft": "prompt-completion",
    "sft-pieces": "text-two-microbatches-pieces",
    "dpo": "sigmoid-checkpointing",
    "dpo-pieces": "ipo-wpo-ld_alpha-two-microbatches-pieces",  # the reference passes in pieces too (no grad)
}
SFT_KEYS = ["loss", "entropy", "mean_token_accuracy", "num_tokens"]
DPO_KEYS = ["loss", "rewards/margins", "entropy"]
KEYS = {"sft": SFT_KEYS, "sft-pieces": SFT_KEYS, "dpo": DPO_KEYS, "dpo-pieces": DPO_KEYS}


@pytest.mark.slow
def test_two_processes_match_stock(tmp_path):
    torchrun(__file__, 2, str(tmp_path))
    for kind in CASES:
        stock, harts = torch.load(tmp_path / f"{kind}-stock.pt"), torch.load(tmp_path / f"{kind}-harts.pt")
        assert stock["world"] == harts["world"] == 2  # the trainers ran data-parallel
        assert harts["forests"] > 0 and stock["forests"] == 0  # HARTS ran its passes as forests, stock none
        assert len(stock["params"]) == len(harts["params"]) > 2  # the start, then every step
        assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
        for step, (a, b) in enumerate(zip(stock["params"], harts["params"], strict=True)):
            assert (a - b).abs().max().item() < TOL, f"{kind} step {step} differs by {(a - b).abs().max().item()}"
        for a, b in zip(stock["history"], harts["history"], strict=True):
            np.testing.assert_allclose([b[k] for k in KEYS[kind]], [a[k] for k in KEYS[kind]], rtol=TOL, atol=1e-6)


def _worker(out: Path) -> None:
    import test_trainer_dpo
    import test_trainer_sft
    from trainer_args import saved_model, spy_fused_outputs

    from harts_hf.sources import agent_tokenizer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])  # torchrun's; the process group starts with the first trainer
    model_dir = saved_model(out / f"model-rank{rank}", agent_tokenizer())  # the same tiny model on every rank
    for kind, case in CASES.items():
        for harts in (False, True):
            with pytest.MonkeyPatch.context() as patch:
                forests, _ = spy_fused_outputs(patch)
                work = out / f"{kind}-{harts}-rank{rank}"
                if kind.startswith("sft"):
                    run = test_trainer_sft.train(case, harts, work)
                else:
                    run = test_trainer_dpo.train(case, harts, model_dir, work)
            if rank == 0:
                world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
                record = {"params": run["params"], "history": run["history"], "forests": len(forests), "world": world}
                torch.save(record, out / f"{kind}-{'harts' if harts else 'stock'}.pt")


if __name__ == "__main__":
    from harts_hf.trainers.teardown import end_distributed

    _worker(Path(sys.argv[1]))
    end_distributed()  # gloo's threads abort the exit ("terminate called ...") otherwise
