"""`packtrain run FILE.yaml`: a PackJob + SFTJob pipeline on this machine, no cluster.

The YAML is validated with the operator's own API models, the config files are
the ones the operator would put in its ConfigMaps, and the processes run the
argv that `commands` builds for pods: what works here works on a cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from packtrain.core.errors import EXIT_CONFIG, EXIT_INTERRUPTED, ConfigError
from packtrain.core.families import FAMILIES
from packtrain.core.output_lock import claim_output
from packtrain.core.progress import METRICS_ANY_PORT, METRICS_PORT_EVENT, ProgressBar, follow
from packtrain.core.report import rejects_warning
from packtrain.core.sft_config import check_model_overrides
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.builders import (
    PACK_CONFIG_FILE,
    TRAIN_CONFIG_FILE,
    DataSource,
    pack_config_map,
    train_config_map,
)
from packtrain.operator.commands import pack_stage_command, train_command
from packtrain.operator.manifests import Named, invalid, load_manifests

console = Console(stderr=True)


class PipelineError(RuntimeError):
    """A stage failed; the message names it and where its log is. `exit_code`: what `packtrain run`
    returns (EXIT_CONFIG when the stage reported a configuration error, else 1)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def load_documents(path: Path) -> tuple[list[Named], list[Named]]:
    """PackJobs and SFTJobs of a (multi-document) YAML, each SFTJob's PackJob among them, and each
    SFTJob's configOverrides known to its model's config: checked here, before anything is packed, as
    `train -c` checks them (not by `render`: reading transformers' config classes loads torch)."""
    found = load_manifests(path)
    for sft in found.sfts:
        check_model_overrides(sft.spec.model, invalid(path, "SFTJob", sft.name))
        ref = sft.spec.data.pack_job_ref
        if ref is not None and ref not in {p.name for p in found.packs}:
            raise ValueError(f"SFTJob {sft.name} refers to PackJob {ref!r}, which {path} does not define")
    return found.packs, found.sfts


def _resolve(argv: list[str]) -> list[str]:
    """Find the program beside this interpreter first, so an unactivated venv works like a pod's PATH."""
    local = Path(sys.executable).parent / argv[0]
    return [str(local) if local.exists() else (shutil.which(argv[0]) or argv[0]), *argv[1:]]


def _write_config(path: Path, config_map: dict[str, Any], filename: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_map["data"][filename])
    return path


def _run_stage(
    progress: Progress, label: str, argvs: list[list[str]], logs: Path, env: dict[str, str]
) -> list[dict[str, Any]]:
    """Run argvs in parallel (one per worker index); return their termination messages."""
    task = progress.add_task(label, total=len(argvs))
    procs = []
    for i, argv in enumerate(argvs):
        log = logs / f"{label}-{i}.log"
        term = logs / f"{label}-{i}.termination.json"
        term.unlink(missing_ok=True)
        worker_env = env | {"PACKTRAIN_TERMINATION_LOG": str(term), "JOB_COMPLETION_INDEX": str(i)}
        with open(log, "w") as f:
            procs.append(
                (
                    subprocess.Popen(_resolve(argv), stdout=f, stderr=subprocess.STDOUT, env=worker_env),
                    log,
                    term,
                )
            )
    pending = set(range(len(procs)))
    try:
        while pending:
            for i in list(pending):
                if procs[i][0].poll() is not None:
                    pending.discard(i)
                    progress.advance(task)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for proc, _, _ in procs:
            stop(proc)
        raise
    results = []
    for proc, log, term in procs:
        error = _reported_error(term) if proc.returncode == EXIT_CONFIG else None
        if error:  # the stage said what to fix: that line, not its log
            raise PipelineError(f"{label}: {error} (log: {log})", EXIT_CONFIG)
        if proc.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-15:])
            hint = "fix the configuration" if proc.returncode == EXIT_CONFIG else "see the log"
            raise PipelineError(
                f"{label} failed (exit {proc.returncode}; {hint}): {log}\n{tail}",
                EXIT_CONFIG if proc.returncode == EXIT_CONFIG else 1,
            )
        results.append(json.loads(term.read_text()) if term.is_file() else {})
    return results


def _reported_error(term: Path) -> str | None:
    """The error a stage wrote to its termination message, if it wrote one."""
    with contextlib.suppress(OSError, ValueError):
        report = json.loads(term.read_text())
        if isinstance(report, dict) and isinstance(report.get("error"), str):
            return report["error"]
    return None


