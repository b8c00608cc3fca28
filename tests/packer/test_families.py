"""The family registry bound to the real model folders, the newline label option, and Qwen3-VL video runs."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import media_factory as mf
import numpy as np
import pytest
from support.paths import DEMO, MODELS

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.core.errors import ConfigError
from packtrain.core.families import FAMILIES
from packtrain.core.model_spec import detect_family, family_for_model_type, get_family, model_spec
from packtrain.core.pack.integrity import grid_problem, model_facts
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample

NAMES = sorted(FAMILIES)


# The MoE variants share the dense model's tokenizer and processors; ../shared holds no MoE folder, so
# theirs is the dense one with the MoE config's model type and architecture.
DENSE_OF = {"qwen3.5-moe": "qwen3.5", "qwen3-vl-moe": "qwen3-vl"}
# Shared folders named other than their family.
FOLDER_OF = {"internvl": "internvl3.5"}


@functools.cache
def _folder(family: str) -> Path:
    if family not in DENSE_OF:
        return MODELS / FOLDER_OF.get(family, family)
    folder = Path(tempfile.mkdtemp(prefix=f"{family}-"))
    shutil.copytree(MODELS / DENSE_OF[family], folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = FAMILIES[family].model_type
    config["architectures"] = [FAMILIES[family].model_class]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@functools.cache
def _tok(family: str, label_mode: str = "all_assistant", newline: bool = False) -> SampleTokenizer:
    return SampleTokenizer(
        SourceConfig(paths=["unused"]),
        ModelConfig(family=family, path=str(_folder(family)), maxFrames=8),
        PackingConfig(label_mode=label_mode, label_newline_after_turn_end=newline),
    )


@pytest.mark.parametrize("name", NAMES)
def test_each_model_folder_binds_to_its_entry(shared_dir: Path, name: str) -> None:
    """Ids come from the folder's tokenizer files and agree with the loaded tokenizer and config.json."""
    folder = _folder(name)
    assert detect_family(folder) is FAMILIES[name] is get_family(name)
    assert family_for_model_type(FAMILIES[name].model_type) is FAMILIES[name]
    spec = model_spec(folder)
    tokenizer = _tok(name).model.tokenizer
    for role, text in FAMILIES[name].token_names.items():
        assert getattr(spec.token_ids, role) == tokenizer.convert_tokens_to_ids(text)
    config = json.loads((folder / "config.json").read_text())
    assert spec.token_ids.image_pad == config["image_token_id"]
    # InternVL's config names no video token: its videos are image-context runs, one per frame.
    assert spec.token_ids.video_pad == config.get("video_token_id", spec.token_ids.video_pad)
    assert ("video_token_id" in config) == (FAMILIES[name].video_fill == "video_pad")
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    assert spec.vision.patch_size == pre.get("patch_size", 14) == FAMILIES[name].patch_size
    assert spec.vision.image_mean == tuple(pre["image_mean"])


def test_a_folder_mixing_two_models_is_refused(shared_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(MODELS / "qwen3-vl", folder)
    config = json.loads((folder / "config.json").read_text())
    config["image_token_id"] = 151600
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="image_token_id"):
        model_spec(folder)
    with pytest.raises(ConfigError, match="not one of"):
        get_family("llava")
    with pytest.raises(ConfigError, match="model_type"):
        family_for_model_type("llama")


CHAT = {
    "conversations": [
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "See you."},
    ]
}


@pytest.mark.parametrize(
    ("mode", "newline", "trained"),
    [
        ("all_assistant", False, "Hello!<|im_end|>See you.<|im_end|>"),
        ("all_assistant", True, "Hello!<|im_end|>\nSee you.<|im_end|>\n"),
        ("last_assistant", False, "See you.<|im_end|>"),
        ("last_assistant", True, "See you.<|im_end|>\n"),
    ],
)
def test_newline_after_turn_end_is_trained_only_when_asked(
    shared_dir: Path, mode: str, newline: bool, trained: str
) -> None:
    tok = _tok("qwen3-vl", mode, newline)
    sample = tok(RawRecord(Path("d.jsonl"), 0, CHAT, None))
    assert isinstance(sample, TokenizedSample)
    assert tok.model.tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX]) == trained
    plain = _tok("qwen3-vl", mode, False)(RawRecord(Path("d.jsonl"), 0, CHAT, None))
    assert isinstance(plain, TokenizedSample) and plain.input_ids == sample.input_ids
    extra = sum(t != IGNORE_INDEX for t in sample.labels) - sum(t != IGNORE_INDEX for t in plain.labels)
    assert extra == (trained.count("\n") if newline else 0)


