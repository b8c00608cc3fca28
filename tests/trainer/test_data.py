"""PackedDataset over a real pack, and the cost-balancing sampler."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import make_pack
from PIL import Image
from torch.utils.data import DataLoader
from vlm_fixtures import DEMO, FOLDER, spec

from packtrain.core.errors import ShardFormatError
from packtrain.trainer.data.media import PixelSpec
from packtrain.trainer.data.packed import PackedDataset
from packtrain.trainer.data.sampler import attention_cost, contiguous_plan, imbalance, plan_epoch


def _dataset(pack, **kw):
    return PackedDataset(pack, spec("qwen2-vl"), PixelSpec.from_folder(FOLDER["qwen2-vl"]), **kw)


def test_ranks_split_an_epoch_without_overlap_and_deterministically(pack_dir):
    world, mb, accum = 2, 2, 2
    ranks = [
        _dataset(pack_dir, rank=r, world_size=world, units_per_micro_batch=mb, grad_accum=accum)
        for r in range(world)
    ]
    seen = [u for d in ranks for batch in d.micro_batches() for u in batch]
    assert len(seen) == len(set(seen))
    steps = ranks[0].steps_per_epoch()
    assert steps == len(ranks[0].units) // (world * mb * accum)
    assert len(seen) == steps * world * mb * accum
    again = _dataset(pack_dir, rank=1, world_size=world, units_per_micro_batch=mb, grad_accum=accum)
    assert again.micro_batches() == ranks[1].micro_batches()
    assert again.micro_batches(epoch=1) != again.micro_batches(epoch=0)
    other_seed = _dataset(
        pack_dir, rank=1, world_size=world, units_per_micro_batch=mb, grad_accum=accum, seed=7
    )
    assert other_seed.micro_batches() != ranks[1].micro_batches()


def test_workers_decode_disjoint_batches_in_order(pack_dir):
    ds = _dataset(pack_dir, units_per_micro_batch=2)
    inline = [b.info.position for b in DataLoader(ds.view(), batch_size=None, num_workers=0)][:6]
    loader = DataLoader(ds.view(), batch_size=None, num_workers=2)
    parallel = []
    for batch in loader:
        parallel.append((batch.info.position, batch.inputs.input_ids.shape[1], batch.info.num_tokens))
        if len(parallel) == 6:
            break
    assert [list(p) for p, _, _ in parallel] == [list(p) for p in inline] == [[0, i] for i in range(6)]
    assert all(width == n for _, width, n in parallel)


def test_state_dict_resumes_at_the_exact_next_micro_batch(pack_dir):
    ds = _dataset(pack_dir, world_size=1, units_per_micro_batch=1, grad_accum=2)
    full = DataLoader(ds.view(), batch_size=None)
    reference = []
    for batch in full:
        reference.append(batch)
        if len(reference) == 5:
            break
    for batch in reference[:3]:
        ds.mark_consumed(batch)
    state = ds.state_dict()
    assert state["next"] == 3
    resumed = _dataset(pack_dir, world_size=1, units_per_micro_batch=1, grad_accum=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    nxt = next(iter(DataLoader(resumed.view(), batch_size=None)))
    assert list(nxt.info.position) == [0, 3]
    assert torch.equal(nxt.inputs.input_ids, reference[3].inputs.input_ids)
    with pytest.raises(ValueError, match="world_size"):
        _dataset(pack_dir, world_size=2, units_per_micro_batch=1, grad_accum=2).load_state_dict(state)


def test_epoch_rolls_over_after_the_last_micro_batch(pack_dir):
    ds = _dataset(pack_dir, units_per_micro_batch=4)
    last = len(ds.micro_batches()) - 1
    batch = ds[last]
    assert batch.info.position == (0, last)
    ds.mark_consumed(batch)
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["next"] == 0


def test_padded_mode_serves_the_same_samples(pack_dir):
    packed = _dataset(pack_dir)
    padded = _dataset(pack_dir, mode="padded", units_per_micro_batch=4)
    assert len(padded.units) == sum(len(lens) for lens in packed.seq_lens)
    batch = padded[0]
    assert batch.inputs.input_ids.shape[0] == 4
    assert batch.inputs.attention_mask.sum() == batch.info.num_tokens


def test_pre_resized_media_decode_to_the_same_pixels(pack_dir, tmp_path):
    """A pack with `mediaStorage: resized` (PNG at the counted size / sampled frames) yields
    exactly the pixels of decoding the originals, images and videos."""
    resized = _dataset(make_pack(tmp_path / "resized", media_storage="resized"))
    original = _dataset(pack_dir)
    media_rows = [i for i in range(len(original.seq_lens)) if original.reader.sequence(i)["media"]]
    kinds = set()
    for i in media_rows:
        a, b = original._decoded_row(i, {}), resized._decoded_row(i, {})
        assert a["media"] == b["media"]
        kinds |= {m["kind"] for m in a["media"]}
        for pa, pb in zip(a["pixels"], b["pixels"], strict=True):
            assert torch.equal(pa, pb), f"row {i}: max |original - resized| {(pa - pb).abs().max():.3g}"
    assert kinds == {"image", "video"}


def _hard_images(folder):
    """Transparent pixels over colour, a palette with a transparent index, odd and tiny sizes, EXIF."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (177, 333, 4), dtype=np.uint8)
    rgba[:, ::3, 3] = 0
    Image.fromarray(rgba, "RGBA").save(folder / "rgba.png")
    palette = Image.fromarray(rng.integers(0, 16, (99, 201), dtype=np.uint8), "P")
    palette.putpalette([int(v) for v in rng.integers(0, 256, 768)])
    palette.save(folder / "palette.png", transparency=7)
    Image.fromarray(rng.integers(0, 256, (29, 27, 3), dtype=np.uint8)).save(folder / "odd.png")
    Image.fromarray(rng.integers(0, 256, (3, 5, 3), dtype=np.uint8)).save(folder / "tiny.png")
    la = Image.fromarray(rng.integers(0, 256, (70, 50, 2), dtype=np.uint8), "LA")
    la.save(folder / "la.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(rng.integers(0, 256, (90, 150, 3), dtype=np.uint8)).save(
        folder / "exif6.jpg", quality=90, exif=exif.tobytes()
    )
    Image.fromarray(rng.integers(0, 256, (301, 457, 3), dtype=np.uint8)).save(
        folder / "noise.jpg", quality=85
    )
    return sorted(p.name for p in folder.iterdir())


