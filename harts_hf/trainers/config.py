"""The fields that steer forest execution (``HARTSArguments``) and TRL's configs with them:
``HARTSGRPOConfig`` (``GRPOConfig``), ``HARTSRLOOConfig`` (``RLOOConfig``), ``HARTSSFTConfig``
(``SFTConfig``) and ``HARTSDPOConfig`` (``DPOConfig``)."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from trl import DPOConfig, GRPOConfig, RLOOConfig, SFTConfig

from ..planner import CHUNK_SIZE, DEFAULT_COST_MODEL, DEFAULT_MAX_TOKENS, CostModel, MemoryModel

__all__ = ["HARTSArguments", "HARTSDPOConfig", "HARTSGRPOConfig", "HARTSRLOOConfig", "HARTSSFTConfig"]


@dataclass
class HARTSArguments:
    r"""
    The harts-hf fields of a trainer's config (a mixin before TRL's config class):

    Parameters:
        harts_enable (`bool`, *optional*, defaults to `True`):
            Compute every per-token log-prob / entropy on the prefix forest of the rows: each shared prefix once,
            same values and gradients. `False` is the stock trainer's behaviour.
        harts_max_tokens_per_microbatch (`int`, *optional*, defaults to `65536`):
            Microbatch budget: the memory of this many tokens. Rows are planned over the ranks and their microbatch
            slots under this budget; trees and trajectories above it are cut into pieces joined exactly, each
            reading its ancestors (computed in earlier slots) as context, priced by the policy's memory model at a
            fraction of a token (their K/V and inputs).
        harts_max_bytes_per_microbatch (`float`, *optional*):
            The same budget in bytes of activations per microbatch (`harts_hf.engine.memory_model` prices tokens
            and context for the policy); replaces `harts_max_tokens_per_microbatch` when set.
        harts_chunk_size (`int`, *optional*, defaults to `64`):
            Chunk grid of the model's linear-attention kernels, where the planner prefers its cuts.
        harts_cost_model (`dict[str, float]`, *optional*):
            Planner cost model coefficients `token`, `pair`, `round`, `microbatch` (seconds); defaults to the
            planner's built-in model.
        harts_memory_model (`dict[str, float]`, *optional*):
            Memory model coefficients `token`, `context`, `head`, `head_chunk`, `fixed`, `layer` (bytes), e.g. what
            `harts-hf calibrate --memory` measured; defaults to the one derived from the policy at its first pass.
        harts_handoffs (`bool`, *optional*, defaults to `False`):
            Let the plan run a shared chain once and hand it to the ranks reading it (point to point, its gradient
            back) where the cost model predicts that faster than recomputing it on each (`harts_hf.planner.handoffs`);
            off by default: checked exact under DDP (the trainers) and FSDP2 (the engine; gloo, CPU), not yet on NCCL.
        harts_context_parallel (`bool`, *optional*, defaults to `False`):
            Let the plan run a trajectory longer than the budget at once over ranks with time to spare, a span each
            (a context-parallel group streamed layer by layer: `harts_hf.planner.groups`), a prompt several ranks
            share once, cut over them in a first slot (`harts_hf.planner.shared_root`), the whole step's trees cut
            in DFS order into one span per slot and rank (`harts_hf.planner.wavefront`), or relayed: every token once,
            a subtree cut between two ranks handed from one's early slot to the next's late slot
            (`harts_hf.planner.relay`), where the cost model predicts that faster; off by default. Checked exact for GRPO, RLOO, SFT and DPO under DDP and FSDP2 (gloo, CPU).
            Under FSDP2 a group's call holds every parameter gathered.
        harts_max_host_bytes (`float`, *optional*):
            Host memory (bytes per rank) for the graphs of microbatch slots the budget cannot keep: they wait in the
            host's pinned memory (their saved tensors copied there and back on a copy stream beside the compute:
            `harts_hf.engine.offload`) instead of rerunning their forward in the backward, where the cost model
            predicts the copies cost less (`host_byte`). One process or DDP on a GPU; refused on CPU and under FSDP2.
    """

    harts_enable: bool = field(
        default=True,
        metadata={"help": "Run per-token log-probs/entropies on the rows' prefix forest (False: the stock trainer)."},
    )
    harts_max_tokens_per_microbatch: int = field(
        default=DEFAULT_MAX_TOKENS,
        metadata={"help": "Microbatch budget: the memory of this many tokens (context priced by the memory model)."},
    )
    harts_max_bytes_per_microbatch: float | None = field(
        default=None,
        metadata={"help": "Microbatch budget in bytes of activations (replaces harts_max_tokens_per_microbatch)."},
    )
    harts_chunk_size: int = field(
        default=CHUNK_SIZE,
        metadata={"help": "Chunk grid of the linear-attention kernels (planner cut alignment)."},
    )
    harts_cost_model: dict[str, float] | str | None = field(
        default=None,
        metadata={"help": "Planner cost model {token, pair, round, microbatch} in seconds (default: built-in)."},
    )

    harts_memory_model: dict[str, float] | str | None = field(
        default=None,
        metadata={"help": "Memory model {token, context, head, head_chunk, fixed, layer} in bytes (default: derived)."},
    )

    harts_handoffs: bool = field(
        default=False,
        metadata={
            "help": "Hand shared chains between ranks instead of recomputing them, where the plan predicts faster."
        },
    )
    harts_context_parallel: bool = field(
        default=False,
        metadata={
            "help": "Split a trajectory above the budget over ranks' spare time, and a shared prompt over the ranks "
            "reading it, where the plan predicts it faster."
        },
    )

    harts_max_host_bytes: float | None = field(
        default=None,
        metadata={
            "help": "Host memory (bytes per rank) for the graphs the budget cannot keep, instead of rerunning them "
            "where the plan predicts it faster (a GPU, one process or DDP)."
        },
    )

    loss_types: ClassVar[tuple[str, ...]] = ()
    """The ``loss_type`` values TRL's trainer computes (TRL 1.16's branches); any other fails at its first step."""

    def __post_init__(self):
        super().__post_init__()
        chosen = getattr(self, "loss_type", ())
        unknown = [t for t in ([chosen] if isinstance(chosen, str) else chosen) if t not in self.loss_types]
        if unknown:
            raise ValueError(f"loss_type {unknown[0]!r} is not one of TRL's: {', '.join(self.loss_types)}")
        if self.harts_max_tokens_per_microbatch <= 0:
            raise ValueError(
                f"harts_max_tokens_per_microbatch must be positive, got {self.harts_max_tokens_per_microbatch}"
            )
        if self.harts_max_bytes_per_microbatch is None and self.harts_max_tokens_per_microbatch < self.harts_chunk_size:
            warnings.warn(
                f"harts_max_tokens_per_microbatch={self.harts_max_tokens_per_microbatch} is below one "
                f"{self.harts_chunk_size}-token chunk: every slot is a model call for a few tokens, mostly overhead "
                f"(raise it to thousands of tokens, or give harts_max_bytes_per_microbatch)",
                stacklevel=2,
            )
        if self.harts_max_bytes_per_microbatch is not None and not self.harts_max_bytes_per_microbatch > 0:
            raise ValueError(
                f"harts_max_bytes_per_microbatch must be positive, got {self.harts_max_bytes_per_microbatch}"
            )
        if self.harts_max_host_bytes is not None and not 0 <= self.harts_max_host_bytes < math.inf:
            raise ValueError(f"harts_max_host_bytes must be a finite number >= 0, got {self.harts_max_host_bytes}")
        if self.harts_chunk_size <= 0:
            raise ValueError(f"harts_chunk_size must be positive, got {self.harts_chunk_size}")
        if isinstance(self.harts_cost_model, str):  # the command line gives JSON
            self.harts_cost_model = json.loads(self.harts_cost_model)
        if isinstance(self.harts_memory_model, str):
            self.harts_memory_model = json.loads(self.harts_memory_model)
        if self.harts_memory_model is not None:
            try:
                MemoryModel(**self.harts_memory_model)  # refused at config time, not at the first step
            except (TypeError, ValueError) as err:
                valid = ", ".join(MemoryModel.__dataclass_fields__)
                raise ValueError(f"harts_memory_model: {err} (its keys: {valid})") from err
        if self.harts_cost_model is not None:
            unknown = set(self.harts_cost_model) - set(DEFAULT_COST_MODEL.as_dict())
            if unknown:
                raise ValueError(
                    f"unknown harts_cost_model keys {sorted(unknown)}; valid: {sorted(DEFAULT_COST_MODEL.as_dict())}"
                )

    @property
    def harts_budget(self) -> dict[str, float]:
        """The planner's budget keyword: ``max_bytes_per_microbatch`` if set, else ``max_tokens_per_microbatch``."""
        if self.harts_max_bytes_per_microbatch is not None:
            return {"max_bytes_per_microbatch": self.harts_max_bytes_per_microbatch}
        return {"max_tokens_per_microbatch": self.harts_max_tokens_per_microbatch}

    @property
    def harts_planner_cost_model(self) -> CostModel:
        """The planner's cost model: the defaults overridden by ``harts_cost_model``."""
        return CostModel(**{**DEFAULT_COST_MODEL.as_dict(), **(self.harts_cost_model or {})})


