"""Per-trajectory log-probs (and entropies) of a rollout forest from ONE pass over its compact tokens.

The base model runs once over the forest's compact tokens (DFS order, depth positions, the tree
as the ``harts_tree`` kwarg). Every non-root compact token j is one (predictor, target) pair:
``log_softmax(head(h[prev[j]]) / T)[tokens[j]]``. A branch point's hidden state serves each of its
children, each child being its own pair, so no token is duplicated and there are fewer than N
pairs. The LM head runs over the pairs in chunks under activation checkpointing: peak memory
for the head is one chunk of logits, forward and backward, however large the forest. The pairs
are then gathered into TRL's trajectory layout ``[B, max_len - 1]`` (exactly 0 past each row's end).

Legend: N compact tokens, P pairs (non-root compact tokens), B trajectories, V vocabulary, E experts.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..forest import RolloutForest
from ..ops.tree_batch import TreeBatch
from ..schedule import Schedule, Unit
from .adapters import FamilyAdapter
from .errors import UnsupportedModelError
from .moe import expert_load, router_aux_loss
from .registry import patched_adapter
from .tables import model_tables, run_base

__all__ = [
    "HEAD_CHUNK_ELEMENTS",
    "PAIR_STATISTICS",
    "Head",
    "TreeOutput",
    "compile_forest",
    "model_head",
    "run_unit",
    "stochastic_parts",
    "tree_forward",
    "tree_logprobs",
    "validate_router_logits",
]

HEAD_CHUNK_ELEMENTS = 1 << 22  # logits held at once by the chunked head (16 MiB in fp32: a chunk and its
# few fp32 temporaries stay small next to the activations; on CPU smaller chunks were also faster)


@dataclass
class TreeOutput:
    """What one tree pass yields, in trajectory layout where per token.

    Attributes:
        logprobs: [B, max_len - 1] log p(seq_i[t + 1] | seq_i[:t + 1]); 0 past each row's end.
        entropy: [B, max_len - 1] entropy of the distribution predicting column t (when asked).
        aux_loss: the family's router load-balancing loss, weighted by token multiplicity so it
            equals the loss of a padded batch of all trajectories (when asked).
        expert_load: [MoE layers, E] fraction of top-k assignments per expert, weighted the same way.
        is_top1: [B, max_len - 1] whether token t + 1 is the most likely one (when asked; no gradient).
        mean_logits: [B, max_len - 1] the mean of the logits predicting column t (when asked; no gradient).
        log_sum_sq_probs: [B, max_len - 1] log sum_v p_v^2 of that distribution (when asked; no gradient).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def validate_temperature(temperature: float) -> None:
    """Refuse a temperature the logits cannot be divided by (zero, negative, NaN or infinite)."""
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be positive and finite, got {temperature}")


def validate_router_logits(adapter: FamilyAdapter) -> None:
    """Refuse router logits (for the router loss) from a family whose CausalLM computes none."""
    if not adapter.aux_loss:
        raise UnsupportedModelError(f"the {adapter.family} family computes no router load-balancing loss")


def stochastic_parts(hf) -> list[str]:
    """What draws random numbers in ``hf``'s forward: its ``nn.Dropout`` modules with p > 0 and the
    config's functional dropout and router noise (``attention_dropout``, ``router_jitter_noise``, ...);
    empty in eval mode, where none of them acts."""
    if not hf.training:
        return []
    modules = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    noise = [
        name
        for name, value in vars(hf.config).items()
        if re.fullmatch(r"attention_dropout|\w*jitter\w*", name) and isinstance(value, (int, float)) and value > 0
    ]
    return modules + noise


