"""Run all stages of a pack on this machine with N worker processes and progress bars.

The tokenizer and processor are loaded once, in this process. With one worker every stage runs
here; with more, the workers are forked once after the load and serve both convert and
materialize, so a worker starts with everything loaded (a spawned worker re-imported
transformers and re-read the tokenizer: ~3 s per `pack run` before any sample). Where fork is
not available (macOS, Windows) workers are spawned and load their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from packtrain.core.config import PackConfig
from packtrain.core.errors import ConfigError
from packtrain.core.output_lock import claim_output
from packtrain.core.pack.shards import read_manifest
from packtrain.packer.processor_check import check_processor
from packtrain.packer.sources.mixture import weigher
from packtrain.packer.sources.records import iter_records
from packtrain.packer.stages.convert import convert, sample_tokenizer
from packtrain.packer.stages.finalize import finalize
from packtrain.packer.stages.inputs import refresh
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WORKER: dict[str, Any] = {}
"""What a worker process holds: config, output folder, progress queue and (forked) the loaded tokenizer."""


def _init_worker(cfg_json: dict[str, Any], out: str, progress: Any, parent: int) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the workers (no traceback from each).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(parent)
    if "cfg" not in _WORKER:  # spawned: nothing inherited
        _WORKER["cfg"] = PackConfig.model_validate(cfg_json)
    _WORKER["out"] = Path(out)
    _WORKER["progress"] = progress


def die_with(parent: int) -> None:
    """Linux: the kernel kills this worker when `pack run` dies, `kill -9` included (no worker outlives
    it, writing into a folder a re-run then owns). The parent may be gone before this runs: then exit."""
    if not sys.platform.startswith("linux"):
        return
    # The signal comes when the thread that started this worker ends: `_pool`'s caller, which waits
    # for the workers' results, so it ends only when `pack run` does.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM; a forked worker's counts the pages it shares)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(maxrss / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def anon_rss_mib() -> float | None:
    """Resident memory not backed by a file (Linux): what the process really holds. Peak RSS also
    counts the pages of memory-mapped shards and parts, which the kernel drops under pressure."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


class _Watch:
    """A stage's progress callback that also samples anonymous RSS (at most every 0.2 s) and CPU.

    The anonymous peak is sampled at progress callbacks, so it may miss a short spike between two; in
    a worker that served convert first, it includes what convert left allocated."""

    def __init__(self, forward: Callable[[int], None]) -> None:
        self.forward, self.peak, self.last = forward, anon_rss_mib(), 0.0
        self.cpu = cpu_seconds()

    def __call__(self, n: int) -> None:
        self.forward(n)
        now = time.monotonic()
        if now - self.last >= 0.2:
            self.last = now
            self.sample()

    def sample(self) -> None:
        current = anon_rss_mib()
        if current is not None and (self.peak is None or current > self.peak):
            self.peak = current

    def report(self) -> dict[str, Any]:
        self.sample()
        return {
            "peak_rss_mib": peak_rss_mib(),
            "peak_anon_rss_mib": self.peak,
            "cpu_s": round(cpu_seconds() - self.cpu, 2),
        }


def _convert_job(index: int, count: int) -> dict[str, Any]:
    w = _WORKER
    watch = _Watch(w["progress"].put)
    summary = convert(w["cfg"], w["out"], index, count, progress=watch, tokenizer=w.get("tokenizer"))
    return {**summary, **watch.report()}


def _materialize_job(index: int, count: int) -> dict[str, Any]:
    w = _WORKER
    watch = _Watch(w["progress"].put)
    summary = materialize(w["cfg"], w["out"], index, count, progress=watch)
    return {**summary, **watch.report()}


