"""Pure builders: custom resource in, child manifests out (see `common.py`), one module per kind.

This package is their public surface: `builders.pack_job`, `builders.training_job`, … The operator's
own settings (`OperatorDefaults`) are `packtrain.operator.settings`.
"""

from __future__ import annotations

from packtrain.operator.builders.common import (
    CONFIG_DIR,
    TERMINATION_LOG,
    TMP_DIR,
    container_security_context,
    pod_security_context,
    with_default_requests,
)
from packtrain.operator.builders.packjob import (
    PACK_CONFIG_FILE,
    pack_config_map,
    pack_config_name,
    pack_job,
    pack_job_name,
    pack_output_dir,
)
from packtrain.operator.builders.sftjob import (
    SFT_DATA_MOUNT,
    TRAIN_CONFIG_FILE,
    DataSource,
    EvalSource,
    created_suspended,
    data_source,
    eval_source,
    pytorch_job,
    sft_output_dir,
    train_config_map,
    train_config_name,
    train_job,
    training_job,
    training_job_name,
)

__all__ = [
    "CONFIG_DIR",
    "DataSource",
    "EvalSource",
    "PACK_CONFIG_FILE",
    "SFT_DATA_MOUNT",
    "TERMINATION_LOG",
    "TMP_DIR",
    "TRAIN_CONFIG_FILE",
    "container_security_context",
    "created_suspended",
    "data_source",
    "eval_source",
    "pack_config_map",
    "pack_config_name",
    "pack_job",
    "pack_job_name",
    "pack_output_dir",
    "pod_security_context",
    "pytorch_job",
    "sft_output_dir",
    "train_config_map",
    "train_config_name",
    "train_job",
    "training_job",
    "training_job_name",
    "with_default_requests",
]
