"""TRL's padded rows <-> rollout forests.

GRPO rows are ``cat([left-padded prompt, right-padded completion])`` [B, P + C] with an attention
mask; TRL scores the last C columns: column c of row i is log p(completion_i[c] | everything before).
A forest trajectory is the row's real tokens (prompt then completion, tool / env tokens included:
they are attended, only their loss is masked), and its log-prob column t scores token t + 1, so
completion column c of row i is trajectory column p_i - 1 + c (p_i = real prompt tokens). Past a
row's real completion the value is 0, as TRL's fused head returns for masked labels.

Legend: B rows, P padded prompt width, C completion width (``logits_to_keep``), L longest row.
"""

from __future__ import annotations

import numpy as np
import torch

from ..forest import RolloutForest

__all__ = ["row_sequences", "rows_forest", "to_completion_layout"]


def row_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[np.ndarray]:
    """The real tokens of every row (the attention mask's ones, in order)."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be one [B, P + C] shape"
        )
    ids = input_ids.detach().cpu().numpy()  # [B, P + C]
    keep = attention_mask.detach().cpu().numpy().astype(bool)
    return [row[m] for row, m in zip(ids, keep)]


def rows_forest(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RolloutForest:
    """The prefix forest of TRL rows: trajectory i is row i's real tokens."""
    return RolloutForest.from_sequences(row_sequences(input_ids, attention_mask))


def to_completion_layout(
    values: torch.Tensor,  # [B, L - 1] trajectory layout
    attention_mask: torch.Tensor,  # [B, P + C]
    logits_to_keep: int,
) -> torch.Tensor:
    """[B, C]: TRL's completion layout of trajectory-layout values (0 past each real completion)."""
    if values.size(0) != attention_mask.size(0) or not 0 < logits_to_keep < attention_mask.size(1):
        raise ValueError(
            f"values {tuple(values.shape)}, attention_mask {tuple(attention_mask.shape)} and logits_to_keep "
            f"{logits_to_keep} do not fit: one row per mask row, 0 < logits_to_keep < the mask's width"
        )
    width = attention_mask.size(1) - logits_to_keep
    mask = attention_mask.to(values.device)
    prompt_len = mask[:, :width].sum(1, keepdim=True)  # [B, 1]
    completion = mask[:, width:].bool()  # [B, C] real completion tokens (contiguous from column 0)
    cols = prompt_len - 1 + torch.arange(logits_to_keep, device=values.device)[None]  # [B, C]
    if values.size(1) == 0:
        return values.new_zeros(completion.shape)
    picked = values.gather(1, cols.clamp(max=values.size(1) - 1))
    return torch.where(completion, picked, 0.0)
