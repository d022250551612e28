"""SWE-like agentic rollouts: the workload HARTS was evaluated on, synthesised.

An episode (one of G samples of a task) is a Claude-Code-style tool loop. Each turn the model
writes reasoning R, then a tool call C; the environment answers with an observation O. The
context is ``system prompt + task [+ summary] + turns``. The scaffold keeps reasoning inside a
*block* of turns and drops it when the block ends; a block ends after each turn with
probability ``sample_prob``, at the episode's last turn and before a context reset. Each block
is one training sample::

    system | task | [summary] | C O C O ... (earlier blocks, reasoning dropped) | R C O R C O ... R C
                                                                                 \\__ this block __/

so an episode is a caterpillar: a trunk of calls and observations with one side leaf per block.
When the context would exceed ``max_context`` the agent starts afresh with ``system + task +
summary``; the forest merges the shared system prompt and task text. With probability
``fork_prob`` an episode forks at a random turn into a second continuation (a sample branching
into two). Loss masks: R and C of the block are trained; prompts, summaries, observations and
earlier calls are not.

Length distributions at scale 1 (tokens; clipped log-normals, see the constants below): system
prompt + tools 10K (one per workload; real ones are 5K-15K), task 800 median, reasoning 150 median, tool call
220 typical (20-1.5K), observation 300 median (50-3K, heavy tail), summary 800 median; ~64 turns
per episode on average (at most 100). The episode structure (turns, blocks, resets, forks) is drawn
at scale 1; ``scale`` then multiplies every length (at least one token each), so all scales share
one tree shape and nearly the same compression.

Defaults (5 tasks x 8 samples, ``sample_prob`` 0.38, ``max_context`` 32K) give about 1,000
trajectories and ~22M trajectory tokens at scale 1 with a forest compression near the 5.6x of
the HARTS paper's SWE-bench trees (5.49-6.02 over seeds 0-9). :data:`CPU_SCALE` shrinks that to
~22K compact tokens (compression 5.18-5.67: one-token minimums weigh more at small scales).
Everything but the token ids is drawn before them, so rewards, groups and the tree shape do
not depend on ``scale``; nor on ``vocab`` while it is large (with a small one, random first ids of
sibling nodes can collide and merge them).

Legend: E lanes (episodes, then forks), E0 episodes, F forks, T max turns, n samples,
P (sample, turn) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import require_positive_ints, require_probabilities
from .spans import assemble
from .workload import Workload

__all__ = ["CPU_SCALE", "swe_like"]

CPU_SCALE = 0.005
"""Scale at which the default SWE-like workload has ~22K compact tokens (CPU tests, benches)."""


@dataclass(frozen=True)
class _LogNormal:
    """Clipped log-normal token count at scale 1."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator, shape) -> np.ndarray:
        x = self.median * np.exp(self.sigma * rng.standard_normal(shape))
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


TASK = _LogNormal(800, 0.6, 150, 4000)
REASONING = _LogNormal(150, 1.0, 10, 2000)
CALL = _LogNormal(220, 0.8, 20, 1500)
OBSERVATION = _LogNormal(300, 1.1, 50, 3000)
SUMMARY = _LogNormal(800, 0.5, 200, 3000)


def _turn_counts(rng: np.random.Generator, size: int, mean: int, most: int) -> np.ndarray:
    """Clipped normal turn counts: a wide spread and a pile-up at the turn limit, like real agents."""
    return np.clip(np.rint(rng.normal(mean, 0.35 * mean, size)), 4, most).astype(np.int64)


def _blocks(
    lens: np.ndarray,
    summary: np.ndarray,
    end_draw: np.ndarray,
    turns: np.ndarray,
    base: np.ndarray,
    max_context: int,
    sample_prob: float,
) -> dict[str, np.ndarray]:
    """Segment (context reset) and block structure of E episodes, one step per turn.

    Args:
        lens: [E, T, 3] reasoning, call, observation lengths at scale 1.
        summary: [E, T] summary length opening segment s (s >= 1).
        end_draw: [E, T] uniform draws deciding block ends.
        turns: [E] turns of each episode. base: [E] system + task length.

    Returns [E, T] arrays ``seg``, ``seg_start``, ``block_start`` (turn where the block holding
    turn t starts) and bool ``block_end``.
    """
    e, t_max, _ = lens.shape
    rows = np.arange(e)
    out = {k: np.zeros((e, t_max), dtype=np.int64) for k in ("seg", "seg_start", "block_start")}
    block_end = np.zeros((e, t_max), dtype=bool)
    seg = np.zeros(e, dtype=np.int64)
    seg_start = np.zeros(e, dtype=np.int64)
    block_start = np.zeros(e, dtype=np.int64)
    trunk = base.copy()  # [E] context without the open block's reasoning
    open_r = np.zeros(e, dtype=np.int64)  # [E] reasoning of the open block
    for t in range(t_max):
        r, c, o = lens[:, t, 0], lens[:, t, 1], lens[:, t, 2]
        live = t < turns
        reset = live & (t > seg_start) & (trunk + open_r + r + c > max_context)
        block_end[reset, t - 1] = True
        seg += reset
        seg_start = np.where(reset, t, seg_start)
        block_start = np.where(reset, t, block_start)
        trunk = np.where(reset, base + summary[rows, seg], trunk)
        open_r = np.where(reset, 0, open_r)
        out["seg"][:, t], out["seg_start"][:, t], out["block_start"][:, t] = seg, seg_start, block_start
        trunk += c + o
        open_r += r
        end = live & ((end_draw[:, t] < sample_prob) | (t == turns - 1))
        block_end[:, t] |= end
        open_r = np.where(end, 0, open_r)
        block_start = np.where(end, t + 1, block_start)
    out["block_end"] = block_end
    return out


