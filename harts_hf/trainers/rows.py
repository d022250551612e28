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

__all__ = ["row_sequences", "rows_forest", "to_completion_layout", "to_shifted_layout"]


def row_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[np.ndarray]:
    """The real tokens of every row (the attention mask's ones, in order)."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be one [B, P + C] shape"
        )
    ids = input_ids.detach().cpu().numpy()  # [B, P + C]
    keep = attention_mask.detach().cpu().numpy().astype(bool)
    real = keep.sum(1)
    span = np.where(real > 0, keep.shape[1] - keep[:, ::-1].argmax(1) - keep.argmax(1), 0)
    if (holes := np.flatnonzero(span != real)).size:
        raise ValueError(
            f"row {holes[0]}'s attention mask has gaps: a row's real tokens must be contiguous (left and / or right "
            "padding) for its positions to be those of a forest trajectory"
        )
    return [row[m] for row, m in zip(ids, keep)]


def rows_forest(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RolloutForest:
    """The prefix forest of TRL rows: trajectory i is row i's real tokens."""
    return RolloutForest.from_sequences(row_sequences(input_ids, attention_mask))


def to_shifted_layout(
    values: torch.Tensor,  # [B, L - 1] trajectory layout
    attention_mask: torch.Tensor,  # [B, S]
) -> torch.Tensor:
    """[B, S - 1]: TRL's fused-head layout of trajectory-layout values: column j of row i is the
    value of the pair that predicts position j + 1 from position j (0 where either is padding). A
    row's real tokens must be contiguous (left and / or right padding)."""
    if values.size(0) != attention_mask.size(0) or attention_mask.size(1) < 2:
        raise ValueError(
            f"values {tuple(values.shape)} and attention_mask {tuple(attention_mask.shape)} do not fit: one row per "
            "mask row, at least two columns"
        )
    mask = attention_mask.to(values.device).bool()
    start = mask.int().argmax(1, keepdim=True)  # [B, 1] each row's first real column
    cols = torch.arange(mask.size(1) - 1, device=values.device)[None] - start  # [B, S - 1] trajectory column
    valid = mask[:, :-1] & mask[:, 1:]
    if values.size(1) == 0:
        return values.new_zeros(valid.shape)
    picked = values.gather(1, cols.clamp(0, values.size(1) - 1))
    return torch.where(valid, picked, torch.zeros((), dtype=values.dtype, device=values.device))


def to_completion_layout(
    values: torch.Tensor,  # [B, L - 1] trajectory layout
    attention_mask: torch.Tensor,  # [B, P + C]
    logits_to_keep: int,
) -> torch.Tensor:
    """[B, C]: TRL's completion layout of trajectory-layout values (0 past each real completion):
    the last C columns of :func:`to_shifted_layout`."""
    if values.size(0) != attention_mask.size(0) or not 0 < logits_to_keep < attention_mask.size(1):
        raise ValueError(
            f"values {tuple(values.shape)}, attention_mask {tuple(attention_mask.shape)} and logits_to_keep "
            f"{logits_to_keep} do not fit: one row per mask row, 0 < logits_to_keep < the mask's width"
        )
    return to_shifted_layout(values, attention_mask)[:, -logits_to_keep:]
