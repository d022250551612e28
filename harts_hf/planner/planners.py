"""The processes that plan one step together.

Every rank plans the same step from the same rows, so R ranks planning alone do the same work R
times. Planning together, each makes its share of the relay's candidates (the orders of every
group's branches it cuts: ``sequences.ordered_cuts``, most of the planning at 64 ranks) and the
gathered prices choose, so each plans in a fraction of the time and every one ends with the plan
one process alone would make, bit for bit (a candidate's arithmetic does not depend on which others
are cut beside it). The planner itself stays free of torch.distributed: the trainer passes the
gather (``accelerate.utils.gather_object``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ALONE", "Planners"]


@dataclass(frozen=True)
class Planners:
    """Planner ``rank`` of ``count``; ``gather(obj)`` returns every planner's ``obj`` by rank and is
    called by all of them at once, the same number of times (an all-gather)."""

    rank: int
    count: int
    gather: Callable[[object], list]

    def __post_init__(self):
        if not 0 <= self.rank < self.count:
            raise ValueError(f"Planners: rank {self.rank} is not one of {self.count} planners")

    def check_same(self, inputs: object) -> None:
        """Raise on every planner where any of them plans from other ``inputs`` (a plan's shapes and
        options): their gathers would join candidates of different steps into wrong plans."""
        if self.count == 1:
            return
        everyone = self.gather(inputs)
        if others := [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]:
            raise ValueError(
                f"planners {others} plan a different step from planner 0 (other forests or plan options): every "
                "rank must call plan() with the same forests and arguments"
            )

    def share(self, n: int) -> range:
        """This planner's share of ``n`` candidates: a contiguous run, the shares in rank order
        covering ``range(n)`` once (empty past the n-th planner)."""
        return range(n * self.rank // self.count, n * (self.rank + 1) // self.count)


ALONE = Planners(0, 1, lambda obj: [obj])
"""One process planning by itself."""