@dataclass
class HARTSGRPOConfig(HARTSArguments, GRPOConfig):
    r"""
    Configuration class for [`HARTSGRPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the `harts_*` fields of
    [`HARTSArguments`]: each optimizer step's rows, from every rank, are planned at once.
    """

    loss_types: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


@dataclass
class HARTSRLOOConfig(HARTSArguments, RLOOConfig):
    r"""
    Configuration class for [`HARTSRLOOTrainer`]: every [`~trl.RLOOConfig`] field, plus the `harts_*` fields of
    [`HARTSArguments`]: each optimizer step's rows, from every rank, are planned at once.
    """


@dataclass
class HARTSSFTConfig(HARTSArguments, SFTConfig):
    r"""
    Configuration class for [`HARTSSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the `harts_*` fields of
    [`HARTSArguments`]: each microbatch's samples are one forest (their shared prefixes computed once).
    """

    loss_types: ClassVar[tuple[str, ...]] = ("nll", "dft", "chunked_nll")


@dataclass
class HARTSDPOConfig(HARTSArguments, DPOConfig):
    r"""
    Configuration class for [`HARTSDPOTrainer`]: every [`~trl.DPOConfig`] field, plus the `harts_*` fields of
    [`HARTSArguments`]: each microbatch's chosen and rejected rows are one forest (the prompt, in multi-turn DPO the
    whole history, computed once for the pair).
    """

    loss_types: ClassVar[tuple[str, ...]] = (
        "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
        "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
    )  # fmt: skip
