"""``tests/test_kept_graphs.py``'s memory measurement, in a process of its own (torchrun, one
process): with the quick qwen3_5's measured memory model, budgets of 1, 2 and 3 microbatches keep 1,
2 and 3 graphs, and the measured peak of each step stays within the prediction, below the budget."""

from __future__ import annotations

from test_engine import prompt_groups
from test_kept_graphs import with_budget

from harts_hf import patch_model, plan
from harts_hf.engine import TreeEngine, memory_model
from harts_hf.lab.memory import PeakMemory
from harts_hf.lab.models import build_model
from harts_hf.planner.memory import Budget


def main() -> None:
    model = patch_model(build_model("qwen3_5", "quick").model)
    memory = memory_model(model)
    forest = prompt_groups(4)
    one = plan(forest, world_size=1, max_tokens_per_microbatch=forest.num_compact_tokens // 5, memory_model=memory)
    assert one.num_slots == 6
    n, c = one.tokens[0].astype(float), one.context[0].astype(float)
    saved = memory.token * n + memory.context * c
    phases = one.peak_bytes[0] - saved
    for kept in (1, 2, 3):
        the_plan = with_budget(one, Budget(one.budget.tokens * kept, one.budget.context_weight))
        engine = TreeEngine(model, forest, the_plan)
        assert engine.schedule.graph_calls() == kept
        with PeakMemory("cpu") as measured:
            engine.backward(lambda lps: lps[0].sum())
        predicted = saved[-kept:].sum() + phases[-kept:].max()
        assert measured.peak_bytes <= predicted <= memory(the_plan.budget.tokens), (
            kept,
            measured.peak_bytes,
            predicted,
        )
        print(
            f"{kept} kept graphs: measured {measured.peak_bytes / 2**20:.0f} MiB, predicted {predicted / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
