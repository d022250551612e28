"""Planning together (``harts_hf.planner.planners``), measured in one process.

The planners run as threads whose gather meets at a barrier; threads of one process contend for
its cores and its interpreter lock, so each sampled planner then plans again alone, its gathers
answered from its record of the threaded run: its CPU seconds are its own share's, what a rank
spends when every rank of the step plans on a host of its own (the gathers' latency aside).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..planner import Plan, Planners, plan

__all__ = ["Together", "differing_fields", "plan_together", "threaded_planners"]


def differing_fields(got: Plan, alone: Plan) -> list[str]:
    """The fields of ``got`` that are not ``alone``'s (its planning time aside): none where planners
    together made the plan one process makes alone."""
    same = lambda a, b: all(map(np.array_equal, a, b)) if isinstance(a, list) else np.array_equal(a, b)
    names = [field.name for field in dataclasses.fields(Plan) if field.name != "plan_seconds"]
    return [name for name in names if not same(getattr(got, name), getattr(alone, name))]


def threaded_planners(count: int) -> list[Planners]:
    """``count`` planners for ``count`` threads of this process, their gather a barrier."""
    barrier, posted = threading.Barrier(count), [None] * count

    def gather(rank: int, obj: object) -> list:
        posted[rank] = obj
        barrier.wait()
        out = list(posted)
        barrier.wait()  # every planner has read this round before the next one posts
        return out

    return [Planners(rank, count, lambda obj, rank=rank: gather(rank, obj)) for rank in range(count)]


@dataclasses.dataclass(frozen=True)
class Together:
    """``plans`` by planner; ``gathers`` each made; ``seconds``: a sampled planner's CPU seconds alone."""

    plans: list[Plan]
    gathers: list[int]
    seconds: dict[int, float]


def plan_together(forests, count: int, sampled: Sequence[int] = (), **options) -> Together:
    """``plan(forests, **options)`` made by ``count`` planners together (module docstring), and the
    CPU seconds of each planner in ``sampled`` alone."""
    records: list[list[list]] = [[] for _ in range(count)]
    plans: list[Plan | None] = [None] * count

    def run(planners: Planners) -> None:
        def gather(obj: object) -> list:
            records[planners.rank].append(out := planners.gather(obj))
            return out

        plans[planners.rank] = plan(forests, planners=Planners(planners.rank, count, gather), **options)

    threads = [threading.Thread(target=run, args=(p,)) for p in threaded_planners(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any(p is None for p in plans):
        raise RuntimeError("a planner failed (its thread's traceback is above)")
    seconds = {}
    for rank in sampled:
        answers = iter(records[rank])
        began = time.thread_time()
        plan(forests, planners=Planners(rank, count, lambda obj, answers=answers: next(answers)), **options)
        seconds[rank] = time.thread_time() - began
    return Together(plans, [len(r) for r in records], seconds)
