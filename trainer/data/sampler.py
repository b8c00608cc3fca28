"""The epoch plan: which units each rank trains at each step, and where a resumed run restarts.

Everything about order lives here, as pure functions of the pack's sub-sample
lengths and the job's layout; `data.PackedDataset` only serves the rows it is told.

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
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from packtrain.core.errors import ConfigError

Plan = list[list[list[int]]]  # steps x ranks x unit indices


class PackTooSmall(ConfigError):
    """The pack holds less than one global step: more data, or a smaller batch, fixes it."""


Unit = tuple[int, int]  # (sequence, sub-sample); sub-sample -1 = the whole packed sequence


def attention_cost(seq_lens: Sequence[int]) -> int:
    """Σ of squared sub-sample lengths: the attention work of one packed sequence."""
    return sum(int(n) * int(n) for n in seq_lens)


def units_and_costs(
    seq_lens: Sequence[Sequence[int]], mode: str, sequences: Sequence[int] | None = None
) -> tuple[list[Unit], list[int]]:
    """The units of work and their attention costs: whole packed sequences (packed mode) or each
    sub-sample on its own (the padded baseline), over `sequences` (default: all of them)."""
    chosen = range(len(seq_lens)) if sequences is None else sequences
    if mode == "packed":
        return [(s, -1) for s in chosen], [attention_cost(seq_lens[s]) for s in chosen]
    if mode == "padded":
        units = [(s, k) for s in chosen for k in range(len(seq_lens[s]))]
        return units, [int(seq_lens[s][k]) ** 2 for s, k in units]
    raise ValueError(f"mode must be packed or padded, not {mode!r}")


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


def check_fits(num_units: int, world_size: int, units_per_rank: int) -> None:
    per_step = world_size * units_per_rank
    if num_units < per_step:
        raise PackTooSmall(
            f"the pack holds {num_units} units but one global step needs {per_step} "
            f"({world_size} ranks x {units_per_rank}); pack more data or shrink the batch"
        )


def plan_epoch(
    costs: Sequence[int], world_size: int, units_per_rank: int, seed: int, epoch: int, window: int = 8
) -> Plan:
    """The whole epoch's assignment: steps x ranks x units; an incomplete last step is dropped."""
    check_fits(len(costs), world_size, units_per_rank)
    per_step = world_size * units_per_rank
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


# -- one job's layout and its resume position ---------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """What fixes the order of a job's epochs: a saved position is only valid under the same layout."""

    seed: int
    world_size: int
    units_per_micro_batch: int
    grad_accum: int
    mode: str
    num_units: int

    @property
    def units_per_rank(self) -> int:
        """Units one rank takes per optimizer step."""
        return self.units_per_micro_batch * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch (the same for every epoch: only the order changes)."""
        return self.num_units // (self.world_size * self.units_per_rank)

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches one rank trains in an epoch."""
        return self.steps_per_epoch * self.grad_accum


class Position(NamedTuple):
    """The next micro-batch of this rank to train: its epoch and its index in that epoch."""

    epoch: int = 0
    next: int = 0


def rank_micro_batches(plan: Plan, rank: int, layout: Layout) -> list[list[int]]:
    """Rank `rank`'s micro-batches (unit indices) of a planned epoch, in training order: its share of
    each step, cut into `grad_accum` consecutive micro-batches."""
    n = layout.units_per_micro_batch
    return [step[rank][i * n : (i + 1) * n] for step in plan for i in range(layout.grad_accum)]


def after(layout: Layout, epoch: int, index: int) -> Position:
    """The position once micro-batch `index` of `epoch` has been trained: the next one, or the
    start of the next epoch."""
    if index + 1 >= layout.micro_batches_per_epoch:
        return Position(epoch + 1, 0)
    return Position(epoch, index + 1)


def position_state(layout: Layout, position: Position) -> dict[str, Any]:
    """A checkpoint's record of the position, with the layout it is valid for."""
    return {"epoch": position.epoch, "next": position.next, **asdict(layout)}


def resume_position(layout: Layout, state: dict[str, Any]) -> Position:
    """The position saved by `position_state`; refuses a checkpoint made under another layout, whose
    position would name other units."""
    for key, mine in asdict(layout).items():
        if state[key] != mine:
            raise ValueError(f"cannot resume: checkpoint has {key}={state[key]!r}, this run {mine!r}")
    return Position(int(state["epoch"]), int(state["next"]))


def total_steps(max_steps: int | None, epochs: int | None, layout: Layout, default: int) -> int:
    """The run's optimizer steps: `max_steps`, else `epochs` whole epochs of `layout`, else `default`."""
    if max_steps is not None:
        return max_steps
    if epochs is not None:
        return epochs * layout.steps_per_epoch
    return default


# -- the evaluation set ---------------------------------------------------------------------------


def carve_eval(num_sequences: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, evaluation) sequence indices: a seeded share `fraction` of the pack held out, at
    least one sequence when `fraction` > 0. Disjoint, sorted, and the same for every rank and rerun."""
    if fraction <= 0:
        return list(range(num_sequences)), []
    held = max(1, round(num_sequences * fraction))
    if held >= num_sequences:
        raise ValueError(
            f"data.evalFraction {fraction} holds out all {num_sequences} sequences of the pack: lower it"
        )
    order = list(range(num_sequences))
    random.Random(f"{seed}:eval").shuffle(order)
    return sorted(order[held:]), sorted(order[:held])


def eval_micro_batches(
    num_units: int, world_size: int, rank: int, units_per_micro_batch: int
) -> tuple[list[list[int]], int]:
    """Rank `rank`'s evaluation micro-batches and how many of them count.

    Units go round-robin to the ranks, so every unit is evaluated exactly once over all ranks. Every
    rank runs the same number of forwards (FSDP gathers parameters in each, and DDP syncs buffers):
    a rank with fewer repeats its first micro-batch, and only the first `counted` enter the loss."""
    if num_units < world_size:
        raise ValueError(
            f"the evaluation set holds {num_units} units but there are {world_size} ranks: "
            "use a larger evaluation set (or data.evalFraction)"
        )
    mine = list(range(rank, num_units, world_size))
    n = units_per_micro_batch
    batches = [mine[i : i + n] for i in range(0, len(mine), n)]
    most = -(-((num_units + world_size - 1) // world_size) // n)
    return batches + [batches[0]] * (most - len(batches)), len(batches)
