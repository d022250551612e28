"""What every trainer-against-stock test shares: the training arguments (fp32 on CPU, SGD, a log line
per step, nothing saved; SGD because Adam divides each update by the gradient's own magnitude and
would amplify rounding noise, see test_trainer_exactness), a tiny model saved where TRL can
reload it (the reference model of beta > 0, DPO's reference) and a spy on the fused-head seam."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import tiny_model
from transformers import TrainerCallback


def sgd_args(output_dir: str | Path, **overrides) -> dict:
    """Keyword arguments of a TRL config both trainers of a comparison take, with ``overrides``."""
    return (
        dict(
            output_dir=str(output_dir),
            use_cpu=True,
            bf16=False,
            optim="sgd",
            logging_steps=1,
            report_to=[],
            seed=0,
            save_strategy="no",
            disable_tqdm=True,
            gradient_checkpointing=False,
        )
        | overrides
    )


def saved_model(path: Path, tokenizer, family: str = "qwen3_5") -> str:
    """``tiny_model(family)`` and ``tokenizer`` saved in ``path``: a model id TRL loads and reloads."""
    tiny_model(family).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def spy_fused_outputs(monkeypatch) -> tuple[list, list[int], list]:
    """(forests, slots, steps): the forest and plan slot count of every fused-head pass that ran as a
    forest: each HARTS step (an optimizer step's microbatches, a no-grad pass: ``steps``, the
    ``harts_hf.trainers.fused.HARTSStep`` objects) and each per-microbatch pass
    (``harts_hf.trainers.fused.fused_outputs``), in pieces or not."""
    import harts_hf.trainers.fused as fused

    forests, slots, steps, run, step = [], [], [], fused.fused_outputs, fused.HARTSStep

    def recorded(model, forest, *args, **kwargs):
        forests.append(forest)
        slots.append(kwargs["pieces"].num_slots)
        return run(model, forest, *args, **kwargs)

    def stepped(*args, **kwargs):
        made = step(*args, **kwargs)
        steps.append(made)
        forests.append(made.forest)
        slots.append(made.plan.num_slots)
        return made

    monkeypatch.setattr(fused, "fused_outputs", recorded)
    monkeypatch.setattr(fused, "HARTSStep", stepped)
    return forests, slots, steps


class Snapshots(TrainerCallback):
    """The trained parameters (a LoRA model's: its adapters), flat, at the start and after every step."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = [flat_parameters(model)]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append(flat_parameters(model))


def flat_parameters(model, trained: bool = True) -> torch.Tensor:
    """``model``'s parameters (``trained``: those that train only), flat, in float32; whole where FSDP2
    shards them (every rank calls)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad or not trained]
    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
    return torch.cat([p.detach().float().flatten().clone() for p in whole])


def pass_counts(forests: list, steps: list) -> dict:
    """What a run's fused-head passes were (:func:`spy_fused_outputs`' lists): ``per_microbatch``
    passes outside any HARTS step, the plan slots of each ``trained`` step (with grad), the
    ``no_grad`` steps and how many of them ran on the forest and schedule of the step just before
    (``reused``: DPO's reference after the policy)."""
    follows = zip(steps, steps[1:])
    reused = sum(not b.grad and b.forest is a.forest and b.engine.schedule is a.engine.schedule for a, b in follows)
    return {
        "per_microbatch": len(forests) - len(steps),
        "trained": [s.plan.num_slots for s in steps if s.grad],
        "no_grad": sum(not s.grad for s in steps),
        "reused": reused,
    }


def eval_keys(logged: dict) -> list[str]:
    """The evaluation metrics of a logged line that a HARTS run must equal stock's in (not its timings)."""
    return [k for k in logged if k.startswith("eval_") and "runtime" not in k and "per_second" not in k]