_RESIZED_BLOBS = """
import json, sys
from pathlib import Path
from packtrain.core.config import SourceConfig
from packtrain.packer.media.access import MediaLimits
from packtrain.packer.media.store import media_blob
refs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
limits = MediaLimits.of(SourceConfig(paths=["unused"]))
for i, ref in enumerate(refs):
    (out / f"{i}.png").write_bytes(media_blob(ref, "resized", limits, alpha="drop")["data"])
assert "torch" not in sys.modules, "the packer loaded torch"
"""


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_pixels_equal_the_processor_in_both_storage_modes(tmp_path, family):
    """Alpha, palettes, odd sizes and EXIF rotation: the trainer's pixels from the original bytes,
    and from the PNG that `mediaStorage: resized` writes (made in a torch-free packer process, as in
    production), equal the HF processor's `pixel_values` exactly. The processor decodes a file path
    dropping transparency, so this is `model.alpha: drop` (`white`: tests/packer/test_transparency.py)."""
    from transformers import AutoProcessor

    from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
    from packtrain.packer.sources.raw import RawRecord
    from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample
    from packtrain.trainer.data.media import media_pixels

    names = _hard_images(tmp_path / "img")
    tok = SampleTokenizer(
        SourceConfig(paths=["unused"]), ModelConfig(family=family, path=str(FOLDER[family])), PackingConfig()
    )
    record = {
        "messages": [
            {"role": "user", "content": "<image>" * len(names)},
            {"role": "assistant", "content": "x"},
        ],
        "images": names,
    }
    sample = tok(RawRecord(tmp_path / "img" / "d.json", 0, record, None))
    assert isinstance(sample, TokenizedSample), sample
    refs = [
        {
            "path": str(m.path),
            "kind": m.kind,
            "key": m.key,
            "height": m.height,
            "width": m.width,
            "frames": [],
            "grid_t": m.grid_t,
            "grid_h": m.grid_h,
            "grid_w": m.grid_w,
        }
        for m in sample.media
    ]
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    (tmp_path / "blobs").mkdir()
    subprocess.run(
        [sys.executable, "-c", _RESIZED_BLOBS, str(tmp_path / "refs.json"), str(tmp_path / "blobs")],
        check=True,
    )
    spec = dataclasses.replace(PixelSpec.from_folder(FOLDER[family]), alpha="drop")
    processor = AutoProcessor.from_pretrained(str(FOLDER[family])).image_processor
    for i, (name, ref) in enumerate(zip(names, refs, strict=True)):
        want = processor(images=[str(tmp_path / "img" / name)], return_tensors="pt")
        assert want["image_grid_thw"][0].tolist() == [ref["grid_t"], ref["grid_h"], ref["grid_w"]], name
        original = {"encoding": "original", "data": (tmp_path / "img" / name).read_bytes(), "frames": []}
        resized = {
            "encoding": "resized",
            "data": (tmp_path / "blobs" / f"{i}.png").read_bytes(),
            "frames": [],
        }
        for mode, blob in (("original", original), ("resized", resized)):
            got = media_pixels(blob, ref, spec)
            assert torch.equal(got, want["pixel_values"]), (
                f"{name} ({mode}): max diff {(got - want['pixel_values']).abs().max():.3g}"
            )


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_video_pixels_equal_the_processor_in_both_storage_modes(tmp_path, family):
    """A demo video's sampled frames: the trainer's patches from the original file and from the
    frames `mediaStorage: resized` stores equal the video processor's `pixel_values_videos`."""
    from transformers import AutoProcessor
    from transformers.video_utils import load_video

    from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
    from packtrain.packer.media.access import MediaLimits
    from packtrain.packer.media.store import media_blob
    from packtrain.packer.sources.raw import RawRecord
    from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample
    from packtrain.trainer.data.media import media_pixels

    video = DEMO / "mllm_demo_data" / "4.mp4"
    budget = 24 * 32 * 32 * 8 if family == "qwen3-vl" else 24 * 28 * 28  # all frames vs per frame
    source = SourceConfig(paths=["unused"])
    tok = SampleTokenizer(
        source,
        ModelConfig(family=family, path=str(FOLDER[family]), video_max_pixels=budget, max_frames=8),
        PackingConfig(),
    )
    record = {
        "messages": [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "x"}],
        "videos": [video.name],
    }
    sample = tok(RawRecord(video.parent / "d.json", 0, record, None))
    assert isinstance(sample, TokenizedSample), sample
    (m,) = sample.media
    ref = {
        "path": str(m.path),
        "kind": "video",
        "key": m.key,
        "height": m.height,
        "width": m.width,
        "frames": m.frames,
        "grid_t": m.grid_t,
        "grid_h": m.grid_h,
        "grid_w": m.grid_w,
    }
    frames, metadata = load_video(str(video), backend="pyav")
    # Qwen3VLVideoProcessor samples with its own `max_frames` (a keyword does not reach it), as a
    # folder whose video_preprocessor_config.json said 8 would: packtrain reads that key the same way.
    processor = AutoProcessor.from_pretrained(str(FOLDER[family]), max_frames=8).video_processor
    extra = {"cap_pixels_per_frame": True} if family == "qwen3-vl" else {}
    size = {"shortest_edge": processor.size["shortest_edge"], "longest_edge": budget}
    want = processor(
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=True,
        fps=2.0,
        max_frames=8,
        size=size,
        return_tensors="pt",
        **extra,
    )
    assert want["video_grid_thw"][0].tolist() == [m.grid_t, m.grid_h, m.grid_w]
    limits = MediaLimits.of(source)
    pixel_spec = PixelSpec.from_folder(FOLDER[family])
    for storage in ("original", "resized"):
        got = media_pixels(media_blob(ref, storage, limits, alpha="white"), ref, pixel_spec)
        assert torch.equal(got, want["pixel_values_videos"]), (
            f"{storage}: max diff {(got - want['pixel_values_videos']).abs().max():.3g}"
        )


