"""DDP on CPU (gloo), 2 and 3 processes: HARTSGRPOTrainer == GRPOTrainer under the same launch, step by step.

The test starts ``torchrun --nproc_per_node N`` on this file once per N. Each worker trains, for every
case, stock GRPO and then HARTS GRPO on deterministic branching rollouts and saves the parameters
after every step (rank 0) and the rows each rank trained. Rollouts are rank-dependent (each rank
rolls out its own prompts), so an N-process HARTS run is compared with an N-process stock run, never
with one process. SGD (see test_trainer_exactness.py for why not Adam).

Every optimizer step is a HARTS step: both ranks' rows become one forest, one plan divides it
between the ranks and their slots, the log-probs are summed over the ranks, TRL's loss runs on
stock's rows and microbatches, and the engine backpropagates once per step through DDP (gradient
sync in the last backward pass only). Most cases put one system prompt in front of every prompt, so
the step's rows are ONE tree that the plan divides; every loss type of TRL 1.16 is a case, and
forests several times the budget are cut into pieces (and, in one case, keep the graphs the
budget cannot hold in host memory instead of rerunning them); the entropy bonus backpropagates through
the step's entropies, and the MoE router aux loss of each microbatch comes from the step's router
logits (pieces and two microbatches per step).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import torchrun

TOL = 1e-5
LIGHT_CONTEXT = {"token": 1000.0, "context": 200.0}  # a memory model (bytes) where context costs 0.2 tokens
SYSTEM = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]  # one prompt prefix shared by every row

CASES: dict[str, dict] = {
    "dapo-one-tree": dict(loss_type="dapo"),
    "grpo-one-tree": dict(loss_type="grpo"),
    "bnpo-one-tree": dict(loss_type="bnpo"),
    "dr_grpo-one-tree": dict(loss_type="dr_grpo"),
    "cispo-one-tree": dict(loss_type="cispo", num_iterations=2),
    "sapo-one-tree": dict(loss_type="sapo"),
    "luspo-one-tree": dict(loss_type="luspo", importance_sampling_level="sequence", num_iterations=2),
    "vespo-one-tree": dict(loss_type="vespo", num_iterations=2),
    "gspo-one-tree": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, beta=0.1),
    "entropy-bonus-one-tree": dict(loss_type="dapo", entropy_coef=0.1),
    "top-entropy-one-tree": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "grpo-two-microbatches-one-tree": dict(
        loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4
    ),
    "dapo-generation-over-two-steps-one-tree": dict(
        loss_type="dapo", steps_per_generation=2, per_device_train_batch_size=4
    ),
    "dapo-groups": dict(loss_type="dapo", system=False),
    "grpo-groups": dict(loss_type="grpo", system=False),
    "router-aux-moe-pieces-two-microbatches": dict(
        loss_type="grpo",
        model="qwen3_5_moe",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        harts_max_tokens_per_microbatch=24,
    ),
    "dapo-pieces-one-tree": dict(loss_type="dapo", harts_max_tokens_per_microbatch=48, num_iterations=2, beta=0.1),
    "dapo-checkpointing-pieces-one-tree": dict(
        loss_type="dapo",
        gradient_checkpointing=True,
        harts_max_tokens_per_microbatch=32,
        harts_memory_model=LIGHT_CONTEXT,  # the derived one: a context row costs 0.7 checkpointed tokens here
    ),
    "dapo-host-graphs-pieces-one-tree": dict(
        loss_type="dapo", harts_max_tokens_per_microbatch=48, harts_max_host_bytes=1e9, num_iterations=2
    ),
    "dapo-lora-beta-one-tree": dict(loss_type="dapo", beta=0.1, lora=True),
    "bnpo-pieces-two-microbatches": dict(
        loss_type="bnpo",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        harts_max_tokens_per_microbatch=20,
    ),
}


RESUME = "resume-mid-run"
ON_THREE = (
    "dapo-one-tree",
    "dapo-host-graphs-pieces-one-tree",
    "bnpo-pieces-two-microbatches",
    "grpo-groups",
    "dapo-generation-over-two-steps-one-tree",
    "entropy-bonus-one-tree",
)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def ddp_run(request, tmp_path_factory) -> tuple[int, Path]:
    """Every case (2 processes) or the cases of ``ON_THREE`` (3 processes), stock then HARTS."""
    from tiny_models import tiny_model

    from harts_hf.sources.tokenizer import build_tokenizer

    world = request.param
    out = tmp_path_factory.mktemp(f"ddp{world}")
    for family in ("qwen3_5", "qwen3_5_moe"):
        tiny_model(family).save_pretrained(out / family)
        build_tokenizer().save_pretrained(out / family)
    torchrun(__file__, world, str(out), ",".join([*CASES, RESUME] if world == 2 else ON_THREE))
    return world, out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_several_processes_match_stock(case, ddp_run):
    world, ddp_run = ddp_run
    if world == 3 and case not in ON_THREE:
        pytest.skip("run under 2 processes only (CI time)")
    stock = torch.load(ddp_run / f"stock-{case}.pt")
    harts = torch.load(ddp_run / f"harts-{case}.pt")
    assert len(stock["params"]) == len(harts["params"]) == 3  # the start, then after each of the 2 steps
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"])):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"
    np.testing.assert_allclose(harts["losses"], stock["losses"], rtol=TOL, atol=TOL)
    assert harts["ranks_agree"]
    assert harts["rows"] == stock["rows"], (harts["rows"], stock["rows"])  # TRL's loss sees stock's microbatches
    assert harts["real_rows"] == harts["rows"]  # no filler rows
    compression = harts["metrics"]["harts/compression"]
    assert compression and min(compression) > 1.2
    # one plan over both ranks per step: both busy, the predicted imbalance small
    assert max(harts["metrics"]["harts/plan_imbalance"]) < (1.5 if "pieces" in case else 1.3)  # tight budgets
    assert min(harts["metrics"]["harts/rows"]) == harts["block_rows"]  # the step's rows of both ranks
    if "pieces" in case:
        assert min(harts["metrics"]["harts/microbatches"]) >= 3
    assert (harts["host_calls"] > 0) == ("host-graphs" in case)  # graphs kept in host memory, call 0's among them


@pytest.mark.slow
def test_resume_from_a_mid_run_checkpoint(ddp_run):
    """2 processes: resuming from the checkpoint after step 2 ends where the uninterrupted run does."""
    world, ddp_run = ddp_run
    if world != 2:
        pytest.skip("run under 2 processes")
    record = torch.load(ddp_run / f"{RESUME}.pt")
    assert (record["whole"] - record["start"]).abs().max() > 1e-3  # the steps moved the weights
    assert record["ran"] == [4, 2]  # the resumed trainer ran steps 3 and 4 only
    assert (record["resumed"] - record["whole"]).abs().max().item() < TOL


def _worker(out: Path, cases: list[str]) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from test_trainer_exactness import PROMPTS, branching_rollout, config_kwargs, id_reward
    from trainer_args import flat_parameters
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from harts_hf.engine.offload import HostGraphs
    from harts_hf.sources.tokenizer import build_tokenizer
    from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer

    torch.set_num_threads(1)
    # harts_max_host_bytes on CPU (refused there): the GPU's path, its copies in the same memory
    HARTSGRPOTrainer._check_host_graphs = lambda self: None
    host_calls, saving = [], HostGraphs.saving
    HostGraphs.saving = lambda self: host_calls.append(1) or saving(self)

    def with_system(prompts, trainer) -> dict:
        rows = branching_rollout(prompts, trainer)
        rows["prompt_ids"] = [SYSTEM + ids for ids in rows["prompt_ids"]]
        return rows

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.params = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.params.append(flat_parameters(model, trained=False))

    for case in [c for c in cases if c != RESUME]:
        overrides = dict(CASES[case])
        family, system = overrides.pop("model", "qwen3_5"), overrides.pop("system", True)
        lora = overrides.pop("lora", False)
        for name, trainer_cls, config_cls in (
            ("stock", GRPOTrainer, GRPOConfig),
            ("harts", HARTSGRPOTrainer, HARTSGRPOConfig),
        ):
            snaps = Snapshots()
            trainer = trainer_cls(
                model=str(out / family),
                reward_funcs=id_reward,
                args=config_cls(
                    **config_kwargs(
                        str(out / name),
                        **{k: v for k, v in overrides.items() if name == "harts" or not k.startswith("harts_")},
                    )
                ),
                processing_class=build_tokenizer(),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
                rollout_func=with_system if system else branching_rollout,
                callbacks=[snaps],
                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv"])
                if lora
                else None,
            )
            rows, real, compute = [], [], trainer._compute_loss
            host_calls.clear()

            def counting(model, inputs, compute=compute, rows=rows, real=real):
                rows.append(int(inputs["completion_mask"].size(0)))
                real.append(int((inputs["completion_mask"].sum(1) > 0).sum()))
                return compute(model, inputs)

            trainer._compute_loss = counting
            snaps.params.append(flat_parameters(trainer.model, trained=False))
            trainer.train()
            gathered = trainer.accelerator.gather(snaps.params[-1][None])
            counts = trainer.accelerator.gather(torch.tensor([rows, real]))  # [2 ranks * 2, microbatches]
            if trainer.accelerator.is_main_process:
                history = trainer.state.log_history
                record = {
                    "params": snaps.params,
                    "losses": [h["loss"] for h in history if "loss" in h],
                    "ranks_agree": bool((gathered == gathered[0]).all()),
                    "block_rows": trainer.accelerator.num_processes
                    * trainer.args.per_device_train_batch_size
                    * min(trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation),
                    "rows": counts[0::2].tolist(),
                    "real_rows": counts[1::2].tolist(),
                    "host_calls": len(host_calls),
                    "metrics": {
                        k: [h[k] for h in history if k in h]
                        for k in ("harts/compression", "harts/plan_imbalance", "harts/rows", "harts/microbatches")
                    },
                }
                torch.save(record, out / f"{name}-{case}.pt")
    if RESUME in cases:
        _resume(out, with_system)


def _resume(out: Path, rollout) -> None:
    """HARTS for 4 steps, checkpointed after step 2; a new trainer resumes there and runs to step 4."""
    from datasets import Dataset
    from test_trainer_exactness import PROMPTS, config_kwargs, id_reward
    from transformers import TrainerCallback

    from harts_hf.sources.tokenizer import build_tokenizer
    from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer

    class Steps(TrainerCallback):
        ran = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.ran += 1

    def trainer(name: str, **overrides) -> HARTSGRPOTrainer:
        args = config_kwargs(str(out / name), loss_type="dapo", max_steps=4, num_iterations=2, **overrides)
        return HARTSGRPOTrainer(
            model=str(out / "qwen3_5"),
            reward_funcs=id_reward,
            args=HARTSGRPOConfig(**args),
            processing_class=build_tokenizer(),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
            rollout_func=rollout,
            callbacks=[Steps()],
        )

    whole = trainer("resume-whole", save_strategy="steps", save_steps=2)
    whole.train()
    resumed = trainer("resume-second-half")
    resumed.train(resume_from_checkpoint=str(out / "resume-whole" / "checkpoint-2"))
    flat = lambda t: torch.cat([p.detach().flatten() for p in t.model.parameters()])
    if whole.accelerator.is_main_process:
        start = torch.cat([p.detach().flatten() for p in trainer("resume-start").model.parameters()])
        ran = [next(c for c in t.callback_handler.callbacks if isinstance(c, Steps)).ran for t in (whole, resumed)]
        torch.save({"whole": flat(whole), "resumed": flat(resumed), "start": start, "ran": ran}, out / f"{RESUME}.pt")


if __name__ == "__main__":
    from harts_hf.trainers.teardown import end_distributed

    _worker(Path(sys.argv[1]), sys.argv[2].split(","))
    end_distributed()  # gloo's threads abort the exit ("terminate called ...") otherwise
