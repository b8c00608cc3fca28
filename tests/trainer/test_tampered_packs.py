"""The trainer refuses a damaged or edited pack as it reads it: exit 2 naming shard and row, never
a silent loss-0 run, a run on rewritten labels, or an IndexError deep in the embedding."""

from __future__ import annotations

import json
import re

import pytest
from conftest import job_spec, write_job
from pack_tamper import ROW_EDITS, copy_pack, edit_manifest, tamper_row
from vlm_fixtures import spec

from packtrain.core.errors import ShardFormatError
from packtrain.core.pack.shards import MANIFEST
from packtrain.trainer import cli


def _every_row(pack, edit) -> None:
    manifest = json.loads((pack / MANIFEST).read_text())
    for s, entry in enumerate(manifest["shards"]):
        for r in range(entry["rows"]):
            tamper_row(pack, s, r, edit)


@pytest.mark.parametrize("name", sorted(ROW_EDITS))
def test_tampered_rows_exit_2_naming_shard_and_row(name, pack_dir, tmp_path, capsys):
    edit, message = ROW_EDITS[name]
    bad = copy_pack(pack_dir, tmp_path / "bad")
    _every_row(bad, edit)
    job = write_job(tmp_path / "job.yaml", job_spec(bad, tmp_path / "out"))
    assert cli.main(["-c", str(job)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(bad))}/shards/\d{{5}}\.arrow row \d+: .*{message}", err), err
    assert "Traceback" not in err


def test_one_tampered_row_is_named_exactly(pack_dir, tmp_path):
    from packtrain.trainer.data.media import PixelSpec
    from packtrain.trainer.data.packed import PackedDataset

    bad = copy_pack(pack_dir, tmp_path / "bad")
    shard_file = tamper_row(bad, 1, 3, ROW_EDITS["labels all -100"][0])
    ds = PackedDataset(bad, spec("qwen2-vl"), PixelSpec(), vocab_size=151936)
    seq = int(json.loads((bad / MANIFEST).read_text())["shards"][0]["rows"]) + 3
    with pytest.raises(
        ShardFormatError, match=rf"{re.escape(shard_file)} row 3: sub-sample 0 has no label token"
    ):
        ds.checked_row(seq)
    ds.checked_row(seq - 1)  # its neighbour is intact


def _doubled_grid(row) -> None:  # the size doubled with it, so only the vision-token count disagrees
    ref = row["media"][0]
    ref.update(grid_h=ref["grid_h"] * 2, height=ref["height"] * 2)


def _odd_grid(row) -> None:  # one patch wider: not a whole number of merged patches
    ref = row["media"][0]
    ref.update(grid_w=ref["grid_w"] + 1, width=ref["width"] + ref["width"] // ref["grid_w"])


def _dropped_ref(row) -> None:  # placeholder tokens left without their grid
    row["media"] = row["media"][1:]


GRID_EDITS = {
    "doubled grid": (_doubled_grid, "do not match its media grids"),
    "grid off the merge size": (_odd_grid, "not a whole number of merged patches"),
    "media ref dropped": (_dropped_ref, "do not match its media grids"),
}


@pytest.mark.parametrize("name", sorted(GRID_EDITS))
def test_grids_that_disagree_with_their_tokens_exit_2_before_any_step(name, pack_dir, tmp_path, capsys):
    """A grid edited to disagree with its placeholder tokens is refused as its row is read, naming
    shard and row, before the step it is in (not a ValueError from the mRoPE positions)."""
    edit, message = GRID_EDITS[name]
    bad = copy_pack(pack_dir, tmp_path / "bad")
    _every_row(bad, lambda row: edit(row) if row["media"] else None)
    rows = sum(e["rows"] for e in json.loads((bad / MANIFEST).read_text())["shards"])
    job = write_job(tmp_path / "job.yaml", job_spec(bad, tmp_path / "out", microBatchSequences=rows))
    assert cli.main(["-c", str(job), "--log-format", "json"]) == 2
    out, err = capsys.readouterr()
    assert re.search(
        rf"{re.escape(str(bad))}/shards/\d{{5}}\.arrow row \d+: sub-sample \d+: .*{message}", err
    ), err
    assert "Traceback" not in err and '"event": "step"' not in out


@pytest.mark.parametrize("damage", ["truncated manifest", "shard entry without sha256"])
def test_damaged_manifest_exits_2_with_a_message(damage, pack_dir, tmp_path, capsys):
    bad = copy_pack(pack_dir, tmp_path / "bad")
    if damage == "truncated manifest":
        text = (bad / MANIFEST).read_text()
        (bad / MANIFEST).write_text(text[: len(text) // 3])
    else:
        edit_manifest(bad, lambda m: m["shards"][1].pop("sha256"))
    job = write_job(tmp_path / "job.yaml", job_spec(bad, tmp_path / "out"))
    assert cli.main(["-c", str(job)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and ("not readable JSON" in err or "shards[1] lacks sha256" in err), err
