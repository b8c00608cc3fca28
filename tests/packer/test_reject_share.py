"""Lost data is told before GPUs are spent: the reject summary comes when packing ends (before
`packtrain run` trains), packing.maxRejectedFraction refuses a lossy pack by default (5%), and a media
path outside the job's folders says which folders those are and the line that admits it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from cluster.controlplane import free_port
from support.paths import DEMO
from test_first_hour import QWEN2, TINY, chats, image_record, one_line_error, packtrain

IMAGE = DEMO / "mllm_demo_data" / "1.jpg"


def _lossy_data(root: Path, chat_count: int, missing: int) -> Path:
    (root / "data").mkdir()
    records = chats(chat_count) + [image_record(f"gone-{i}", f"gone-{i}.jpg") for i in range(missing)]
    data = root / "data" / "train.json"
    data.write_text(json.dumps(records))
    return data


def _pack_run(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return packtrain(
        "pack", "run", "--input", str(data), "--model", str(QWEN2), "--max-length", "512", "-o", str(out),
        "--workers", "1", "--no-progress", *extra,
    )  # fmt: skip


def test_the_default_refuses_a_pack_that_loses_more_than_5_percent(tmp_path: Path) -> None:
    data = _lossy_data(tmp_path, chat_count=9, missing=1)  # 10% rejected
    err = one_line_error(_pack_run(data, tmp_path / "pack"), 2)
    refused = [line for line in err.splitlines() if line.startswith("packtrain pack run: ")]
    assert len(refused) == 1, err
    assert "1 of 10 samples rejected (10.0%), over packing.maxRejectedFraction 0.05" in refused[0]
    assert "missing_media 1" in refused[0] and "Fix: media files are not where the records say" in refused[0]
    assert "raise packing.maxRejectedFraction" in refused[0]
    assert not (tmp_path / "pack" / "manifest.json").exists()

    kept = _pack_run(data, tmp_path / "pack2", "--max-rejected-fraction", "0.2")
    assert kept.returncode == 0, kept.stderr[-3000:]  # the user's own limit, over the default


def test_packtrain_run_tells_the_loss_before_it_trains(tmp_path: Path) -> None:
    data = _lossy_data(tmp_path, chat_count=8, missing=2)  # 20% rejected, allowed by this job
    docs = [
        {
            "apiVersion": "packtrain.dev/v1alpha1",
            "kind": "PackJob",
            "metadata": {"name": "lossy"},
            "spec": {
                "source": {"paths": [str(data)]},
                "model": {"path": str(QWEN2)},
                "packing": {"maxLength": 512, "maxRejectedFraction": 0.3},
                "output": {"claimName": "c"},
            },
        },
        {
            "apiVersion": "packtrain.dev/v1alpha1",
            "kind": "SFTJob",
            "metadata": {"name": "lossy"},
            "spec": {
                "data": {"packJobRef": "lossy", "numWorkers": 0},
                "model": {"path": str(QWEN2), "init": "random", "configOverrides": TINY},
                "training": {"maxSteps": 1},
                # Not the default 9400: an end-to-end trainer on this machine may hold that one.
                "metricsPort": free_port(),
                "resources": {"nodes": 1, "gpusPerNode": 0},
                "volumes": {"checkpoints": {"claimName": "ck"}},
            },
        },
    ]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump_all(docs))
    result = packtrain("run", str(job), "--workers", "1", "--output", str(tmp_path / "out"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    warning = next(
        i for i, line in enumerate(lines) if "WARNING PackJob lossy: 2 of 10 samples (20.0%)" in line
    )
    train = next(i for i, line in enumerate(lines) if line.startswith("train lossy: "))
    assert warning < train, lines
    assert "missing_media 2" in lines[warning] and "Fix: media files are not where" in lines[warning]


def test_packtrain_run_refused_by_the_default_in_one_line(tmp_path: Path) -> None:
    data = _lossy_data(tmp_path, chat_count=4, missing=1)
    spec = {"source": {"paths": [str(data)]}, "model": {"path": str(QWEN2)}, "packing": {"maxLength": 512}}
    doc = {"apiVersion": "packtrain.dev/v1alpha1", "kind": "PackJob", "metadata": {"name": "p"}, "spec": spec}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**doc, "spec": {**spec, "output": {"claimName": "c"}}}))
    err = one_line_error(packtrain("run", str(job), "--workers", "1", "--output", str(tmp_path / "o")), 2)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "p plan: 1 of 5 samples rejected (20.0%)" in errors[0], err
    assert "over packing.maxRejectedFraction 0.05" in errors[0]


def test_an_absolute_media_path_outside_the_roots_names_them_and_the_line_to_add(tmp_path: Path) -> None:
    for folder in ("media", "data", "elsewhere"):
        (tmp_path / folder).mkdir()
    outside = tmp_path / "elsewhere" / "image.png"
    records = chats(3) + [image_record("far", str(outside))]
    (tmp_path / "data" / "d.json").write_text(json.dumps(records))
    out = tmp_path / "pack"
    result = _pack_run(
        tmp_path / "data" / "d.json",
        out,
        "--media-root",
        str(tmp_path / "media"),
        "--max-rejected-fraction",
        "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    detail = reject["detail"]
    assert reject["reason"] == "media_outside_root"
    for root in (tmp_path / "media", tmp_path / "data"):
        assert str(root.resolve()) in detail, detail
    folder = json.dumps(f"{tmp_path / 'elsewhere'}/")
    assert f"add the line {folder}: {folder} under source.mediaPathMap" in detail, detail
    # The same detail whether or not the file exists: a dataset cannot probe the file system with it.
    outside.write_bytes(IMAGE.read_bytes())
    again = _pack_run(
        tmp_path / "data" / "d.json", tmp_path / "pack2", "--media-root", str(tmp_path / "media"),
        "--max-rejected-fraction", "1",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    (second,) = [json.loads(line) for line in (tmp_path / "pack2" / "rejects.jsonl").read_text().splitlines()]
    assert second["detail"] == detail