def _video_sample(tok: SampleTokenizer) -> TokenizedSample:
    record = {
        "messages": [
            {"role": "user", "content": "<image>Look."},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "<video>And this?"},
            {"role": "assistant", "content": "A dog."},
        ],
        "images": ["1.jpg"],
        "videos": ["1.mp4"],
    }
    sample = tok(RawRecord(DEMO / "mllm_demo_data" / "d.json", 0, record, None))
    assert isinstance(sample, TokenizedSample), sample
    return sample


def test_qwen3_video_is_one_run_of_timestamped_groups(shared_dir: Path) -> None:
    """A video is its timestamped groups with no outer vision pair (the processor's layout); truncation
    keeps them whole, timestamps included; `label_mode: all` skips its timestamps; the integrity check
    counts one pad run per temporal group."""
    tok = _tok("qwen3-vl")
    ids = tok.model.ids
    sample = _video_sample(tok)
    video = sample.media[1]
    starts = [i for i, t in enumerate(sample.input_ids) if t == ids.vision_start]
    assert len(starts) == 1 + video.grid_t  # the image, one per group
    first_stamp = tok.model.tokenizer.encode("<0.2 seconds>", add_special_tokens=False)
    video_start = starts[1] - len(first_stamp)
    assert tok.model.tokenizer.decode(sample.input_ids[video_start : starts[1]]).endswith(" seconds>")
    assert sample.input_ids[video_start - 1] != ids.vision_start
    for inside in (starts[2] + 3, starts[1] - 1):  # inside a later group, inside the first timestamp
        cut = tok.truncate(sample, inside)
        assert cut is not None and len(cut.media) == 1
        assert tok.model.tokenizer.decode(cut.input_ids[-3:]).endswith("<|im_start|>user\n")
    ends = [i for i, t in enumerate(sample.input_ids) if t == ids.vision_end]
    assert tok.truncate(sample, ends[-1] + 1) is not None
    assert len(tok.truncate(sample, ends[-1] + 1).media) == 2  # type: ignore[union-attr]
    everything = _tok("qwen3-vl", "all")
    labelled = _video_sample(everything)
    trained = everything.model.tokenizer.decode([t for t in labelled.labels if t != IGNORE_INDEX])
    assert "seconds" not in trained and "<|vision" not in trained and "A dog." in trained
    facts, _ = model_facts(MODELS / "qwen3-vl")
    refs = [
        {"sample": 0, "kind": m.kind, "grid_t": m.grid_t, "grid_h": m.grid_h, "grid_w": m.grid_w}
        for m in sample.media
    ]
    arr = np.asarray(sample.input_ids)
    assert grid_problem(arr, [len(arr)], refs, facts) is None
    refs[1]["grid_t"] += 1
    assert grid_problem(arr, [len(arr)], refs, facts) is not None


def test_odd_video_pads_its_last_group(shared_dir: Path, tmp_path: Path) -> None:
    """2.5 s at 2 fps: 5 sampled frames, three groups, the last padded with the final frame."""
    path = mf.video(tmp_path / "v.mp4", frames=25, fps=10)
    record = {
        "messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "!"}],
        "videos": [path.name],
    }
    tok = _tok("qwen3-vl")
    sample = tok(RawRecord(tmp_path / "d.json", 0, record, None))
    assert isinstance(sample, TokenizedSample), sample
    video = sample.media[0]
    assert video.frames == [0, 6, 12, 18, 24] and video.grid_t == 3
    text = tok.model.tokenizer.decode(sample.input_ids)
    assert "<0.3 seconds><|vision_start|>" in text and "<1.5 seconds>" in text and "<2.4 seconds>" in text


@pytest.mark.parametrize("name", ["qwen3-vl", "qwen3.5"])
def test_qwen3_example_packs_and_verifies(shared_dir: Path, tmp_path: Path, name: str) -> None:
    """examples/qwen3-vl.yaml's and examples/qwen3.5.yaml's model settings pack the demo images and
    videos into a pack that `pack verify` finds sound (one pad run per temporal group), in both media
    storage modes."""
    from packtrain.core.config import PackConfig, load_pack_config
    from packtrain.packer.stages.convert import convert
    from packtrain.packer.stages.materialize import materialize
    from packtrain.packer.stages.plan import plan
    from packtrain.packer.tools import verify

    example = load_pack_config(Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml")
    assert example.model.family == name
    for storage in ("original", "resized"):
        cfg = PackConfig.model_validate(
            {
                "source": {"paths": [str(DEMO / "mllm_demo.json"), str(DEMO / "mllm_video_demo.json")]},
                "model": {**example.model.dump(), "path": str(MODELS / name)},
                "packing": {"maxLength": 4096, "mediaStorage": storage},
            }
        )
        out = tmp_path / storage
        summary = convert(cfg, out, 0, 1)
        plan(cfg, out)
        materialize(cfg, out, 0, 1)
        assert verify(out) == [], summary
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["counts"]["packed"], manifest["counts"]["rejected"]) == (9, 0), manifest["counts"]


