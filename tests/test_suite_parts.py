"""The suite's split between `.ci/run`'s two pytest processes (`support/suite_parts.py`), run on a
small suite of its own: each test once, each module whole in one process, the cluster part's tests in
the cluster part, and the rest shared out when both processes name one claim folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"

CONFTEST = """
import pytest
pytest_plugins = ["suite_parts"]

@pytest.fixture
def kube_cluster():
    return "a control plane"
"""

MODULE = """
import json, os, time
import pytest

@pytest.fixture(scope="module")
def started():
    return os.getpid()

@pytest.mark.parametrize("n", range({tests}))
def test_it({fixture}started, n):
    time.sleep({sleep})
    assert started == os.getpid()
    with open({log!r}, "a") as f:
        f.write(json.dumps([os.getpid(), __name__, n]) + "\\n")
"""


def _suite(root: Path, log: Path) -> None:
    (root / "conftest.py").write_text(CONFTEST)
    for i in range(2):
        (root / f"test_cluster_{i}.py").write_text(
            MODULE.format(tests=2, fixture="kube_cluster, ", sleep=0.0, log=str(log))
        )
    for i in range(8):
        (root / f"test_rest_{i}.py").write_text(MODULE.format(tests=3, fixture="", sleep=0.2, log=str(log)))


def _pytest(root: Path, *args: str) -> subprocess.Popen[str]:
    env = os.environ | {"PYTHONPATH": str(SUPPORT)}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _ran(log: Path) -> list[tuple[int, str, int]]:
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


def test_two_processes_sharing_a_claim_folder_run_each_test_once_and_each_module_whole(
    tmp_path: Path,
) -> None:
    root, log, claims = tmp_path / "suite", tmp_path / "ran.jsonl", tmp_path / "claims"
    root.mkdir()
    _suite(root, log)
    # One token each (`--share=DIR`): pytest reads its arguments once before the conftest adds these
    # options, and a separate DIR that exists would be taken for a test path.
    claims.mkdir()
    rest = _pytest(root, "--part=rest", f"--share={claims}")
    cluster = _pytest(root, "--part=cluster", f"--share={claims}")
    outputs = {name: p.communicate(timeout=300)[0] for name, p in (("rest", rest), ("cluster", cluster))}
    assert rest.returncode == 0 and cluster.returncode == 0, outputs
    ran = _ran(log)
    assert sorted((module, n) for _, module, n in ran) == sorted(
        [(f"test_cluster_{i}", n) for i in range(2) for n in range(2)]
        + [(f"test_rest_{i}", n) for i in range(8) for n in range(3)]
    )
    by_module: dict[str, set[int]] = {}
    for pid, module, _ in ran:
        by_module.setdefault(module, set()).add(pid)
    assert all(len(pids) == 1 for pids in by_module.values()), by_module
    assert {by_module[f"test_cluster_{i}"].pop() for i in range(2)} == {cluster.pid}
    rest_pids = {next(iter(by_module[f"test_rest_{i}"])) for i in range(8)}
    assert rest_pids == {rest.pid, cluster.pid}, "the cluster part, done first, takes on rest modules"
    assert sorted(p.name for p in claims.iterdir()) == sorted(f"test_rest_{i}.py" for i in range(8))
    assert "shared modules: this process ran" in outputs["cluster"]


def test_without_a_claim_folder_each_part_runs_all_of_its_own(tmp_path: Path) -> None:
    root, log = tmp_path / "suite", tmp_path / "ran.jsonl"
    root.mkdir()
    _suite(root, log)
    for part, modules, deselected in (("cluster", 2, "24 deselected"), ("rest", 8, "4 deselected")):
        log.unlink(missing_ok=True)
        proc = _pytest(root, f"--part={part}")
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0 and deselected in out, out
        assert {module for _, module, _ in _ran(log)} == {f"test_{part}_{i}" for i in range(modules)}


def test_each_process_writes_what_each_module_cost_and_the_run_merges_them(tmp_path: Path) -> None:
    root, log, claims = tmp_path / "suite", tmp_path / "ran.jsonl", tmp_path / "claims"
    root.mkdir()
    _suite(root, log)
    claims.mkdir()
    procs = {
        part: _pytest(root, f"--part={part}", f"--share={claims}", f"--module-costs={tmp_path / part}.json")
        for part in ("rest", "cluster")
    }
    for proc in procs.values():
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, out
    merged = tmp_path / "merged.json"
    parts = [str(tmp_path / f"{part}.json") for part in procs]
    done = subprocess.run(
        [sys.executable, str(SUPPORT / "suite_parts.py"), str(merged), *parts], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    costs = json.loads(merged.read_text())
    modules = [f"test_cluster_{i}.py" for i in range(2)] + [f"test_rest_{i}.py" for i in range(8)]
    assert sorted(costs) == sorted(modules)
    # Three tests of 0.2 s each: the wall seconds are whole seconds, rounded.
    assert all(costs[f"test_rest_{i}.py"]["wall_s"] in (0, 1) for i in range(8))
    assert "10 modules" in done.stdout and "the 15 that took the most CPU" in done.stdout


def test_shared_modules_go_longest_first_and_those_waiting_for_a_late_build_near_the_end() -> None:
    sys.path.insert(0, str(SUPPORT))
    try:
        from suite_parts import longest_first
    finally:
        sys.path.remove(str(SUPPORT))

    class Item:
        def __init__(self, nodeid: str, *fixturenames: str) -> None:
            self.nodeid, self.fixturenames = nodeid, fixturenames

    items = [
        Item("a.py::t1"), Item("a.py::t2"), Item("late.py::t", "e2e_images"), Item("b.py::t"),
        Item("new.py::t"), Item("c.py::t1"), Item("c.py::t2"),
    ]  # fmt: skip
    seconds = {"a.py": 10.0, "b.py": 300.0, "c.py": 40.0, "late.py": 900.0}

    def order(slack: float) -> list[str]:
        return [item.nodeid for item in longest_first(items, seconds, slack)]  # type: ignore[arg-type]

    # new.py was never measured: it counts as the median module (170 s, between c.py and b.py). The late
    # module goes where at least `slack` seconds of the others are still to come.
    assert order(50) == ["b.py::t", "new.py::t", "late.py::t", "c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2"]
    assert order(0) == ["b.py::t", "new.py::t", "c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2", "late.py::t"]
    assert order(10_000)[0] == "late.py::t"
