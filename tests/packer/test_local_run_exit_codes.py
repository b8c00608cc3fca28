"""`packtrain run FILE.yaml` (operator/local_run.py): exit codes of a failing pipeline."""

from __future__ import annotations

from pathlib import Path

from support.paths import MODELS

from packtrain.operator import local_run

QWEN2 = MODELS / "qwen2-vl"


def _yaml(tmp_path: Path, input_path: str) -> Path:
    f = tmp_path / "job.yaml"
    f.write_text(
        "apiVersion: packtrain.dev/v1alpha1\nkind: PackJob\nmetadata: {name: p}\nspec:\n"
        f"  source: {{paths: ['{input_path}']}}\n  model: {{path: '{QWEN2}'}}\n"
        "  output: {claimName: c}\n"
    )
    return f


def test_a_stage_config_error_exits_2(tmp_path: Path) -> None:
    job = _yaml(tmp_path, str(tmp_path / "no-such-file.jsonl"))
    assert local_run.main([str(job), "--workers", "1", "--output", str(tmp_path / "out")]) == 2


def test_zero_workers_is_a_config_error(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n')
    job = _yaml(tmp_path, str(src))
    assert local_run.main([str(job), "--workers", "0", "--output", str(tmp_path / "out")]) == 2


def test_malformed_yaml_is_a_config_error(tmp_path: Path) -> None:
    for n, text in enumerate(["kind: PackJob\nmetadata: {name: x\n", "- a\n- b\n"]):
        job = tmp_path / f"job{n}.yaml"
        job.write_text(text)
        assert local_run.main([str(job), "--output", str(tmp_path / "out")]) == 2
