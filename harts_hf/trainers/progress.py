"""One line per logged step: reward, loss, compression, speed (a ``TrainerCallback``), on the main process."""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import TrainerCallback

__all__ = ["StepLine"]


class StepLine(TrainerCallback):
    """A progress bar over the run's steps and a compact line for every logged step, printed by the
    main process only (every rank runs the callbacks)."""

    bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, desc="harts grpo", unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs or "loss" not in logs:
            return
        parts = [
            f"step {state.global_step:>3}/{state.max_steps}",
            f"reward {logs.get('reward', float('nan')):.3f}",
            f"loss {logs['loss']:+.4f}",
        ]
        if "harts/compression" in logs:
            parts.append(f"compression {logs['harts/compression']:.2f}x")
            parts.append(f"{logs['harts/tokens_per_second']:,.0f} traj tok/s in fwd+bwd")
        parts.append(f"step {logs.get('step_time', float('nan')):.1f} s (incl. rollout)")
        tqdm.write("  ".join(parts))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
