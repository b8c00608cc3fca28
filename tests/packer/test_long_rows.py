"""Packs of 131072-token rows end to end (context parallelism): long chats built from the shared text
datasets and a demo video sampled to tens of thousands of tokens, packed with Qwen2.5-VL's tokenizer and
processor settings; token counts against the processor's own, rows, counts, shards, the trainer's
reader and `pack inspect`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.pack_runner import run_in_process
from support.paths import DATASETS, DEMO, MODELS

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import REJECTS, ShardReader
from packtrain.packer.binpack import _sort_decreasing
from packtrain.packer.stages.plan import SHARD_TOKENS, shard_size
from packtrain.packer.tools import inspect_cmd, unpack, verify

MAX_LENGTH = 131072
MODEL = MODELS / "qwen2.5-vl"
VIDEO = "mllm_demo_data/1.mp4"  # 243 frames of 640x360 at 25 fps
FPS = 15.0  # 144 sampled frames: 72 temporal groups of 26x46 patches (644x364), 21528 video tokens
QUESTION, ANSWER = "Describe every second of this video.", "A baby reads a book."


def _turns(path: Path) -> list[dict[str, str]]:
    """Every turn of a ShareGPT file, one conversation after another (image placeholders dropped)."""
    return [
        {"from": t["from"], "value": t["value"].replace("<image>", "").strip()}
        for r in json.loads(path.read_text())
        for t in r["conversations"]
    ]


def _chats() -> dict[str, list[dict[str, str]]]:
    """Long chats: one of 122k tokens, three that share a row with the video, a short one, and one
    over maxLength."""
    fast = _turns(DATASETS / "text-sft/fastchat/dummy_conversation.json")  # 2000 turns: 29913 tokens
    llava = _turns(DATASETS / "text-sft/llava-instruct-100/llava_instruct_100.json")  # 916: 37216
    return {
        "fastchat-all": fast,
        "llava-all": llava,
        "fast-then-llava": fast + llava[:292],
        "mixed-122k": llava + fast + llava + fast[:1200],
        "short": fast[:4],
        "overlong": (llava + fast) * 3,
    }


def _write_data(folder: Path) -> list[Path]:
    video = folder / "video.json"
    messages = [{"role": "user", "content": f"<video>{QUESTION}"}, {"role": "assistant", "content": ANSWER}]
    video.write_text(json.dumps([{"id": "video", "messages": messages, "videos": [VIDEO]}]))
    text = folder / "chats.jsonl"
    text.write_text("".join(json.dumps({"id": k, "conversations": v}) + "\n" for k, v in _chats().items()))
    return [video, text]


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("long-rows")
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(p) for p in _write_data(folder)], "mediaRoot": str(DEMO)},
            "model": {"path": str(MODEL), "fps": FPS, "maxFrames": 768},
            "packing": {"maxLength": MAX_LENGTH, "maxRejectedFraction": 0.5},
        }
    )
    out = folder / "pack"
    return out, run_in_process(cfg, out, workers=2)


@pytest.fixture(scope="module")
def samples(pack: tuple[Path, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in unpack(pack[0])}


def test_every_sample_is_packed_or_rejected_into_rows_within_max_length(
    pack: tuple[Path, dict[str, Any]], samples: dict[str, dict[str, Any]]
) -> None:
    out, manifest = pack
    counts = manifest["counts"]
    assert (counts["input"], counts["packed"], counts["rejected"]) == (7, 6, 1)
    assert counts["rejected_by_reason"] == {"overlong": 1}
    rejects = [json.loads(line) for line in (out / REJECTS).read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [("overlong", "overlong")]
    assert f"> maxLength {MAX_LENGTH}" in rejects[0]["detail"]
    assert set(samples) == {"video", "fastchat-all", "llava-all", "fast-then-llava", "mixed-122k", "short"}
    reader = ShardReader(out)
    rows = [reader.sequence(i) for i in range(reader.num_sequences)]
    lengths = sorted(len(r["input_ids"]) for r in rows)
    assert all(sum(r["seq_lens"]) == len(r["input_ids"]) for r in rows)
    assert lengths[-1] <= MAX_LENGTH and lengths[-2] > 120_000  # two rows, both nearly full
    assert len(rows) == manifest["sequences"] == 2
    assert sum(lengths) == manifest["tokens"] == sum(len(s["input_ids"]) for s in samples.values())
    assert verify(out) == []


@pytest.fixture(scope="module")
def processor_video() -> dict[str, Any]:
    """The Hugging Face processor's output for the video sample, from every decoded frame."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.video_utils import load_video

    transformers.utils.logging.set_verbosity_error()
    processor = transformers.AutoProcessor.from_pretrained(str(MODEL))
    frames, metadata = load_video(str(DEMO / VIDEO), backend="pyav")
    conversation = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
    ]
    text = processor.apply_chat_template(conversation, tokenize=False)
    kwargs = {"do_sample_frames": True, "fps": FPS, "min_frames": 4, "max_frames": 768}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(text=[text], videos=[frames], video_metadata=[metadata], **kwargs)
        indices = processor.video_processor.sample_frames(metadata, temporal_patch_size=2, **kwargs)
    return {**out, "frames": indices.tolist(), "processor": processor}


