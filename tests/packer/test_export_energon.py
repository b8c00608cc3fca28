"""`pack export energon`: the exported dataset, read back by Megatron-Energon's own loader, holds every
sequence (or sample) of the pack with the same tokens, labels, boundaries and media."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support.pack_runner import run_in_process
from support.paths import DATASETS, DEMO, MODELS

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import ShardReader
from packtrain.packer.cli import main as pack_main
from packtrain.packer.export_energon import export_energon

TEXT = DATASETS / "text-sft"
QWEN2 = MODELS / "qwen2-vl"


@pytest.fixture(scope="module", params=["original", "resized"])
def pack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Images, videos and text over several shards; media stored as file bytes or resized frames."""
    tmp = tmp_path_factory.mktemp(f"pack-{request.param}")
    cfg = PackConfig.model_validate(
        {
            "source": {
                "paths": [
                    str(DEMO / "mllm_demo.json"),
                    str(DEMO / "mllm_video_demo.json"),
                    str(TEXT / "glaive-toolcall" / "*.json"),
                ]
            },
            "model": {"path": str(QWEN2), "maxPixels": 200_000, "videoMaxPixels": 50_000, "maxFrames": 8},
            "packing": {"maxLength": 2048, "sequencesPerShard": 8, "mediaStorage": request.param},
        }
    )
    out = tmp / "pack"
    manifest = run_in_process(cfg, out, workers=1)
    assert len(manifest["shards"]) > 2 and manifest["counts"]["packed"] > 100
    return out


def _load(path: Path, decoder: Any = None) -> dict[str, dict[str, Any]]:
    """Every sample of split "train" through Energon's dataset factory, loader and a crude-sample cooker."""
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        basic_sample_keys,
        get_loader,
        get_val_dataset,
        stateless,
    )

    @dataclasses.dataclass
    class Parts(Sample):
        parts: dict[str, Any]

    @stateless
    def cook(crude: dict[str, Any]) -> Parts:
        return Parts(
            **basic_sample_keys(crude), parts={k: v for k, v in crude.items() if not k.startswith("__")}
        )

    class Encoder(DefaultTaskEncoder):  # type: ignore[misc]
        cookers = [Cooker(cook)]

        def batch(self, samples: list[Parts]) -> list[Parts]:
            return samples

        def encode_batch(self, batch: list[Parts]) -> list[Parts]:
            return batch

    Encoder.decoder = decoder
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = get_val_dataset(
        str(path), split_part="train", worker_config=worker_config, batch_size=1, task_encoder=Encoder()
    )
    got: dict[str, dict[str, Any]] = {}
    for batch in get_loader(dataset):
        for sample in batch:
            assert sample.__key__ not in got
            got[sample.__key__] = sample.parts
    return got


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _check_media(
    parts: dict[str, Any],
    refs: list[dict[str, Any]],
    want: list[dict[str, Any]],
    reader: ShardReader,
    shard: int,
) -> None:
    """Each media reference keeps the pack's metadata, and its parts hold the pack's bytes."""
    assert [{k: v for k, v in r.items() if k != "parts"} for r in refs] == want
    for ref in refs:
        blob = reader.media(ref["key"], shard)
        data = [parts[name] for name in ref["parts"]]
        if blob["encoding"] == "original":
            assert data == [blob["data"]] and hashlib.sha256(data[0]).hexdigest() == ref["key"]
            ext = ref["parts"][0].rsplit(".", 1)[1]
            assert ext in (("mp4", "avi", "mkv") if ref["kind"] == "video" else ("jpg",)), ref["parts"]
        elif ref["kind"] == "video":
            assert data == blob["frames"] and len(data) == len(ref["frames"])
        else:
            assert data == [blob["data"]] and data[0][:4] == b"\x89PNG"
    named = {name for ref in refs for name in ref["parts"]}
    assert {k for k in parts if k.startswith("media.")} == named  # nothing else, each blob once