def validate_forest(hf, forest: RolloutForest) -> None:
    """Refuse a forest the model cannot run: no LM head, out-of-vocabulary ids, too long."""
    if not isinstance(forest, RolloutForest):
        raise TypeError(
            f"expected a RolloutForest, got {type(forest).__name__}: build one with RolloutForest.from_sequences"
        )
    head = hf.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(hf).__name__} has no LM head: pass the *ForCausalLM model")
    vocab = min(hf.get_input_embeddings().num_embeddings, head.weight.shape[0])
    top = int(forest.tokens.max())
    if top >= vocab:
        raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab} ids")
    limit = getattr(hf.config, "max_position_embeddings", None)
    if limit is not None and forest.max_length > limit:
        raise ValueError(
            f"the forest's longest trajectory has {forest.max_length} tokens, more than the model's "
            f"max_position_embeddings ({limit})"
        )


PAIR_STATISTICS = ("entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
"""What the head can compute per pair besides the log-prob, as TRL's fused head names them: the
entropy of the predicting distribution (differentiable), whether the target is its most likely
token, the mean of its (temperature-scaled) logits and log sum_v p_v^2 (WPO's weights); the last
three carry no gradient."""


def _head_chunk(
    hidden: torch.Tensor,  # [N, H]
    rows: torch.Tensor,  # [C] predictor index of each pair
    targets: torch.Tensor,  # [C] target token id of each pair
    *,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    statistics: tuple[str, ...],
) -> tuple[torch.Tensor, ...]:
    logits = logits_of(hidden.index_select(0, rows)).float()  # [C, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, targets[:, None])[:, 0]  # [C]
    compute = {
        "entropy": lambda: -(logp.exp() * logp).sum(-1),
        "is_top1": lambda: logits.argmax(-1) == targets,
        "mean_logits": lambda: logits.detach().mean(-1),
        "log_sum_sq_probs": lambda: torch.logsumexp(2 * logp.detach(), -1),
    }
    return chosen, *(compute[name]() for name in statistics)


@dataclass(frozen=True)
class Head:
    """The LM head of a patched model as the pair computation uses it: logits (with the family's
    post-processing) of a few hidden states at a time, ``chunk`` pairs per checkpointed chunk."""

    logits_of: Callable[[torch.Tensor], torch.Tensor]
    chunk: int

    def pair_values(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        statistics: tuple[str, ...] = (),
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """[P] log-probs of the pairs (predictor ``rows`` of ``hidden``, ``targets``) and, by name,
        the [P] :data:`PAIR_STATISTICS` asked for."""
        if unknown := set(statistics) - set(PAIR_STATISTICS):
            raise ValueError(f"unknown pair statistics {sorted(unknown)}; the head computes {PAIR_STATISTICS}")
        fn = functools.partial(_head_chunk, logits_of=self.logits_of, temperature=temperature, statistics=statistics)
        parts: list[list[torch.Tensor]] = [[] for _ in range(1 + len(statistics))]
        for s in range(0, max(rows.numel(), 1), self.chunk):  # no pairs: one empty chunk, still on the graph
            args = (hidden, rows[s : s + self.chunk], targets[s : s + self.chunk])
            out = checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)
            for part, value in zip(parts, out):
                part.append(value)
        stats = {name: torch.cat(part) for name, part in zip(statistics, parts[1:])}
        return torch.cat(parts[0]), stats


def model_head(hf, adapter: FamilyAdapter, head_chunk_tokens: int | None = None) -> Head:
    if head_chunk_tokens is not None and head_chunk_tokens < 1:
        raise ValueError(f"head_chunk_tokens must be a positive number of pairs (or None), got {head_chunk_tokens}")
    head = hf.get_output_embeddings()

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden.to(head.weight.dtype) if adapter.head_cast else hidden)
        return logits if adapter.logits is None else adapter.logits(hf, logits)

    return Head(
        logits_of,
        head_chunk_tokens or max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0]),
    )


def compile_forest(hf, adapter: FamilyAdapter, forest: RolloutForest) -> Schedule:
    """The forest's one-unit schedule, compiled on the host before the model runs."""
    return Schedule.whole(forest, model_tables(hf, adapter), hf.get_output_embeddings().weight.device)