def fork_is_safe() -> bool:
    """Fork only a process that holds nothing a fork breaks: on Linux (elsewhere system frameworks
    are not fork-safe), with no other Python thread (a lock it holds would stay locked in the child)
    and without torch loaded (its OpenMP pool does not survive a fork: a forked worker hangs on its
    first parallel op). `pack run` qualifies; a host process such as a notebook or a test runner with
    torch or threads gets spawned workers, which load the tokenizer themselves."""
    return sys.platform.startswith("linux") and threading.active_count() == 1 and "torch" not in sys.modules


def _ready() -> int:
    return os.getpid()


def _pool(cfg: PackConfig, out: Path, workers: int, tokenizer: Any) -> tuple[ProcessPoolExecutor, Any]:
    """`workers` processes started now, forked from this process with the tokenizer already loaded."""
    fork = fork_is_safe()
    ctx = mp.get_context("fork" if fork else "spawn")
    progress = ctx.Queue()
    if fork:
        _WORKER.update(cfg=cfg, tokenizer=tokenizer)
    pool = ProcessPoolExecutor(
        workers,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(cfg.dump(), str(out), progress, os.getpid()),
    )
    try:
        # Start every worker before any thread of ours (progress bars) runs: a fork copies only the
        # calling thread, and a lock another thread held would stay locked in the child.
        for f in [pool.submit(_ready) for _ in range(workers)]:
            f.result()
    except BaseException:
        pool.shutdown(cancel_futures=True)
        raise
    finally:
        _WORKER.clear()
    return pool, progress


class _StageRunner:
    """Runs a stage on the pool's workers (`job`, one per worker index) or, without a pool, here
    (`local`), advancing a progress bar; returns each worker's summary."""

    def __init__(
        self, pool: ProcessPoolExecutor | None, progress_queue: Any, workers: int, progress: Progress
    ) -> None:
        self.pool, self.progress_queue, self.workers, self.progress = pool, progress_queue, workers, progress

    def __call__(
        self,
        job: Callable[[int, int], dict[str, Any]],
        label: str,
        total: int | None,
        local: Callable[[Callable[[int], None]], dict[str, Any]],
    ) -> list[dict[str, Any]]:
        progress, pool = self.progress, self.pool
        task = progress.add_task(label, total=total)
        advance: Callable[[int], None] = lambda n: progress.advance(task, n)  # noqa: E731
        if pool is None:
            watch = _Watch(advance)
            results = [{**local(watch), **watch.report()}]
        else:
            futures: list[Future[dict[str, Any]]] = [
                pool.submit(job, i, self.workers) for i in range(self.workers)
            ]
            while not all(f.done() for f in futures):
                with contextlib.suppress(queue.Empty):
                    advance(self.progress_queue.get(timeout=0.1))
            results = [f.result() for f in futures]
            while True:
                try:
                    advance(self.progress_queue.get_nowait())
                except queue.Empty:
                    break
        done = progress.tasks[task].completed
        progress.update(task, completed=done, total=done)
        return results


