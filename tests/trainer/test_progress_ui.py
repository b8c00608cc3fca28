"""What a person sees: a progress bar in a terminal, JSON lines otherwise; the summary line is the same."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from conftest import job_spec, write_job
from rich.console import Console

from packtrain.core.contract import parse_summary
from packtrain.core.progress import JsonLines, ProgressBar, follow, reporter_for
from packtrain.operator.status import train_progress
from packtrain.trainer.cli import main

# The summary's keys, in order: the operator and `packtrain run` read this line.
SUMMARY_KEYS = [
    "steps",
    "steps_this_run",
    "tokens",
    "effective_tokens",
    "tokens_per_second",
    "effective_tokens_per_second",
    "samples_per_second",
    "padding_ratio",
    "final_loss",
    "eval_loss",
    "eval_units",
    "steps_per_epoch",
    "epochs",
    "model_flops_per_effective_token",
    "mfu",
    "mode",
    "attention",
    "world_size",
    "attention_imbalance_max",
    "resumed_from",
    "final_model",
    "init",
]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _train(pack_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> int:
    monkeypatch.setenv("PACKTRAIN_TERMINATION_LOG", str(tmp_path / "termination.json"))
    spec = job_spec(pack_dir, tmp_path / "run", maxSteps=3, saveFinal=False, checkpointAtEnd=False)
    spec["spec"]["data"]["numWorkers"] = 0
    return main(["train", "-c", str(write_job(tmp_path / "job.yaml", spec)), *flags])


@pytest.fixture(scope="module")
def json_run(pack_dir, tmp_path_factory) -> tuple[list[str], str]:
    """A real 3-step CLI run with its stdout not a terminal (`auto`): its lines and termination message."""
    tmp = tmp_path_factory.mktemp("json")
    with pytest.MonkeyPatch.context() as mp:
        out = StringIO()
        mp.setattr("sys.stdout", out)
        assert _train(pack_dir, tmp, mp) == 0
    return out.getvalue().splitlines(), (tmp / "termination.json").read_text()


def test_not_a_terminal_prints_json_lines_and_the_unchanged_summary_last(json_run):
    lines, termination = json_run
    docs = [json.loads(line) for line in lines]  # every line parses
    assert [d.get("event") for d in docs] == ["start", "step", "step", "step", None]
    assert docs[0]["step"] == 0 and docs[0]["max_steps"] == 3 and docs[0]["attention"] == "sdpa"
    assert [d["step"] for d in docs[1:4]] == [1.0, 2.0, 3.0]
    assert all(d["loss"] > 0 and d["effective_tokens_per_second"] > 0 for d in docs[1:4])
    summary = docs[-1]
    assert list(summary) == SUMMARY_KEYS and summary["steps"] == 3
    # What the operator reads from the termination message is that same summary.
    assert parse_summary(termination) == summary
    assert train_progress(parse_summary(termination), "now")["step"] == 3


def test_json_flag_prints_json_lines_even_on_a_terminal(pack_dir, tmp_path, monkeypatch):
    class Terminal(StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    monkeypatch.setattr("sys.stdout", out)
    assert _train(pack_dir, tmp_path, monkeypatch, "--log-format", "json") == 0
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [d.get("event") for d in docs] == ["start", "step", "step", "step", None]
    assert list(docs[-1]) == SUMMARY_KEYS


def test_a_terminal_shows_a_progress_bar_and_the_summary_line(pack_dir, tmp_path, monkeypatch):
    out = StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setenv("COLUMNS", "120")
    assert _train(pack_dir, tmp_path, monkeypatch, "--log-format", "rich") == 0
    text = ANSI.sub("", out.getvalue())
    assert '{"event"' not in text  # no per-step JSON
    assert "\x1b[" in out.getvalue()  # drawn for a terminal
    assert re.search(r"3/3 loss \d+\.\d{4} [\d,]+ tokens/s ETA", text), text[-2000:]
    assert "training steps 1..3" in text and "attention sdpa" in text and "init random" in text
    summary = json.loads(text.strip().splitlines()[-1])
    assert list(summary) == SUMMARY_KEYS and summary["steps"] == 3
    assert parse_summary((tmp_path / "termination.json").read_text()) == summary


def test_auto_draws_only_on_a_terminal():
    class Terminal(StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(reporter_for("auto", StringIO()), JsonLines)
    assert isinstance(reporter_for("auto", Terminal()), ProgressBar)
    assert isinstance(reporter_for("json", Terminal()), JsonLines)
    assert isinstance(reporter_for("rich", StringIO()), ProgressBar)
    with pytest.raises(ValueError, match="auto, rich, json"):
        reporter_for("text", StringIO())


def test_packtrain_run_draws_the_same_bar_from_the_trainers_json_lines(json_run):
    """`packtrain run` reads the trainer's JSON lines (a pipe, like a pod log) and shows its bar."""
    lines, _ = json_run
    screen = StringIO()
    echoed: list[str] = []
    bar = ProgressBar(Console(force_terminal=True, file=screen, width=120))
    summary = follow((line + "\n" for line in ["torchrun: starting", *lines]), bar, echoed.append)
    assert summary == json.loads(lines[-1])
    assert echoed == ["torchrun: starting", lines[-1]]  # the summary line is shown unchanged
    text = ANSI.sub("", screen.getvalue())
    assert re.search(r"3/3 loss \d+\.\d{4} [\d,]+ tokens/s ETA", text), text
    assert '{"event"' not in text


def test_json_lines_follow_log_every():
    written: list[str] = []
    report = JsonLines(written.append, every=2)
    report.start(0, 4, attention="sdpa")
    for step in range(1, 5):
        report.step({"step": float(step), "loss": 1.0 / 3})
    assert [json.loads(w).get("step") for w in written] == [0, 2.0, 4.0]
    assert json.loads(written[1])["loss"] == 0.333333


# Two processes (as torchrun's ranks) write lines into one pipe for the same second, unbuffered as in a
# container. `print` writes a line's text and its newline separately there: in a trial about 5% of
# lines came out as `{...}{...}`; `write_line` writes each line whole.
SHARED_PIPE_WRITER = """
import sys, time
from packtrain.core.progress import reporter_for
reporter = reporter_for("json", sys.stdout)
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
step = 0
while time.time() < start + 1:
    reporter.step({"step": step, "rank": int(sys.argv[1]), **{f"metric_{i}": 0.5 for i in range(12)}})
    step += 1
"""


def test_json_lines_of_processes_sharing_a_pipe_stay_whole_when_python_runs_unbuffered():
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = str(time.time() + 5)  # both have imported by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARED_PIPE_WRITER, str(rank), start], stdout=write_end, env=env
        )
        for rank in (0, 1)
    ]
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        lines = pipe.read().splitlines()
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    steps: dict[int, list[int]] = {0: [], 1: []}
    for line in lines:
        record = json.loads(line)
        steps[int(record["rank"])].append(int(record["step"]))
    for rank_steps in steps.values():
        assert len(rank_steps) > 100 and rank_steps == list(range(len(rank_steps)))