def test_packed_sequences_round_trip_through_energon(pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "energon"
    assert pack_main(["export", "energon", str(pack), "-o", str(out)]) == 0
    reader = ShardReader(pack)
    got = _load(out)
    assert len(got) == reader.num_sequences
    media_seen = 0
    for i in range(reader.num_sequences):
        seq = reader.sequence(i)
        shard, row = reader.locate(i)
        parts = got.pop(f"s{shard:05d}r{row:05d}")
        meta = json.loads(parts["json"])
        assert _npy(parts["input_ids.npy"]).dtype == np.int32
        assert _npy(parts["input_ids.npy"]).tolist() == seq["input_ids"]
        assert _npy(parts["labels.npy"]).tolist() == seq["labels"]
        assert meta["layout"] == "packed"
        assert (meta["seq_lens"], meta["sample_ids"], meta["sources"], meta["indices"]) == (
            seq["seq_lens"],
            seq["sample_ids"],
            seq["sources"],
            seq["indices"],
        )
        _check_media(parts, meta["media"], seq["media"], reader, shard)
        media_seen += len(meta["media"])
    assert not got and media_seen > 0


def test_unpacked_samples_round_trip_through_energon(pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "energon"
    summary = export_energon(pack, out, layout="samples")
    reader = ShardReader(pack)
    assert summary["samples"] == reader.manifest["counts"]["packed"]
    got = _load(out)
    assert len(got) == reader.manifest["counts"]["packed"]
    kinds = set()
    for i in range(reader.num_sequences):
        seq = reader.sequence(i)
        shard, row = reader.locate(i)
        start = 0
        for sub, n in enumerate(seq["seq_lens"]):
            parts = got.pop(f"s{shard:05d}r{row:05d}n{sub:03d}")
            meta = json.loads(parts["json"])
            assert (meta["sample_id"], meta["source"], meta["index"], meta["length"]) == (
                seq["sample_ids"][sub],
                seq["sources"][sub],
                seq["indices"][sub],
                n,
            )
            assert _npy(parts["input_ids.npy"]).tolist() == seq["input_ids"][start : start + n]
            labels = _npy(parts["labels.npy"]).tolist()
            assert labels == seq["labels"][start : start + n] and any(x != -100 for x in labels)
            want = [{k: v for k, v in m.items() if k != "sample"} for m in seq["media"] if m["sample"] == sub]
            _check_media(parts, meta["media"], want, reader, shard)
            kinds |= {m["kind"] for m in want}
            start += n
    assert not got and kinds == {"image", "video"}


def test_energon_decoders_and_prepare_agree_with_the_export(pack: Path, tmp_path: Path) -> None:
    """Energon's default decoder reads every part; `energon prepare` indexes the tars as the export did."""
    from megatron.energon import SampleDecoder
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    out = tmp_path / "energon"
    export_energon(pack, out)
    reader = ShardReader(pack)
    decoded = _load(out, SampleDecoder(image_decode="pil"))
    first = decoded["s00000r00000"]
    assert isinstance(first["json"], dict) and isinstance(first["input_ids.npy"], np.ndarray)
    images = [(k, v) for parts in decoded.values() for k, v in parts.items() if isinstance(v, Image.Image)]
    assert images
    raw = _load(out)
    for name, img in images[:5]:
        key = next(k for k, parts in decoded.items() if any(v is img for v in parts.values()))
        with Image.open(io.BytesIO(raw[key][name])) as want:
            assert np.array_equal(np.asarray(img.convert("RGB")), np.asarray(want.convert("RGB")))

    info = json.loads((out / ".nv-meta" / ".info.json").read_text())
    ours = {name: (out / name).with_suffix(".tar.idx").read_bytes() for name in info["shard_counts"]}
    again = tmp_path / "prepared"
    shutil.copytree(out, again)
    for name in info["shard_counts"]:
        (again / name).with_suffix(".tar.idx").unlink()
    (again / ".nv-meta" / ".info.json").unlink()
    BaseWebdatasetFactory.prepare_dataset(
        again,
        list(info["shard_counts"]),
        split_parts_patterns=[("train", ".*")],
        workers=1,
        shuffle_seed=None,
    )
    prepared = json.loads((again / ".nv-meta" / ".info.json").read_text())
    assert prepared["shard_counts"] == info["shard_counts"]
    assert sum(info["shard_counts"].values()) == reader.num_sequences
    assert {name: (again / name).with_suffix(".tar.idx").read_bytes() for name in ours} == ours


def test_export_refuses_a_used_folder_and_a_folder_inside_the_pack(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert pack_main(["export", "energon", str(pack), "-o", str(used)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (used / "keep.txt").read_text() == "mine" and sorted(p.name for p in used.iterdir()) == [
        "keep.txt"
    ]
    assert pack_main(["export", "energon", str(pack), "-o", str(pack / "energon")]) == 2
    assert not (pack / "energon").exists()
    assert pack_main(["export", "energon", str(tmp_path / "no-pack"), "-o", str(tmp_path / "x")]) == 2


def test_export_is_deterministic_and_imports_neither_torch_nor_energon(pack: Path, tmp_path: Path) -> None:
    export_energon(pack, tmp_path / "a", layout="samples")
    export_energon(pack, tmp_path / "b", layout="samples")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from packtrain.packer.cli import main\n"
        f"assert main(['export', 'energon', {str(pack)!r}, '-o', {str(tmp_path / 'c')!r}]) == 0\n"
        "assert not {'torch', 'megatron'} & {m.split('.')[0] for m in sys.modules}, 'heavy imports'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
