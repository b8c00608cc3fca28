"""The commands pods run, built in one place.

The operator's builders and the local runner (`packtrain run`) both call these,
so a job behaves the same on a laptop and on a cluster: same program, same
arguments. Pure functions of their inputs; nothing here touches Kubernetes.
"""

from __future__ import annotations

from packtrain.core.contract import PACK_STAGES, PackStage

# Stages split across workers (one Indexed Job index each); plan sees every sample at once.
INDEXED_STAGES: frozenset[str] = frozenset({"convert", "materialize"})

# What torchrun starts in the trainer pods (`python -m packtrain.trainer` is `packtrain train`).
TRAINER_MODULE = "packtrain.trainer"


def pack_stage_command(
    stage: PackStage,
    config_path: str,
    output_dir: str,
    index: int | None = None,
    count: int | None = None,
) -> list[str]:
    """`packtrain pack <stage> -c CONFIG -o OUT [--index I] [--count N]`.

    Leave `index` unset in an Indexed Job: the packer reads `JOB_COMPLETION_INDEX`,
    so every pod of the Job can share one template.
    """
    if stage not in PACK_STAGES:
        raise ValueError(f"unknown pack stage {stage!r}; expected one of {', '.join(PACK_STAGES)}")
    if stage not in INDEXED_STAGES and (index is not None or (count or 1) != 1):
        raise ValueError(f"pack stage {stage!r} runs as a single worker; do not pass index/count")
    if count is not None and count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if index is not None and count is not None and not 0 <= index < count:
        raise ValueError(f"index {index} is outside 0..{count - 1}")
    cmd = ["packtrain", "pack", stage, "-c", config_path, "-o", output_dir]
    if index is not None:
        cmd += ["--index", str(index)]
    if stage in INDEXED_STAGES and count is not None:
        cmd += ["--count", str(count)]
    return cmd


def train_command(
    config_path: str,
    data_path: str,
    output_dir: str,
    nproc_per_node: int,
    nnodes: int = 1,
    max_steps: int | None = None,
) -> list[str]:
    """`torchrun … -m packtrain.trainer -c CONFIG --data PATH --output DIR --log-format json`.

    The trainer's own entry (what `packtrain train` runs), with JSON progress lines for the pod log
    whether or not a terminal is attached; the summary line and termination message are the same.

    With one node torchrun runs standalone (its own local rendezvous). With more,
    torchrun takes the node rank and master address/port from the `PET_NODE_RANK`,
    `PET_MASTER_ADDR` and `PET_MASTER_PORT` variables that both the Kubeflow
    PyTorchJob and TrainJob controllers set in every pod, so all nodes share one command.
    `nproc_per_node` 0 means a CPU-only run with one process.
    """
    if nnodes < 1:
        raise ValueError(f"nnodes must be at least 1, got {nnodes}")
    if nproc_per_node < 0:
        raise ValueError(f"nproc_per_node must not be negative, got {nproc_per_node}")
    cmd = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(max(nproc_per_node, 1))]
    if nnodes == 1:
        cmd.append("--standalone")
    cmd += [
        "-m",
        TRAINER_MODULE,
        "-c",
        config_path,
        "--data",
        data_path,
        "--output",
        output_dir,
        "--log-format",
        "json",
    ]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    return cmd