def test_video_and_long_chat_tokens_equal_the_processors(
    samples: dict[str, dict[str, Any]], processor_video: dict[str, Any]
) -> None:
    video = samples["video"]
    ref = processor_video
    assert len(video["input_ids"]) > 20_000
    assert video["input_ids"] == list(ref["input_ids"][0])
    (media,) = video["media"]
    assert [[media["grid_t"], media["grid_h"], media["grid_w"]]] == ref["video_grid_thw"].tolist()
    assert media["frames"] == ref["frames"]
    assert media["second_per_grid"] == pytest.approx(float(ref["second_per_grid_ts"][0]))
    # The chats, the 122k one tokenized in pieces (over 2^18 characters), as the chat template tokenizes them.
    roles = {"human": "user", "gpt": "assistant"}
    for name, turns in _chats().items():
        if name in samples:
            messages = [{"role": roles[t["from"]], "content": t["value"]} for t in turns]
            ids = ref["processor"].apply_chat_template([messages], tokenize=True, return_dict=True)
            assert samples[name]["input_ids"] == ids["input_ids"][0], name
    assert len(samples["mixed-122k"]["input_ids"]) > 2**16


def test_trainer_reads_and_collates_the_long_rows(
    pack: tuple[Path, dict[str, Any]], processor_video: dict[str, Any]
) -> None:
    torch = pytest.importorskip("torch")
    from packtrain.core.model_spec import model_spec
    from packtrain.trainer.data.media import PixelSpec
    from packtrain.trainer.data.packed import PackedDataset

    out, manifest = pack
    ds = PackedDataset(out, model_spec(MODEL), PixelSpec.from_folder(MODEL), vocab_size=151936)
    tokens = 0
    for k in range(len(ds)):
        batch = ds[k]
        inputs, lens = batch.inputs, batch.info.seq_lens
        n = int(inputs.input_ids.shape[1])
        tokens += n
        assert n <= MAX_LENGTH and int(inputs.cu_seq_lens[-1]) == n == sum(lens)
        assert inputs.position_ids.shape == (4, 1, n)
        starts = np.cumsum([0, *lens[:-1]]).tolist()
        for a, m, sid in zip(starts, lens, batch.info.sample_ids, strict=True):
            positions = inputs.position_ids[:, 0, a : a + m]
            assert torch.equal(positions[0], torch.arange(m))  # restarts at every sample
            if sid != "video":  # text: the three mRoPE rows count 0..m-1 too, past 2^16
                assert torch.equal(positions[1:], torch.arange(m).expand(3, m))
        if inputs.pixel_values_videos is None:
            continue
        assert torch.equal(inputs.video_grid_thw, processor_video["video_grid_thw"])
        assert inputs.pixel_values_videos.shape == processor_video["pixel_values_videos"].shape
        assert torch.allclose(inputs.pixel_values_videos, processor_video["pixel_values_videos"], atol=1e-5)
    assert tokens == manifest["tokens"]


def test_inspect_plots_the_long_pack(
    pack: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from packtrain.packer.tools import fill_figure

    out, _ = pack
    png = tmp_path / "fill.png"
    assert inspect_cmd(out, str(png), as_json=True) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["sequences"], line["packed"], line["rejected"]) == (2, 6, 1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A 64-token chat and a 122k-token one: a log axis that holds both and the maxLength line.
    fig = fill_figure(ShardReader(out).seq_lens(), MAX_LENGTH, "pack")
    lengths, _ = fig.axes
    low, high = lengths.get_xlim()
    assert lengths.get_xscale() == "log" and low <= 64 and high >= MAX_LENGTH
    ticks = [(tick.get_position()[0], tick.get_text()) for tick in lengths.get_xticklabels()]
    assert ticks[-1] == (MAX_LENGTH, "128k") and ticks[0][0] >= 64 and len(ticks) <= 8
    assert [list(line.get_xdata()) for line in lengths.get_lines()] == [[MAX_LENGTH, MAX_LENGTH]]
    plt.close(fig)


def test_planner_sorts_long_rows_as_short_ones() -> None:
    """Keys of 131072-token rows are wider than 16 bits: the two-pass radix order is numpy's stable one."""
    rng = np.random.default_rng(0)
    for max_length in (65535, 65536, 131072, 262144):
        lengths = rng.integers(1, max_length + 1, 50_000)
        lengths[:20_000] = rng.integers(max_length - 2, max_length + 1, 20_000)  # many ties
        want = np.argsort(max_length - lengths, kind="stable")
        assert np.array_equal(_sort_decreasing(lengths, max_length, None), want)
        seeded = _sort_decreasing(lengths, max_length, 0)
        assert np.array_equal(np.sort(seeded), np.arange(lengths.size))
        assert (np.diff(lengths[seeded]) <= 0).all()


def test_shards_of_long_rows_are_cut_by_tokens() -> None:
    assert shard_size(10**6, 1024, 4096) == 1024
    assert shard_size(10**6, 1024, MAX_LENGTH) == SHARD_TOKENS // MAX_LENGTH == 128
    assert shard_size(10**6, 16384, 262144) == 64
    assert shard_size(200, 1024, MAX_LENGTH) == 13  # a small pack still spreads over 16 shards
