"""Synthetic data: reproducible, in range, heavy-tailed, and real media files a reader can decode."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image
from support.synth import generate_dataset, image_tokens, main, synthetic_lengths


def test_synthetic_lengths_are_reproducible_and_in_range() -> None:
    first = synthetic_lengths(50_000, seed=3, max_length=4096)
    assert first.dtype == np.int32 and first.shape == (50_000,)
    assert first.min() >= 1 and first.max() <= 4096
    assert np.array_equal(first, synthetic_lengths(50_000, seed=3, max_length=4096))
    assert not np.array_equal(first, synthetic_lengths(50_000, seed=4, max_length=4096))
    assert synthetic_lengths(0, seed=3, max_length=4096).shape == (0,)
    assert np.array_equal(synthetic_lengths(1000, seed=3, max_length=4096), first[:1000])


def test_synthetic_lengths_are_a_heavy_tailed_mix() -> None:
    lengths = synthetic_lengths(200_000, seed=0, max_length=16384)
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 > 8 * p50  # long documents, hi-res images and videos make the tail
    text_only = synthetic_lengths(200_000, seed=0, max_length=16384, image_frac=0, video_frac=0)
    assert np.median(text_only) < p50  # media adds tokens
    assert (lengths > 16384 // 2).mean() > 0.01


def test_image_tokens_follow_qwen2_vl_resizing() -> None:
    assert image_tokens(480, 640) == 17 * 23 + 2  # sides rounded to 28 px, 2x2-merged patches
    assert image_tokens(10, 10) == 2 * 2 + 2  # scaled up to the 56x56 minimum
    assert image_tokens(20_000, 20_000) <= 16384 + 2  # scaled down to max_pixels


def test_synthetic_lengths_reject_bad_fractions() -> None:
    with pytest.raises(ValueError, match="image_frac"):
        synthetic_lengths(10, seed=0, max_length=4096, image_frac=0.8, video_frac=0.4)
    with pytest.raises(ValueError, match="below every length"):
        synthetic_lengths(10, seed=0, max_length=8)


def test_generated_dataset_has_real_media_behind_every_placeholder(tmp_path: Path) -> None:
    path = generate_dataset(tmp_path / "a", 16, seed=1, image_frac=0.5, video_frac=0.3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 16
    assert len({r["id"] for r in records}) == 16
    sizes = set()
    kinds = set()
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        text = "".join(m["content"] for m in record["messages"])
        images, videos = record.get("images", []), record.get("videos", [])
        assert text.count("<image>") == len(images) and text.count("<video>") == len(videos)
        for rel in images:
            with Image.open(path.parent / rel) as image:
                image.load()
                sizes.add(image.size)
                kinds.add(image.format)
        for rel in videos:
            with av.open(str(path.parent / rel)) as container:
                frames = sum(1 for _ in container.decode(video=0))
            assert frames >= 4
    assert len(sizes) > 3 and kinds == {"JPEG", "PNG"}
    assert any("videos" in r for r in records) and any(len(r["messages"]) > 2 for r in records)


def test_generated_dataset_is_reproducible(tmp_path: Path) -> None:
    first = generate_dataset(tmp_path / "a", 6, seed=2, image_frac=0.5, video_frac=0.5)
    main([str(tmp_path / "b"), "--samples", "6", "--seed", "2", "--image-frac", "0.5", "--video-frac", "0.5"])
    second = tmp_path / "b" / "data.jsonl"
    assert first.read_text() == second.read_text()
    for record in map(json.loads, first.read_text().splitlines()):
        for rel in record.get("images", []) + record.get("videos", []):
            assert (first.parent / rel).read_bytes() == (second.parent / rel).read_bytes()
