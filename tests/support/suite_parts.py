"""How `.ci/run` splits the suite between its two pytest processes (a pytest plugin).

`--part cluster` runs every test that needs a local control plane (the shared one, or an end-to-end
one whose pods share this machine's network) or the built images, one at a time; `--part rest` runs
the others. Each part runs last the modules that need more than the control plane itself (the
add-ons, the GitOps engine, the images), which `.ci/run` is still building when the first tests start.

`--share DIR` shares the rest's modules out while the run goes: whenever a process needs more work it
claims the next module nobody has claimed yet (a file created with O_EXCL in DIR), so the cluster part,
once its own tests are done, takes on rest modules instead of idling beside the rest part (and
`.ci/run` starts a second rest process once its builds are done, to fill the cores the end-to-end tests
leave idle while they wait on pods). A module always runs whole in one process, so its module-scoped
fixtures start once. Shared modules are handed out longest first, by the seconds each took in a past
run (`module_seconds.json` beside this file), those waiting for a late build a little before the
end: the run then ends on short modules, not on one process alone with a long one.

`--module-costs FILE` writes the wall and CPU seconds (its own and its waited-for children's) each
module took in this process; `python tests/support/suite_parts.py OUT FILE...` merges those of a
run's processes into OUT (`.ci/run` refreshes `module_seconds.json` so) and prints the costliest.

Give each as one token (`--part=rest --share=DIR`): pytest reads the command line once before this
plugin adds the options, and a DIR that already exists would then be taken for a test path.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

CLUSTER_FIXTURES = ("kube_cluster", "e2e", "built_images", "prometheus_tools")
# `e2e_images` (the quickstart inside the images) is a rest test: it runs beside the cluster part's
# control planes, last, once the images and the control plane are built.
LATE_FIXTURES = ("e2e", "built_images", "prometheus_tools", "e2e_images")

MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
# How many measured module seconds of other work still follow the shared modules that wait for a late
# build: in a cold run they are then claimed minutes after their build is done and minutes before
# the end (a module's seconds were measured beside the other processes).
LATE_SLACK_S = 900.0

_SHARED = pytest.StashKey[set[str]]()  # node ids of the tests handed out by claim
_COSTS = pytest.StashKey[dict[str, list[float]]]()  # module -> [wall s, CPU s] in this process
_RAN = pytest.StashKey[tuple[int, int]]()  # (modules this process claimed, modules shared)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=("cluster", "rest"),
        default=None,
        help="run only the tests that need a control plane or the images (cluster), or only the others "
        "(rest) (default: all)",
    )
    parser.addoption(
        "--share",
        metavar="DIR",
        default=None,
        help="with --part: hand out the rest's modules to whichever process asks first, claimed in DIR "
        "(both processes name the same DIR); the cluster part takes them on once its own tests are done",
    )
    parser.addoption(
        "--module-costs",
        metavar="FILE",
        default=None,
        help="write the wall and CPU seconds each module took in this process to FILE (JSON)",
    )


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _late_modules(items: list[pytest.Item]) -> set[str]:
    """The modules with a test that needs a late build."""
    return {_module(item) for item in items if any(name in _fixtures(item) for name in LATE_FIXTURES)}


def late_modules_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with every module that has a test needing a late build after the others, each module
    kept whole (a module-scoped control plane starts once) and otherwise in collection order."""
    late = _late_modules(items)
    return sorted(items, key=lambda item: _module(item) in late)


def past_seconds(path: Path = MODULE_SECONDS) -> dict[str, float]:
    """Each module's wall seconds in the run `path` was written from (none when it is absent)."""
    try:
        costs = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {module: float(cost["wall_s"]) for module, cost in costs.items()}


