"""Run all stages of a pack on this machine with N worker processes and progress bars."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import stages
from .config import PackConfig
from .records import ConfigError, iter_records


def _convert_job(cfg_json: dict[str, Any], out: str, index: int, count: int, queue: Any) -> dict[str, Any]:
    cfg = PackConfig.model_validate(cfg_json)
    return stages.convert(cfg, Path(out), index, count, progress=queue.put)


def _materialize_job(cfg_json: dict[str, Any], out: str, index: int, count: int, queue: Any) -> dict[str, Any]:
    cfg = PackConfig.model_validate(cfg_json)
    return stages.materialize(cfg, Path(out), index, count, progress=queue.put)


def _run_parallel(
    job: Callable[..., dict[str, Any]],
    cfg: PackConfig,
    out: Path,
    workers: int,
    progress: Progress,
    label: str,
    total: int | None,
) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        queue = manager.Queue()
        task = progress.add_task(label, total=total)
        futures: list[Future[dict[str, Any]]] = [
            pool.submit(job, cfg.dump(), str(out), i, workers, queue) for i in range(workers)
        ]
        while not all(f.done() for f in futures):
            while not queue.empty():
                progress.advance(task, queue.get())
            time.sleep(0.1)
        while not queue.empty():
            progress.advance(task, queue.get())
        results = [f.result() for f in futures]
        progress.update(task, completed=progress.tasks[task].completed, total=progress.tasks[task].completed)
        return results


def run_all(cfg: PackConfig, out: Path, workers: int = 1, show_progress: bool = True) -> dict[str, Any]:
    """convert (N processes) → plan → materialize (N processes); returns the manifest."""
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1 worker process")
    out.mkdir(parents=True, exist_ok=True)
    stages.check_output_config(cfg, out)
    total = sum(1 for _ in iter_records(cfg.source.paths, select=lambda _: False))  # counted, not parsed
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show_progress, transient=False) as progress:
        converted = _run_parallel(_convert_job, cfg, out, workers, progress, "convert", total)
        task = progress.add_task("plan", total=1)
        plan_summary = stages.plan(cfg, out)
        progress.advance(task)
        _run_parallel(_materialize_job, cfg, out, workers, progress, "materialize", plan_summary["shards"])
    manifest = stages.finalize(cfg, out)
    if manifest is None:
        raise RuntimeError(f"materialize finished but {out} lacks shards; re-run `packtrain pack materialize`")
    seen = sum(c["samples"] for c in converted)
    if seen != manifest["counts"]["input"]:
        raise RuntimeError(
            f"{out}: this run read {seen} samples but the manifest counts {manifest['counts']['input']}; "
            "the folder holds a pack of other inputs. Use a new output folder."
        )
    return manifest