def run_all(
    cfg: PackConfig,
    out: Path,
    workers: int = 1,
    show_progress: bool = True,
    timings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """convert (N processes) → plan → materialize (N processes); returns the manifest, or raises
    `PackRefused` when the final counts refuse the pack (no manifest is written then).

    `timings`, when given, receives each stage's wall and CPU seconds and, per process, its peak
    RSS and sampled peak anonymous RSS.
    """
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1 worker process")
    # Claimed before anything of the folder is read, swept or written: a refused run touches nothing.
    with claim_output(out, "pack run", "-o"):
        return _run_claimed(cfg, out, workers, show_progress, timings)


def _run_claimed(
    cfg: PackConfig, out: Path, workers: int, show_progress: bool, timings: dict[str, Any] | None
) -> dict[str, Any]:
    laps = _Laps(pooled=workers > 1)
    kept_or_rebuilt = refresh(cfg, out)
    if kept_or_rebuilt:
        print(f"packtrain pack run: {kept_or_rebuilt}", file=sys.stderr, flush=True)
    # The bar's total: records counted, not parsed (one more read of the input, so only for a bar).
    total = _record_count(cfg) if show_progress else None
    # One tokenizer thread per worker process: the workers are the parallelism.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = sample_tokenizer(cfg, out)
    unchecked = check_processor(cfg, tokenizer)  # exit 2 before any work when the ids would drift
    if unchecked:
        print(f"WARNING {unchecked}", file=sys.stderr)
    pool, progress_queue = _pool(cfg, out, workers, tokenizer) if workers > 1 else (None, None)
    laps.lap("load")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, disable=not show_progress, transient=False) as progress:
            run = _StageRunner(pool, progress_queue, workers, progress)
            converted = run(
                _convert_job,
                "convert",
                total,
                lambda advance: dict(convert(cfg, out, 0, 1, progress=advance, tokenizer=tokenizer)),
            )
            laps.lap("convert", converted)
            task = progress.add_task("plan", total=1)
            plan_summary = plan(cfg, out)
            progress.advance(task)
            laps.lap("plan")
            materialized = run(
                _materialize_job,
                "materialize",
                plan_summary["shards"],
                lambda advance: dict(materialize(cfg, out, 0, 1, progress=advance)),
            )
            laps.lap("materialize", materialized)
    except KeyboardInterrupt:
        if pool is not None:
            _stop_workers(pool)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    manifest = _manifest(cfg, out, converted, materialized)
    if timings is not None:
        timings.update(stages=laps.stages, workers=workers, peak_rss_mib=peak_rss_mib())
    return manifest


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Ctrl-C: the workers ignore SIGINT, so they are stopped here (no process outlives `pack run`)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()


def _record_count(cfg: PackConfig) -> int:
    weigh = weigher(cfg.source, cfg.packing.seed)
    return sum(1 for _ in iter_records(cfg.source.paths, select=lambda _: False, weigh=weigh))


class _Laps:
    """Each stage's wall and CPU seconds since the last lap; with worker processes (`pooled`), their
    CPU seconds and peak RSS, else this process's CPU seconds and sampled anonymous peak."""

    def __init__(self, pooled: bool) -> None:
        self.pooled = pooled
        self.clock, self.cpu = time.perf_counter(), cpu_seconds()
        self.stages: dict[str, Any] = {}

    def lap(self, stage: str, results: list[dict[str, Any]] | None = None) -> None:
        now, now_cpu = time.perf_counter(), cpu_seconds()
        times: dict[str, Any] = {"seconds": round(now - self.clock, 3)}
        if results is not None and self.pooled:
            times |= {
                "cpu_s": round(sum(r["cpu_s"] for r in results), 2),
                "worker_peak_rss_mib": [r["peak_rss_mib"] for r in results],
                "worker_peak_anon_rss_mib": [r["peak_anon_rss_mib"] for r in results],
            }
        else:
            times["cpu_s"] = round(now_cpu - self.cpu, 2)
            if results is not None:
                times["peak_anon_rss_mib"] = results[0]["peak_anon_rss_mib"]
        self.stages[stage] = times
        self.clock, self.cpu = now, now_cpu


def _manifest(
    cfg: PackConfig, out: Path, converted: list[dict[str, Any]], materialized: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest the run wrote, checked against what this run read."""
    # The worker that completed the set wrote the manifest; finalize only if none did (a shard was
    # written by an earlier, interrupted run and no worker of this run saw the set complete).
    if any(m.get("manifest") for m in materialized):
        manifest: dict[str, Any] | None = read_manifest(out)
    else:
        manifest = finalize(cfg, out)
    if manifest is None:
        raise RuntimeError(
            f"materialize finished but {out} lacks shards; re-run `packtrain pack materialize`"
        )
    seen = sum(c["samples"] for c in converted)
    if seen != manifest["counts"]["input"]:
        raise RuntimeError(
            f"{out}: this run read {seen} samples but the manifest counts {manifest['counts']['input']}; "
            "the folder holds a pack of other inputs. Use a new output folder."
        )
    return manifest