def run_unit(
    hf,
    adapter: FamilyAdapter,
    head: Head,
    unit: Unit,
    batch: TreeBatch,
    temperature: float,
    statistics: tuple[str, ...] = (),
    router: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...] | None]:
    """One model call: the base model over ``unit``'s own tokens (``batch``: its tree, carrying the
    run's handoff where the engine gives one), then the head over its pairs. Returns the [p]
    log-probs, the [p] ``statistics`` by name and, with ``router``, the router logits of every MoE
    layer [n, E]."""
    extra = {"output_router_logits": True} if router else {}
    out = run_base(hf, adapter, unit.input_ids, batch, **extra)
    hidden = out.last_hidden_state[0]  # [N, H]
    lp, stats = head.pair_values(hidden, unit.pair_rows, unit.targets, temperature, statistics)
    return lp, stats, tuple(out.router_logits) if router else None


def tree_forward(
    model: torch.nn.Module,
    forest: RolloutForest,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    output_router_logits: bool = False,
    statistics: tuple[str, ...] = (),
    head_chunk_tokens: int | None = None,
) -> TreeOutput:
    """Run a patched model over ``forest`` once; see :class:`TreeOutput`.

    ``output_router_logits`` adds the MoE router loss and expert load (families whose CausalLM
    computes ``load_balancing_loss_func``), assuming deterministic no-drop routing: a token's
    routing depends only on its own hidden state, so each compact token stands for all of its
    ``multiplicity`` trajectory copies. ``statistics`` adds per-token :data:`PAIR_STATISTICS`
    other than the entropy (TRL's token accuracy, ``logits/*`` metrics, WPO weights), without
    gradient. ``head_chunk_tokens`` overrides the pairs per head chunk.

    In train mode, dropout and router noise draw once per compact token, so trajectories that share a
    prefix share its draw: each trajectory still sees a valid draw (the same expected gradient as
    trajectory-wise training) but the trajectories' noise is correlated. A warning says so (TRL's
    ``disable_dropout=True`` switches dropout off).
    """
    validate_temperature(temperature)
    hf, adapter = patched_adapter(model)
    if noisy := stochastic_parts(hf):
        warnings.warn(
            f"{type(hf).__name__} is in train mode with dropout / router noise ({', '.join(noisy[:3])}): trajectories "
            "that share a prefix share its random draw; call model.eval(), set them to 0 or pass TRL's "
            "disable_dropout=True for draws like trajectory-wise training",
            stacklevel=2,
        )
    validate_forest(hf, forest)
    if output_router_logits:
        validate_router_logits(adapter)
    schedule = compile_forest(hf, adapter, forest)
    (unit,), (layout,) = schedule.units, schedule.rows
    wanted = ("entropy",) * return_entropy + tuple(statistics)
    head = model_head(hf, adapter, head_chunk_tokens)
    lp, stats, routers = run_unit(hf, adapter, head, unit, unit.batch, temperature, wanted, output_router_logits)
    result = TreeOutput(layout(lp), layout(stats.pop("entropy")) if return_entropy else None)
    for name, value in stats.items():
        setattr(result, name, layout(value) > 0 if value.dtype == torch.bool else layout(value))
    if output_router_logits:
        weights = torch.as_tensor(forest.multiplicity, device=lp.device, dtype=torch.float32)  # [N]
        result.aux_loss = router_aux_loss(hf, routers, weights)
        result.expert_load = expert_load(routers, weights, hf.num_experts_per_tok)
    return result


def tree_logprobs(
    model: torch.nn.Module,
    forest: RolloutForest,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory log-probs of ``forest`` under a patched ``model``: [B, max_len - 1], row i
    column t = log p(seq_i[t + 1] | seq_i[:t + 1]), 0 past the row's end, differentiable w.r.t.
    the model's parameters. With ``return_entropy`` also the entropies, same layout."""
    out = tree_forward(model, forest, temperature=temperature, return_entropy=return_entropy)
    return (out.logprobs, out.entropy) if return_entropy else out.logprobs
