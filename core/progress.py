"""What a person sees while a run trains: a progress bar in a terminal, JSON lines otherwise.

The trainer reports through a `Reporter`: `start` (where the run begins, how far it goes, which
attention backend it chose), `event` (resumed, ...), `step` (each finished step's recorded
metrics), `close`. `JsonLines` writes one JSON object per line, for logs and for the pods
(`--log-format json`); `ProgressBar` draws step/steps, loss, tokens/s and ETA with rich. `follow`
replays a trainer's JSON lines into any reporter, so `packtrain run` draws the same bar from the
trainer it starts (in the core: the trainer draws it and the operator's `packtrain run` follows it).
The final summary line is printed by the entry point, in every format.
Torch-free: the operator's local runner imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from packtrain.core.contract import parse_summary
from packtrain.core.report import write_line

LOG_FORMATS = ("auto", "rich", "json")
METRICS_ANY_PORT = "PACKTRAIN_METRICS_ANY_PORT"
"""Environment variable: "1" lets the trainer serve /metrics on a free port when its own is taken
(`packtrain run` sets it; a pod's port is the one the operator scrapes, so there a taken one is exit 2)."""
METRICS_PORT_EVENT = "metrics_port"  # the event saying so: {"wanted": port, "port": the one served}


class Reporter(Protocol):
    def start(self, step: int, max_steps: int, **facts: Any) -> None: ...
    def event(self, name: str, **fields: Any) -> None: ...
    def step(self, record: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def rounded(record: dict[str, float]) -> dict[str, float]:
    """Six significant digits: enough for a log, short enough to read."""
    return {k: float(f"{v:.6g}") for k, v in record.items()}


class JsonLines:
    """One JSON object per line: `{"event": "start" | "resumed" | "step", ...}`; step lines every
    `every` steps."""

    def __init__(self, write: Callable[[str], None] = print, every: int = 1) -> None:
        self.write, self.every = write, every

    def start(self, step: int, max_steps: int, **facts: Any) -> None:
        self.event("start", step=step, max_steps=max_steps, **facts)

    def event(self, name: str, **fields: Any) -> None:
        self.write(json.dumps({"event": name, **fields}))

    def step(self, record: dict[str, float]) -> None:
        if int(record["step"]) % self.every == 0:
            self.event("step", **rounded(record))

    def close(self) -> None:
        pass


class ProgressBar:
    """A rich progress bar: step/steps, loss, (non-padding) tokens/s, ETA."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.bar = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tokens_per_second]} tokens/s"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task: Any = None

    def start(self, step: int, max_steps: int, **facts: Any) -> None:
        details = ", ".join(f"{k} {v}" for k, v in facts.items())
        self.console.print(f"training steps {step + 1}..{max_steps}" + (f" ({details})" if details else ""))
        self.task = self.bar.add_task(
            "train", total=max_steps, completed=step, loss="-", tokens_per_second="-"
        )
        self.bar.start()

    def event(self, name: str, **fields: Any) -> None:
        self.console.print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in fields.items()))

    def step(self, record: dict[str, float]) -> None:
        if self.task is None:
            return
        self.bar.update(
            self.task,
            completed=int(record["step"]),
            loss=f"{record['loss']:.4f}",
            tokens_per_second=f"{record['effective_tokens_per_second']:,.0f}",
        )

    def close(self) -> None:
        self.bar.stop()


def reporter_for(log_format: str, stream: TextIO, every: int = 1) -> Reporter:
    """`rich` draws a bar on `stream`; `json` writes lines; `auto` draws only when `stream` is a terminal."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    if log_format == "rich" or (log_format == "auto" and stream.isatty()):
        return ProgressBar(Console(file=stream, force_terminal=log_format == "rich" or None))
    return JsonLines(lambda line: write_line(line, stream), every)


def follow(lines: Iterable[str], reporter: Reporter, echo: Callable[[str], None]) -> dict[str, Any]:
    """Replay a trainer's JSON lines into `reporter`; other lines go to `echo`. Returns the final
    summary line's object ({} when the trainer printed none)."""
    summary: dict[str, Any] = {}
    try:
        for line in lines:
            text = line.strip()
            doc = parse_summary(text)
            if doc is None or "event" not in doc:
                if doc is not None and "steps" in doc:
                    summary = doc
                if text:
                    echo(text)
                continue
            name = doc.pop("event")
            if name == "start":
                reporter.start(int(doc.pop("step")), int(doc.pop("max_steps")), **doc)
            elif name == "step":
                reporter.step(doc)
            else:
                reporter.event(name, **doc)
    finally:
        reporter.close()
    return summary