@dataclass
class _Lanes:
    """Episodes then forks ("lanes"): scale-1 lengths and block structure, all [E, T] unless noted."""

    task: np.ndarray  # [E] task of each lane
    parent: np.ndarray  # [F] episode each fork copies (fork f is lane E0 + f)
    first_turn: np.ndarray  # [E] first turn a lane owns (0, or a fork's fork turn)
    turns: np.ndarray  # [E]
    lens: np.ndarray  # [E, T, 3] reasoning, call, observation
    summary: np.ndarray  # summary opening segment s, at column s
    summary_shared: np.ndarray  # bool: a fork's summary that is its parent's
    copied: np.ndarray  # bool: a fork's block end that is also its parent's (same sample)
    seg: np.ndarray
    seg_start: np.ndarray
    block_start: np.ndarray
    block_end: np.ndarray


def _lanes(
    rng: np.random.Generator,
    base: np.ndarray,
    group_size: int,
    turns_mean: int,
    turns_max: int,
    max_context: int,
    sample_prob: float,
    fork_prob: float,
) -> _Lanes:
    """Draw G episodes per task (``base`` [tasks]: system + task length), then their forks.

    A fork copies its parent's first f turns (and the summaries of segments opened before f),
    so both share that prefix in the forest, and draws its own turns from f on.
    """
    task = np.repeat(np.arange(base.size), group_size)  # [E0]
    e0, t_max = task.size, turns_max

    def draw(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lens = np.stack([d.draw(rng, (count, t_max)) for d in (REASONING, CALL, OBSERVATION)], axis=2)
        summary = SUMMARY.draw(rng, (count, t_max))
        return _turn_counts(rng, count, turns_mean, turns_max), lens, summary, rng.random((count, t_max))

    turns, lens, summary, end_draw = draw(e0)
    main = _blocks(lens, summary, end_draw, turns, base[task], max_context, sample_prob)

    parent = np.flatnonzero((rng.random(e0) < fork_prob) & (turns >= 2))  # [F]
    fork_at = rng.integers(1, turns[parent])
    f_turns, f_lens, f_summary, f_draw = draw(parent.size)
    f_turns = np.maximum(f_turns, fork_at + 1)
    col = np.arange(t_max)[None, :]
    before = col < fork_at[:, None]  # [F, T]
    f_lens = np.where(before[..., None], lens[parent], f_lens)
    f_draw = np.where(before, end_draw[parent], f_draw)
    shared_summary = col <= main["seg"][parent, fork_at - 1][:, None]
    f_summary = np.where(shared_summary, summary[parent], f_summary)
    forks = _blocks(f_lens, f_summary, f_draw, f_turns, base[task[parent]], max_context, sample_prob)

    no = np.zeros((e0, t_max), dtype=bool)
    return _Lanes(
        task=np.r_[task, task[parent]],
        parent=parent,
        first_turn=np.r_[np.zeros(e0, dtype=np.int64), fork_at],
        turns=np.r_[turns, f_turns],
        lens=np.concatenate([lens, f_lens]),
        summary=np.concatenate([summary, f_summary]),
        summary_shared=np.concatenate([no, shared_summary]),
        copied=np.concatenate([no, before & main["block_end"][parent]]),
        **{k: np.concatenate([main[k], forks[k]]) for k in main},
    )


def _scaled(x, scale: float) -> np.ndarray:
    """Token counts at ``scale``, at least one token each."""
    return np.maximum(1, np.rint(np.asarray(x) * scale)).astype(np.int64)


def _allocate(sizes: np.ndarray, start: int) -> tuple[np.ndarray, int]:
    """Consecutive pool offsets for ``sizes`` (any shape) from ``start``; returns the next free offset."""
    flat = sizes.ravel()
    off = start + np.cumsum(flat) - flat
    return off.reshape(sizes.shape), start + int(flat.sum())


def swe_like(
    scale: float = 1.0,
    seed: int = 0,
    *,
    num_tasks: int = 5,
    group_size: int = 8,
    turns_mean: int = 64,
    turns_max: int = 100,
    system_len: int = 10_000,
    max_context: int = 32768,
    sample_prob: float = 0.38,
    fork_prob: float = 0.1,
    vocab: int = 32000,
) -> Workload:
    """SWE-bench-like agent rollouts (see the module docstring for the model and defaults).

    Args:
        scale: multiplies every token length (structure is drawn at scale 1); see CPU_SCALE.
        num_tasks, group_size: tasks, and episodes (GRPO samples) per task.
        turns_mean, turns_max: turns per episode.
        system_len: system prompt + tool definitions (scale 1), shared by every task.
        max_context: context length (scale 1) above which the agent resets its context.
        sample_prob: probability that a turn ends a block (one training sample per block).
        fork_prob: probability that an episode forks into a second continuation.
        vocab: token ids are drawn from [0, vocab).
    Returns a Workload whose groups are task ids and whose rewards are per episode (0/1).
    """
    if not 0 < scale < np.inf:  # NaN fails too
        raise ValueError(f"swe_like: scale must be positive and finite, got {scale}")
    require_positive_ints(
        "swe_like",
        num_tasks=num_tasks,
        group_size=group_size,
        turns_mean=turns_mean,
        turns_max=turns_max,
        system_len=system_len,
        max_context=max_context,
        vocab=vocab,
    )
    require_probabilities("swe_like", sample_prob=sample_prob, fork_prob=fork_prob)
    rng = np.random.default_rng(seed)
    task_len = TASK.draw(rng, num_tasks)
    ln = _lanes(rng, system_len + task_len, group_size, turns_mean, turns_max, max_context, sample_prob, fork_prob)
    solve_rate = rng.random(num_tasks)
    reward = (rng.random(ln.turns.size) < solve_rate[ln.task]).astype(np.float64)  # [E] per episode
    e0, lanes, t_max = num_tasks * group_size, ln.turns.size, turns_max
    col = np.arange(t_max)[None, :]

    # Pool ranges at this scale: system, tasks, summaries, turns; forks reuse their parent's.
    lens = _scaled(ln.lens, scale)  # [E, T, 3]
    summary = _scaled(ln.summary, scale)  # [E, T]
    task_s = _scaled(task_len, scale)  # [tasks]
    system_s = int(_scaled(system_len, scale))
    turn_shared = col < ln.first_turn[:, None]  # [E, T] (never for an episode: first_turn 0)
    turn_owned = (col < ln.turns[:, None]) & ~turn_shared
    last_seg = ln.seg[np.arange(lanes), ln.turns - 1]
    summary_owned = (col >= 1) & (col <= last_seg[:, None]) & ~ln.summary_shared
    task_off, nxt = _allocate(task_s, system_s)
    sum_off, nxt = _allocate(np.where(summary_owned, summary, 0), nxt)
    turn_off, nxt = _allocate(np.where(turn_owned[..., None], lens, 0), nxt)
    sum_off[e0:] = np.where(ln.summary_shared[e0:], sum_off[ln.parent], sum_off[e0:])
    turn_off[e0:] = np.where(turn_shared[e0:, :, None], turn_off[ln.parent], turn_off[e0:])
    pool = rng.integers(0, vocab, nxt)

    # One sample per block end (lane, b): heads, then turns seg_start..b of its segment.
    lane, b = np.nonzero(ln.block_end & (col < ln.turns[:, None]) & ~ln.copied)  # [n]
    n = lane.size
    s0, a, sg, task = ln.seg_start[lane, b], ln.block_start[lane, b], ln.seg[lane, b], ln.task[lane]
    head_start = np.stack([np.zeros(n, dtype=np.int64), task_off[task], sum_off[lane, sg]], axis=1)
    head_len = np.stack([np.full(n, system_s), task_s[task], np.where(sg > 0, summary[lane, sg], 0)], axis=1)
    count = b - s0 + 1
    ts = np.repeat(np.arange(n), count)  # [P] sample of each (sample, turn)
    j = s0[ts] + np.arange(ts.size) - np.repeat(np.cumsum(count) - count, count)  # [P] turn
    in_block = j >= a[ts]
    keep = np.stack([in_block, np.ones_like(in_block), j < b[ts]], axis=1)  # [P, 3] R, C, O
    trained = np.stack([in_block, in_block, np.zeros_like(in_block)], axis=1)
    seqs, masks = assemble(
        pool,
        np.r_[np.repeat(np.arange(n), 3), np.repeat(ts, 3)],
        np.r_[head_start.ravel(), turn_off[lane[ts], j].ravel()],
        np.r_[head_len.ravel(), np.where(keep, lens[lane[ts], j], 0).ravel()],
        np.r_[np.zeros(3 * n, dtype=bool), trained.ravel()],
        n,
    )
    return Workload("swe-like", seqs, masks, reward[lane], task.astype(np.int64))
