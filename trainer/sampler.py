"""Deterministic, attention-cost-balanced assignment of packed sequences to ranks.

Packed sequences all hold about the same number of tokens, but attention cost
grows with the square of each sub-sample's length: a sequence holding one
4096-token sample costs far more than one holding sixteen 256-token samples.
Ranks synchronise at every optimizer step, so the slowest rank sets the pace.
`plan_epoch` shuffles an epoch with a seed, cuts it into windows of a few steps
and hands units largest-cost-first to the least-loaded group that still has
room (LPT with equal counts): first to the window's steps, then to each step's
ranks. Balancing over a window rather than a single step spreads the few very
expensive sequences over different steps, which keeps max/mean close to 1 even
with small per-rank batches.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

Plan = list[list[list[int]]]  # steps x ranks x unit indices


def attention_cost(seq_lens: Sequence[int]) -> int:
    """Σ of squared sub-sample lengths: the attention work of one packed sequence."""
    return sum(int(n) * int(n) for n in seq_lens)


def epoch_order(num_units: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_units))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def balance_step(units: Sequence[int], costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Split units into `world_size` equal-count groups with balanced total cost."""
    if len(units) % world_size:
        raise ValueError(f"{len(units)} units do not split evenly over {world_size} ranks")
    per_rank = len(units) // world_size
    rank_of_position = sorted(range(len(units)), key=lambda i: (-costs[units[i]], i))
    loads = [0] * world_size
    groups: list[list[int]] = [[] for _ in range(world_size)]
    for i in rank_of_position:
        open_ranks = [r for r in range(world_size) if len(groups[r]) < per_rank]
        r = min(open_ranks, key=lambda r: (loads[r], r))
        groups[r].append(i)
        loads[r] += costs[units[i]]
    # Keep the shuffled order inside a rank, so micro-batch order stays random.
    return [[units[i] for i in sorted(g)] for g in groups]


def plan_epoch(
    costs: Sequence[int], world_size: int, units_per_rank: int, seed: int, epoch: int, window: int = 8
) -> Plan:
    """The whole epoch's assignment: steps x ranks x units; an incomplete last step is dropped."""
    per_step = world_size * units_per_rank
    if len(costs) < per_step:
        raise ValueError(
            f"the pack holds {len(costs)} units but one global step needs {per_step} "
            f"({world_size} ranks x {units_per_rank}); pack more data or shrink the batch"
        )
    order = epoch_order(len(costs), seed, epoch)
    steps = len(order) // per_step
    plan: Plan = []
    for first in range(0, steps, window):
        n = min(window, steps - first)
        # First spread the window's cost evenly over its steps, then over the ranks of each step.
        steps_units = balance_step(order[first * per_step : (first + n) * per_step], costs, n)
        plan.extend(balance_step(units, costs, world_size) for units in steps_units)
    return plan


def imbalance(plan: Plan, costs: Sequence[int]) -> dict[str, float]:
    """Max/mean rank cost per step, summarised over the plan (1.0 = perfectly balanced)."""
    ratios = []
    for step in plan:
        loads = [sum(costs[u] for u in group) for group in step]
        mean = sum(loads) / len(loads)
        ratios.append(max(loads) / mean if mean else 1.0)
    return {"max": max(ratios), "mean": sum(ratios) / len(ratios)}


def contiguous_plan(
    costs: Sequence[int], world_size: int, units_per_rank: int, seed: int, epoch: int
) -> Plan:
    """The unbalanced baseline (consecutive units per rank), to report what balancing saves."""
    order = epoch_order(len(costs), seed, epoch)
    per_step = world_size * units_per_rank
    return [
        [
            order[s * per_step + r * units_per_rank : s * per_step + (r + 1) * units_per_rank]
            for r in range(world_size)
        ]
        for s in range(len(order) // per_step)
    ]
