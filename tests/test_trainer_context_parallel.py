"""The trainers with ``harts_context_parallel=True`` under DDP (gloo, CPU): a step whose longest trajectory
is three times the budget, every rank with rows of its own, trains with the long one spread over the other
ranks' free time in context-parallel groups, exactly like the stock trainer under the same launch: GRPO on
2 and 3 processes (over ``test_trainer_ddp``'s worker) and under FSDP2 on 2, RLOO generating on 2 and 3
processes and under FSDP2 on 2 (its old log-probs a no-grad pass over the same kind of plan), SFT and DPO
on 2 and 3 processes and under FSDP2 on 2 (over ``test_trainer_fused_ddp``'s worker: each optimizer step
one HARTS step, DPO's reference a no-grad step on its plan). Worker: ``trainer_cp_worker.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launch import torchrun
from test_trainer_ddp import TOL
from test_trainer_fused_ddp import DPO_KEYS, SFT_KEYS
from trainer_cp_worker import CASE


def _planned_groups(tmp_path, world: int) -> None:
    """Every rank made the same plans, each with context-parallel groups and every rank busy."""
    plans = [torch.load(tmp_path / f"groups-{r}.pt") for r in range(world)]
    assert all(p == plans[0] for p in plans)  # every rank the same plans
    assert plans[0] and all(groups > 0 and ranks >= 2 and all(busy) for groups, ranks, busy, _ in plans[0])


def _same_steps(stock: dict, harts: dict) -> None:
    """The parameters at the start and after each of the 2 steps equal stock's; the steps moved them."""
    assert len(stock["params"]) == len(harts["params"]) == 3
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"])):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer, world", [("grpo", 2), ("grpo", 3), ("grpo-fsdp2", 2), ("rloo", 2), ("rloo", 3), ("rloo-fsdp2", 2)]
)
def test_context_parallel_groups_train_like_stock(tmp_path, trainer, world):
    from tiny_models import tiny_model

    from harts_hf.sources.tokenizer import build_tokenizer

    tiny_model("qwen3_5").save_pretrained(tmp_path / "qwen3_5")
    build_tokenizer().save_pretrained(tmp_path / "qwen3_5")
    torchrun("trainer_cp_worker.py", world, str(tmp_path), trainer)
    _planned_groups(tmp_path, world)
    name = CASE if trainer.startswith("grpo") else "rloo"
    stock, harts = (torch.load(tmp_path / f"{run}-{name}.pt") for run in ("stock", "harts"))
    _same_steps(stock, harts)
    assert harts["ranks_agree"] and stock["ranks_agree"]
    assert trainer.startswith("rloo") or harts["rows"] == stock["rows"]  # TRL's loss saw stock's microbatches


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer, world", [("sft", 2), ("sft", 3), ("sft-fsdp2", 2), ("dpo", 2), ("dpo", 3), ("dpo-fsdp2", 2)]
)
def test_fused_head_trainers_with_groups_train_like_stock(tmp_path, trainer, world):
    """SFT and DPO: each optimizer step's forest (every rank's rows) holds one row three budgets long;
    its plan spreads it in groups, and the trainer steps as stock's, its logged metrics too."""
    kind = trainer.partition("-")[0]
    torchrun("trainer_cp_worker.py", world, str(tmp_path), trainer)
    _planned_groups(tmp_path, world)
    stock, harts = (torch.load(tmp_path / f"{kind}-cp-{run}.pt") for run in ("stock", "harts"))
    assert stock["world"] == harts["world"] == world and stock["sharded"] == harts["sharded"] == trainer.endswith(
        "fsdp2"
    )
    # one HARTS step per optimizer step, none per microbatch; DPO's reference a no-grad step on its plan
    assert harts["passes"]["per_microbatch"] == 0 and len(harts["passes"]["trained"]) == 2
    assert harts["passes"]["reused"] == (2 if kind == "dpo" else 0)
    _same_steps(stock, harts)
    keys = SFT_KEYS if kind == "sft" else DPO_KEYS
    for a, b in zip(stock["history"], harts["history"], strict=True):
        np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=TOL, atol=1e-6)