def run_pack(
    job: Named, out: Path, workers: int, progress: Progress, env: dict[str, str]
) -> tuple[Path, dict]:
    spec: PackJobSpec = job.spec
    config = _write_config(
        out / "config" / f"{job.name}-{PACK_CONFIG_FILE}",
        pack_config_map(job.name, job.namespace, spec),
        PACK_CONFIG_FILE,
    )
    pack_dir = out / "pack" / job.name
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _refresh(job.name, config, pack_dir, env)
    _run_stage(
        progress,
        f"{job.name} convert",
        [pack_stage_command("convert", str(config), str(pack_dir), i, workers) for i in range(workers)],
        logs,
        env,
    )
    (plan,) = _run_stage(
        progress, f"{job.name} plan", [pack_stage_command("plan", str(config), str(pack_dir))], logs, env
    )
    _run_stage(
        progress,
        f"{job.name} materialize",
        [pack_stage_command("materialize", str(config), str(pack_dir), i, workers) for i in range(workers)],
        logs,
        env,
    )
    from packtrain.core.pack.shards import read_manifest

    return pack_dir, read_manifest(pack_dir) | {"plan": plan}


def _refresh(name: str, config: Path, pack_dir: Path, env: dict[str, str]) -> None:
    """`packtrain pack refresh`: a finished pack is kept (its inputs unchanged) or cleared for a rebuild,
    said in one line; where that is not safe (another configuration's pack) the run stops (exit 2)."""
    argv = ["packtrain", "pack", "refresh", "-c", str(config), "-o", str(pack_dir)]
    done = subprocess.run(_resolve(argv), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        error = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise PipelineError(error[0], EXIT_CONFIG if done.returncode == EXIT_CONFIG else 1)
    if done.stdout.strip():
        console.print(f"PackJob {name}: {done.stdout.strip()}", markup=False, highlight=False, soft_wrap=True)


def run_train(
    job: Named, data_dir: Path, out: Path, nproc: int, max_steps: int | None, env: dict[str, str]
) -> dict[str, Any]:
    spec: SFTJobSpec = job.spec
    data = DataSource(claim_name="local", mount_path=str(data_dir.parent), path=str(data_dir))
    config = _write_config(
        out / "config" / f"{job.name}-{TRAIN_CONFIG_FILE}",
        train_config_map(job.name, job.namespace, spec, data),
        TRAIN_CONFIG_FILE,
    )
    train_dir = out / "train" / job.name
    argv = train_command(
        str(config), str(data_dir), str(train_dir), nproc_per_node=nproc, nnodes=1, max_steps=max_steps
    )
    log = out / "logs" / f"{job.name}-train.log"
    term = out / "logs" / f"{job.name}-train.termination.json"
    term.parent.mkdir(parents=True, exist_ok=True)  # an SFTJob on a pack of its own: no pack made it
    term.unlink(missing_ok=True)
    console.print(f"[bold]train[/] {job.name}: {' '.join(argv)}")
    with open(log, "w") as f:
        # Its own session: Ctrl-C reaches only this process, which stops torchrun and its workers.
        proc = subprocess.Popen(
            _resolve(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # A taken metrics port (another local run's) is replaced by a free one the trainer binds.
            env=env | {"PACKTRAIN_TERMINATION_LOG": str(term), METRICS_ANY_PORT: "1"},
            start_new_session=True,
        )
        assert proc.stdout is not None
        try:
            # The pod's JSON lines go to the log as they are and are drawn as the trainer's progress bar.
            summary = follow(_tee(proc.stdout, f), _MetricsPortNote(ProgressBar(console)), _Echo())
            proc.wait()
        except BaseException:
            stop(proc, group=True)
            raise
    if proc.returncode != 0:
        raise _train_failure(job.name, proc.returncode, log, term)
    return summary | {"output": str(train_dir), "log": str(log)}


class _MetricsPortNote:
    """The trainer's progress bar, which says in words when the trainer served /metrics on another port
    than spec.metricsPort (taken, e.g. by another run: the trainer binds first, then reports)."""

    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar

    def start(self, step: int, max_steps: int, **facts: Any) -> None:
        self.bar.start(step, max_steps, **facts)

    def event(self, name: str, **fields: Any) -> None:
        if name != METRICS_PORT_EVENT:
            self.bar.event(name, **fields)
            return
        console.print(
            f"metrics: port {fields.get('wanted')} (spec.metricsPort) is in use, e.g. by another run; the "
            f"trainer serves /metrics on {fields.get('port')} instead"
        )

    def step(self, record: dict[str, float]) -> None:
        self.bar.step(record)

    def close(self) -> None:
        self.bar.close()


class _Echo:
    """The trainer's other output lines on the console, less what is said better elsewhere: its summary
    line and its own error lines (the table and the error below) and, once it fails, torchrun's log
    lines and tracebacks (all of it stays in the log)."""

    TORCHRUN = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d|^Traceback \(most recent call last\)")

    def __init__(self) -> None:
        self.quiet = False

    def __call__(self, text: str) -> None:
        self.quiet = self.quiet or bool(self.TORCHRUN.match(text))
        if self.quiet or text.startswith("packtrain train: ") or text.startswith('{"steps": '):
            return
        console.print(text, markup=False, highlight=False)


def _train_failure(name: str, code: int, log: Path, term: Path) -> PipelineError:
    """The trainer's own error line (from its termination message), not torchrun's tracebacks."""
    report: dict[str, Any] = {}
    if term.is_file():
        with contextlib.suppress(ValueError):
            report = json.loads(term.read_text())
    error = report.get("error") if isinstance(report, dict) else None
    if not error:
        return PipelineError(f"training {name} failed (exit {code}): see {log}")
    exit_code = EXIT_CONFIG if report.get("exit_code") == EXIT_CONFIG else 1
    return PipelineError(f"training {name} failed: {error}\n(full log: {log})", exit_code)


def stop(proc: subprocess.Popen, group: bool = False, grace: float = 5.0) -> None:
    """Stop a child (with `group`, its whole process group: torchrun and its workers): SIGTERM, then
    SIGKILL after `grace` seconds, so no process outlives `packtrain run`."""

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    if proc.poll() is None:
        send(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    if group or proc.poll() is None:
        send(signal.SIGKILL)  # the group: workers torchrun left behind, even once torchrun has exited
        proc.wait()


def _tee(lines: Iterator[str], log: TextIO) -> Iterator[str]:
    for line in lines:
        log.write(line)
        log.flush()
        yield line


def summary_table(packs: dict[str, tuple[Path, dict]], trains: dict[str, dict]) -> Table:
    t = Table(title="packtrain run")
    t.add_column("what")
    t.add_column("value", justify="right", overflow="fold")  # paths whole, not cut at 80 columns
    for name, (pack_dir, m) in packs.items():
        c = m["counts"]
        rows = [
            ("samples read", c["input"]),
            ("packed", c["packed"]),
            ("rejected", c["rejected"]),
            *((f"  rejected: {k}", v) for k, v in c["rejected_by_reason"].items()),
            ("sequences", f"{m['sequences']} (lower bound {m['lower_bound']})"),
            ("fill ratio", f"{m['fill_ratio']:.4f}"),
            ("padding saved", f"{m['padding_saved']:.2%}"),
            ("pack", str(pack_dir)),
        ]
        t.add_section()
        t.add_row(f"[bold]PackJob {name}[/]", "")
        for k, v in rows:
            t.add_row(k, str(v))
    for name, s in trains.items():
        t.add_section()
        t.add_row(f"[bold]SFTJob {name}[/]", "")
        if s.get("resumed_from") and not s.get("steps_this_run"):
            t.add_row("training steps", f"{s.get('steps')}: already complete, nothing trained this run")
            t.add_row("model and checkpoints", str(s.get("output", "")))
            continue
        for key, label in (
            ("steps", "training steps"),
            ("init", "model init"),
            ("effective_tokens_per_second", "effective tokens/s"),
            ("final_loss", "final loss"),
            ("output", "model and checkpoints"),
        ):
            value = s.get(key, "")
            text = "- (no step this run)" if value is None else str(value)
            t.add_row(label, f"{value:.4g}" if isinstance(value, float) else text)
    return t


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="packtrain run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("file", help="YAML with a PackJob and/or an SFTJob (multi-document)")
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, os.cpu_count() or 1),
        help="packer processes per stage (default: the CPU count, %(default)s)",
    )
    ap.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="trainer processes (torchrun --nproc-per-node; default: %(default)s)",
    )
    ap.add_argument("--output", help="where packs, checkpoints and logs go (default: runs/<file stem>)")
    ap.add_argument("--max-steps", type=int, help="override training.maxSteps (default: the SFTJob's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = Path(args.file)
    if args.workers < 1 or args.nproc < 1:
        console.print(
            f"[red]error:[/] --workers ({args.workers}) and --nproc ({args.nproc}) must be at least 1"
        )
        return EXIT_CONFIG
    try:
        packs, sfts = load_documents(path)
    except (OSError, ValueError) as exc:  # one line however long: it names the file, the key and the fix
        console.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        return EXIT_CONFIG
    out = Path(args.output or Path("runs") / path.stem).resolve()
    env = os.environ.copy()
    packed: dict[str, tuple[Path, dict]] = {}
    trained: dict[str, dict] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        # One `packtrain run` per output folder: a second one would run the same stages on its packs.
        with claim_output(out, "packtrain run", "--output"):
            with _stopped_by_signals(), Progress(*columns, console=console) as progress:
                for job in packs:
                    packed[job.name] = run_pack(job, out, args.workers, progress, env)
            warn_rejects(console, packed)  # before any training: what the packs lost, and what to fix
            for job in sfts:
                ref = job.spec.data.pack_job_ref
                data_dir = packed[ref][0] if ref else Path(job.spec.data.path)
                with _stopped_by_signals():
                    trained[job.name] = run_train(job, data_dir, out, args.nproc, args.max_steps, env)
    except ConfigError as exc:  # the output folder is another run's, or cannot be written
        console.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        return EXIT_CONFIG
    except PipelineError as exc:
        console.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:  # every child is stopped by now (see stop)
        console.print(f"interrupted — run the same command again to resume (output: {out})", highlight=False)
        return EXIT_INTERRUPTED
    Console().print(summary_table(packed, trained))
    print_next_steps(Console(), out, packed, trained)
    return 0


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (`timeout`, `kill`, a closed terminal) stop the pipeline as Ctrl-C does, so
    the children (torchrun runs in its own session) are stopped too, not orphaned."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def print_next_steps(
    con: Console, out: Path, packs: dict[str, tuple[Path, dict]], trains: dict[str, dict]
) -> None:
    """Where the results are, any samples the packs lost (loudly, again: training logs came since), and
    the commands to try next."""
    warn_rejects(con, packs)
    lines = [f"logs: {out / 'logs'}"]
    for name, (pack_dir, _) in packs.items():
        lines += [f"pack {name}:  {pack_dir}; rejected samples: {pack_dir / 'rejects.jsonl'}"]
    for name, s in trains.items():
        final = s.get("final_model") or _final(s)
        ckpt = Path(s["output"]) / "checkpoints"
        lines += [f"model {name}:  {final or '(saveFinal: false)'}; checkpoints: {ckpt}"]
    lines += ["next:"]
    for _, (pack_dir, _) in packs.items():
        lines += [
            f"  packtrain pack inspect {pack_dir} --plot pack.png   # lengths and fill",
            f"  packtrain pack verify {pack_dir}",
        ]
    for final in filter(None, (s.get("final_model") or _final(s) for s in trains.values())):
        lines += [
            f'  python -c "{_class_import(Path(final))}'
            "from transformers import AutoModelForImageTextToText as M; "
            f"M.from_pretrained('{final}')\"   # or serve it: vllm serve {final}"
        ]
    con.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)


def _class_import(final: Path) -> str:
    """`import <module>; ` where the exported family's class is packtrain's own (transformers has
    none: importing the module registers it with the Auto classes), else nothing."""
    try:
        model_type = json.loads((final / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return ""
    family = next((f for f in FAMILIES.values() if f.model_type == model_type), None)
    return f"import {family.model_module}; " if family is not None and family.model_module else ""


def warn_rejects(con: Console, packs: dict[str, tuple[Path, dict]]) -> None:
    """One WARNING line per pack that rejected samples: the share, the top reasons and their fixes."""
    for name, (pack_dir, m) in packs.items():
        warning = rejects_warning(m["counts"], pack_dir)
        if warning:
            con.print(
                Text.assemble(("WARNING ", "bold yellow"), f"PackJob {name}: {warning}"), soft_wrap=True
            )


def _final(summary: dict[str, Any]) -> str | None:
    """The final model of a run that trained nothing this time (the one an earlier run saved)."""
    final = Path(summary["output"]) / "final"
    return str(final) if final.is_dir() else None


if __name__ == "__main__":
    sys.exit(main())