def longest_first(
    items: list[pytest.Item], seconds: dict[str, float], slack: float = LATE_SLACK_S
) -> list[pytest.Item]:
    """`items` module by module (each kept whole), the longest first: a module not yet measured
    counts as the median one. The modules that wait for a late build go where `slack` seconds of the
    others are still to come: not first, while their build may still be going (the process would wait
    on it), and not last, where one process would end the run alone on a long module."""
    late = _late_modules(items)
    unknown = statistics.median(seconds.values()) if seconds else 0.0
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(_module(item), []).append(item)
    order = sorted(groups, key=lambda module: -seconds.get(module, unknown))
    others = [module for module in order if module not in late]
    cut, left = len(others), 0.0
    while cut > 0 and left < slack:
        cut -= 1
        left += seconds.get(others[cut], unknown)
    placed = others[:cut] + [module for module in order if module in late] + others[cut:]
    return [item for module in placed for item in groups[module]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.getoption("part")
    if part is None:
        return
    cluster, rest = [], []
    for item in items:
        (cluster if any(name in _fixtures(item) for name in CLUSTER_FIXTURES) else rest).append(item)
    share = config.getoption("share") is not None
    own = cluster if part == "cluster" else [] if share else rest
    shared = rest if share else []
    kept = {id(item) for item in own + shared}
    drop = [item for item in items if id(item) not in kept]
    if drop:
        config.hook.pytest_deselected(items=drop)
    config.stash[_SHARED] = {item.nodeid for item in shared}
    items[:] = late_modules_last(own) + longest_first(shared, past_seconds())


def _claim(folder: Path, module: str) -> bool:
    """Whether this process got `module` (nobody had claimed it)."""
    try:
        fd = os.open(folder / module.replace("/", "__"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """pytest's own loop, except that shared modules are run only once claimed; the next module is
    claimed before the last test of the current one runs, so that test's `nextitem` is right (module
    fixtures torn down, session ones kept)."""
    folder = session.config.getoption("share")
    if folder is None:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    if session.config.option.collectonly:
        return True
    Path(folder).mkdir(parents=True, exist_ok=True)
    shared = session.config.stash[_SHARED]
    groups: dict[str, list[pytest.Item]] = {}
    for item in session.items:
        if item.nodeid in shared:
            groups.setdefault(_module(item), []).append(item)
    pending: Iterator[tuple[str, list[pytest.Item]]] = iter(groups.items())
    claimed = 0

    def claim_next() -> list[pytest.Item]:
        nonlocal claimed
        for module, group in pending:
            if _claim(Path(folder), module):
                claimed += 1
                return group
        return []

    todo = deque(item for item in session.items if item.nodeid not in shared)
    if not todo:
        todo.extend(claim_next())
    while todo:
        item = todo.popleft()
        if not todo:
            todo.extend(claim_next())
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=todo[0] if todo else None)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
    session.config.stash[_RAN] = (claimed, len(groups))
    return True


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (subprocesses, torchrun)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    cost = item.config.stash.setdefault(_COSTS, {}).setdefault(_module(item), [0.0, 0.0])
    cost[0] += time.monotonic() - wall
    cost[1] += _cpu_seconds() - cpu


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = session.config.getoption("module_costs")
    if out is not None:
        costs = session.config.stash.get(_COSTS, {})
        Path(out).write_text(json.dumps({m: {"wall_s": w, "cpu_s": c} for m, (w, c) in costs.items()}))


def merge_costs(parts: Sequence[Path]) -> dict[str, dict[str, int]]:
    """The per-process files of one run as one table, whole seconds, in module order."""
    merged: dict[str, dict[str, int]] = {}
    for part in parts:
        for module, cost in json.loads(part.read_text()).items():
            merged[module] = {key: round(value) for key, value in cost.items()}
    return dict(sorted(merged.items()))


def main(argv: Sequence[str]) -> int:
    """`suite_parts.py OUT PART...`: merge a run's `--module-costs` files into OUT and print the
    modules that took the most CPU."""
    if len(argv) < 2:
        print("usage: suite_parts.py OUT PART...", file=sys.stderr)
        return 2
    merged = merge_costs([Path(part) for part in argv[1:]])
    Path(argv[0]).write_text(json.dumps(merged, indent=1) + "\n")
    total = sum(cost["cpu_s"] for cost in merged.values())
    print(f"{len(merged)} modules, {total} CPU-s in all (test processes and the children they waited for)")
    print("the 15 that took the most CPU:")
    for module, cost in sorted(merged.items(), key=lambda kv: -kv[1]["cpu_s"])[:15]:
        print(f"  {cost['cpu_s']:6d} CPU-s {cost['wall_s']:6d} s  {module}")
    return 0


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    ran = config.stash.get(_RAN, None)
    if ran is not None:
        terminalreporter.write_line(
            f"shared modules: this process ran {ran[0]} of {ran[1]} (the other processes ran the rest)"
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