def test_corrupt_or_foreign_packs_are_refused(pack_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(pack_dir, bad)
    shard = bad / "shards" / "00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="sha256"):
        _dataset(bad)
    old = tmp_path / "old"
    shutil.copytree(pack_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 999
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardFormatError, match="version"):
        _dataset(old)


def test_balancing_beats_contiguous_assignment():
    rng = random.Random(0)
    # Mixed sequences: some hold one long sample, some many short ones (same token count).
    seqs = [[4096] if rng.random() < 0.25 else [256] * 16 for _ in range(512)]
    costs = [attention_cost(s) for s in seqs]
    balanced = plan_epoch(costs, world_size=8, units_per_rank=4, seed=0, epoch=0)
    naive = contiguous_plan(costs, world_size=8, units_per_rank=4, seed=0, epoch=0)
    assert sorted(u for step in balanced for g in step for u in g) == sorted(
        u for step in naive for g in step for u in g
    )
    assert all(len(g) == 4 for step in balanced for g in step)
    b, n = imbalance(balanced, costs), imbalance(naive, costs)
    print(f"attention-cost imbalance max/mean: balanced {b}, contiguous {n}")
    assert b["mean"] < n["mean"] and b["max"] <= n["max"]
    assert b["max"] < 1.2


def test_plan_needs_one_full_step():
    with pytest.raises(ValueError, match="one global step"):
        plan_epoch([1, 2, 3], world_size=2, units_per_rank=2, seed=0, epoch=0)
