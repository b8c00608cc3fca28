"""Seeing what will be trained, as a user types it: `pack unpack --text/--json` decode each sample with
its trained spans marked, an over-long video's reject names the settings that shorten it (with the
counts the packer itself then gives), and `pack inspect --plot` says where the plot went."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from PIL import Image
from support.paths import DEMO, MODELS
from test_first_hour import one_line_error, packtrain

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample
from packtrain.packer.tools import TRAINED

QWEN2 = MODELS / "qwen2-vl"
VIDEO = DEMO / "mllm_demo_data" / "1.mp4"  # 243 frames at 25 fps, 640x360: 2691 tokens at the defaults
MAX_LENGTH = 1024


def _record(sample_id: str, tag: str, media: str) -> dict:
    kind = "images" if tag == "<image>" else "videos"
    turns = [{"from": "human", "value": f"{tag}What is this?"}, {"from": "gpt", "value": "A picture."}]
    return {"id": sample_id, "conversations": turns, kind: [media]}


def _pack(root: Path, records: list[dict], model: Path = QWEN2, **packing: object) -> Path:
    (root / "data.json").write_text(json.dumps(records))
    spec = {
        "source": {"paths": [str(root / "data.json")]},
        "model": {"path": str(model)},
        "packing": {"maxLength": MAX_LENGTH, "maxRejectedFraction": 1.0, **packing},
    }
    (root / "pack.yaml").write_text(yaml.safe_dump({"kind": "PackJob", "spec": spec}))
    out = root / "pack"
    result = packtrain("pack", "run", "-c", str(root / "pack.yaml"), "-o", str(out), "--workers", "1",
                       "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def image_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("see")
    Image.new("RGB", (300, 200), (9, 99, 199)).save(root / "a.png")
    chat = {
        "id": "chat",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello there."},
            {"from": "human", "value": "Again"},
            {"from": "gpt", "value": "Yes."},
        ],
    }
    return _pack(root, [_record("img", "<image>", "a.png"), chat])


def _trained_spans(ids: list[int], labels: list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    for i, (token, label) in enumerate(zip(ids, labels, strict=True)):
        if label != -100:
            if i == 0 or labels[i - 1] == -100:
                spans.append([])
            spans[-1].append(token)
    return spans


def test_unpack_text_shows_each_sample_with_its_trained_spans(image_pack: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(QWEN2))
    result = packtrain("pack", "unpack", str(image_pack), "--text")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    as_json = packtrain("pack", "unpack", str(image_pack), "--json")
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    samples = [json.loads(line) for line in as_json.stdout.splitlines()]
    blocks = re.split(r"^=== .*\n", result.stdout, flags=re.M)[1:]
    assert [s["id"] for s in samples] == ["img", "chat"] and len(blocks) == 2
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert f"<|image_pad|>×{samples[0]['input_ids'].count(pad)}" in samples[0]["text"]
    for s, block in zip(samples, blocks, strict=True):
        assert block == s["text"] + "\n"
        # Markers off and pad runs expanded, the text is the tokenizer's decode of the ids.
        plain = re.sub(r"(<\|image_pad\|>)×(\d+)", lambda m: m[1] * int(m[2]), s["text"])
        assert plain.replace(TRAINED[0], "").replace(TRAINED[1], "") == tokenizer.decode(s["input_ids"])
        marked = re.findall(f"{TRAINED[0]}(.*?){TRAINED[1]}", s["text"], flags=re.S)
        assert marked == [tokenizer.decode(span) for span in _trained_spans(s["input_ids"], s["labels"])]
    assert re.findall(f"{TRAINED[0]}(.*?){TRAINED[1]}", samples[1]["text"]) == [
        "Hello there.<|im_end|>",
        "Yes.<|im_end|>",
    ]
    assert "⟦" in packtrain("pack", "unpack", "--help").stdout  # the help names the marker


def test_unpack_text_without_the_model_folder(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(QWEN2, model)
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo."}]
    pack = _pack(tmp_path, [{"id": "c", "conversations": turns}], model=model)
    shutil.rmtree(model)  # the model folder moved after packing
    err = one_line_error(packtrain("pack", "unpack", str(pack), "--text"), 2)
    assert "tokenizer of the pack's model folder" in err and str(model) in err
    assert "unpack without --text/--json" in err and len(err.strip().splitlines()) == 1
    plain = packtrain("pack", "unpack", str(pack))  # the JSON lines need no tokenizer
    assert plain.returncode == 0 and json.loads(plain.stdout)["id"] == "c"


def _video_tokens(root: Path, **model: object) -> tuple[int, int]:
    """(sample tokens, video tokens) of the video record as the packer tokenizes it with `model`."""
    source = SourceConfig(paths=["unused"], media_root=str(root))
    tok = SampleTokenizer(source, ModelConfig(path=str(QWEN2), **model), PackingConfig(max_length=8192))
    sample = tok(RawRecord(root / "data.json", 0, _record("v", "<video>", "1.mp4"), None))
    assert isinstance(sample, TokenizedSample), sample
    return len(sample.input_ids), sample.media[0].num_tokens


def test_overlong_video_reject_names_the_settings_that_fit(tmp_path: Path) -> None:
    shutil.copyfile(VIDEO, tmp_path / "1.mp4")
    chat = {"id": "c", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo."}]}
    pack = _pack(tmp_path, [_record("v", "<video>", "1.mp4"), chat])  # the chat: not an empty pack
    (reject,) = [json.loads(line) for line in (pack / "rejects.jsonl").read_text().splitlines()]
    detail = reject["detail"]
    assert reject["reason"] == "overlong" and "video 1.mp4" in detail, detail
    said = re.findall(r"model\.(\w+) ([\d.]+) \((\d+) video tokens", detail)
    assert {key for key, _, _ in said} == {"maxFrames", "fps", "videoMaxPixels"}, detail
    # Each suggestion, tokenized as the packer counts it, gives the stated video tokens and fits.
    fields = {"maxFrames": "max_frames", "fps": "fps", "videoMaxPixels": "video_max_pixels"}
    for key, value, tokens in said:
        total, video = _video_tokens(tmp_path, **{fields[key]: float(value) if key == "fps" else int(value)})
        assert video == int(tokens) and total <= MAX_LENGTH, (key, value, total, video)


def test_overlong_error_policy_says_which_settings_fit(tmp_path: Path) -> None:
    shutil.copyfile(VIDEO, tmp_path / "1.mp4")
    (tmp_path / "data.json").write_text(json.dumps([_record("v", "<video>", "1.mp4")]))
    result = packtrain("pack", "run", "--input", str(tmp_path / "data.json"), "--model", str(QWEN2),
                       "--max-length", str(MAX_LENGTH), "--overlong", "error", "-o", str(tmp_path / "p"),
                       "--workers", "1", "--no-progress")  # fmt: skip
    err = one_line_error(result, 2)
    assert "model.maxFrames" in err and "model.videoMaxPixels" in err and "raise packing.maxLength" in err


def test_inspect_plot_says_where_it_wrote(image_pack: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "fill.png"
    table = packtrain("pack", "inspect", str(image_pack), "--plot", str(png))
    assert table.returncode == 0, table.stderr[-3000:]
    assert f"plot written to {png}" in table.stdout and png.stat().st_size > 0
    png.unlink()
    line = packtrain("pack", "inspect", str(image_pack), "--plot", str(png), "--json")
    assert line.returncode == 0, line.stderr[-3000:]
    assert json.loads(line.stdout)["packed"] == 2  # stdout stays one JSON line
    assert f"plot written to {png}" in line.stderr and png.is_file()