def test_video_sampling_settings_come_from_the_folder_unless_configured(
    shared_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(MODELS / "qwen3-vl", folder)
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    video.update({"fps": 1, "min_frames": 2, "max_frames": 8})
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    vision = model_spec(folder).vision
    assert (vision.fps, vision.min_frames, vision.max_frames) == (1.0, 2, 8)
    configured = ModelConfig(family="qwen3-vl", path=str(folder), fps=3, maxFrames=16)
    vision = model_spec(folder, cfg=configured).vision
    assert (vision.fps, vision.min_frames, vision.max_frames) == (3.0, 2, 16)
    assert (
        model_spec(MODELS / "qwen3-vl").vision.fps,
        model_spec(MODELS / "qwen3-vl").vision.max_frames,
    ) == (
        2.0,
        768,
    )


QWEN35_CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "function_call", "content": '{"name": "weather", "arguments": {"city": "Paris"}}'},
    {"role": "observation", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool said 21."},
]


def _rendered_assistant_turns(text: str, turn_end: str) -> list[str]:
    """Each assistant turn of a rendered chat, from after its header through its end token."""
    return [t.split(turn_end, 1)[0] + turn_end for t in text.split("<|im_start|>assistant\n")[1:]]


@pytest.mark.parametrize("mode", ["all_assistant", "last_assistant"])
def test_qwen35_labels_are_the_assistant_turns_as_rendered(shared_dir: Path, mode: str) -> None:
    """Labels cover each assistant turn exactly as the template renders it: the `<think>` block it
    writes after the last user query (reasoning, or empty) is trained; history reasoning is not rendered."""
    tok = _tok("qwen3.5", mode)
    sample = tok(RawRecord(Path("d.json"), 0, {"messages": QWEN35_CHAT}, None))
    assert isinstance(sample, TokenizedSample), sample
    tokenizer = tok.model.tokenizer
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": json.loads(m["content"])}]}
        if m["role"] == "function_call"
        else {**m, "role": "tool" if m["role"] == "observation" else m["role"]}
        for m in QWEN35_CHAT
    ]
    text = tokenizer.apply_chat_template(messages, chat_template=tok.model.chat_template, tokenize=False)
    assert tokenizer.decode(sample.input_ids) == text
    turns = _rendered_assistant_turns(text, "<|im_end|>")
    assert turns == [
        "Hello!<|im_end|>",
        "<think>\n\n</think>\n\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
        "<think>\nThe tool said 21.\n</think>\n\n21 degrees.<|im_end|>",
    ]
    trained = tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])
    assert trained == "".join(turns if mode == "all_assistant" else turns[-1:])


def test_qwen35_function_call_must_be_a_json_call(shared_dir: Path) -> None:
    """Qwen3.5 writes a call as XML blocks from its name and arguments, so a call that is not a JSON
    object with a name is a malformed record; the JSON-style families keep the text verbatim."""
    record = {
        "conversations": [
            {"from": "human", "value": "Go"},
            {"from": "function_call", "value": "weather(Paris)"},
            {"from": "observation", "value": "21"},
            {"from": "gpt", "value": "21."},
        ]
    }
    bad = _tok("qwen3.5")(RawRecord(Path("d.json"), 0, record, None))
    assert not isinstance(bad, TokenizedSample) and bad.reason == "malformed_record"
    assert "function call" in bad.detail
    assert isinstance(_tok("qwen3-vl")(RawRecord(Path("d.json"), 0, record, None)), TokenizedSample)
    record["conversations"][1]["value"] = '{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
    sample = _tok("qwen3.5")(RawRecord(Path("d.json"), 0, record, None))
    assert isinstance(sample, TokenizedSample), sample
    assert "<parameter=city>\nParis\n</parameter>" in _tok("qwen3.5").model.tokenizer.decode(sample.input_ids)
    record["conversations"][3]["reasoning_content"] = ["not", "text"]
    bad = _tok("qwen3.5")(RawRecord(Path("d.json"), 0, record, None))
    assert not isinstance(bad, TokenizedSample) and bad.reason == "malformed_record"
    assert "'reasoning_content' is a list" in bad.detail
