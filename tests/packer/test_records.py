"""Reading inputs (files, globs, JSON vs JSONL) and turning records of every layout into labelled samples."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import media_factory as mf
import pytest
from support.paths import SHARED

from packtrain.core.config import FieldMap, ModelConfig, PackingConfig, SourceConfig
from packtrain.core.errors import ConfigError
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.sources.records import expand_paths, iter_records
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

MODEL = SHARED / "models" / "qwen2-vl"
VIDEO_DEMO = SHARED / "datasets" / "llamafactory-mllm-demo" / "mllm_video_demo.json"
TEXT_SFT = SHARED / "datasets" / "text-sft"


def _write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_globs_are_sorted_and_formats_detected_by_content(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "b.jsonl", [{"n": 1}, {"n": 2}])
    (tmp_path / "a.json").write_text(json.dumps([{"n": 0}]))
    (tmp_path / "c.data").write_text("\n" + json.dumps({"n": 3}) + "\n\n" + json.dumps({"n": 4}) + "\n")
    raws = list(iter_records(["*.json*", "c.data", "a.json"], base_dir=tmp_path))
    assert [(r.source.name, r.index, r.record) for r in raws] == [
        ("a.json", 0, {"n": 0}),
        ("b.jsonl", 0, {"n": 1}),
        ("b.jsonl", 1, {"n": 2}),
        ("c.data", 0, {"n": 3}),
        ("c.data", 1, {"n": 4}),
    ]
    assert [p.name for p in expand_paths(["*.json*"], tmp_path)] == ["a.json", "b.jsonl"]


@pytest.mark.parametrize("pattern", ["missing.jsonl", "nothing-*.jsonl"])
def test_unmatched_path_is_a_config_error(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern.replace("*", r"\*")):
        list(iter_records([pattern], base_dir=tmp_path))


def test_bad_lines_become_errors_and_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": \n\xff\xfe{"a": 2}\n[1, 2]\n{"a": 3}\n')
    raws = list(iter_records([str(path)]))
    assert [(r.index, r.reason) for r in raws] == [
        (0, None),
        (1, "bad_json"),
        (2, "bad_utf8"),
        (3, "malformed_record"),
        (4, None),
    ]
    assert raws[1].error is not None and "line 2" in raws[1].error
    assert raws[4].record == {"a": 3}


def test_broken_json_array_keeps_the_items_before_the_break(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('[{"a": 1}, {"a": ')
    raws = list(iter_records([str(tmp_path / "x.json")]))
    assert [(r.index, r.record, r.reason) for r in raws] == [(0, {"a": 1}, None), (1, None, "bad_json")]


@functools.cache
def _tok(label_mode: str = "all_assistant") -> SampleTokenizer:
    return _make_tok(SourceConfig(paths=["unused"]), label_mode)


def _make_tok(source: SourceConfig, label_mode: str = "all_assistant") -> SampleTokenizer:
    return SampleTokenizer(source, ModelConfig(path=str(MODEL)), PackingConfig(label_mode=label_mode))


def _run(
    record: dict[str, Any], tok: SampleTokenizer | None = None, source: Path = Path("d.jsonl")
) -> TokenizedSample | Reject:
    return (tok or _tok())(RawRecord(source, 7, record, None))


def _trained_text(tok: SampleTokenizer, sample: TokenizedSample) -> str:
    return tok.model.tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])


CHAT = {
    "conversations": [
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "See you."},
    ]
}


@pytest.mark.parametrize(
    ("mode", "trained"),
    [
        ("all_assistant", "Hello!<|im_end|>See you.<|im_end|>"),
        ("last_assistant", "See you.<|im_end|>"),
    ],
)
def test_label_modes(mode: str, trained: str) -> None:
    tok = _tok(mode)
    sample = _run(CHAT, tok)
    assert isinstance(sample, TokenizedSample)
    assert _trained_text(tok, sample) == trained
    assert len(sample.labels) == len(sample.input_ids)


def test_label_mode_all_trains_everything_but_vision_tokens() -> None:
    tok = _tok("all")
    record = {
        "messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Yo"}],
        "images": ["1.jpg"],
    }
    sample = _run(record, tok, SHARED / "datasets" / "llamafactory-mllm-demo" / "mllm_demo_data" / "d.json")
    assert isinstance(sample, TokenizedSample)
    vision = {tok.model.ids.image_pad, tok.model.ids.vision_start, tok.model.ids.vision_end}
    for token, label in zip(sample.input_ids, sample.labels, strict=True):
        assert label == (IGNORE_INDEX if token in vision else token)


def test_sample_id_is_the_record_id_else_file_and_index() -> None:
    assert _run(CHAT).sample_id == "d.jsonl:7"
    assert _run({**CHAT, "id": 12}).sample_id == "12"


def test_formats_render_the_same_conversation(tmp_path: Path) -> None:
    mf.image(tmp_path / "p.png", 64, 64)
    sharegpt = {
        "conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A."}],
        "image": "p.png",
    }
    messages = {
        "messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}],
        "images": ["p.png"],
    }
    typed = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": "p.png"}, {"type": "text", "text": "What?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A."}]},
        ]
    }
    results = [_run(r, source=tmp_path / "d.json") for r in (sharegpt, messages, typed)]
    assert all(isinstance(r, TokenizedSample) for r in results), results
    assert results[0].input_ids == results[1].input_ids == results[2].input_ids
    assert results[0].media[0].key == results[2].media[0].key


def test_forced_format_and_field_map() -> None:
    fm = FieldMap(
        conversations="dialog",
        role_key="speaker",
        content_key="text",
        user_roles=["q"],
        assistant_roles=["a"],
    )
    tok = _make_tok(SourceConfig(paths=["unused"], format="sharegpt", field_map=fm))
    sample = _run({"dialog": [{"speaker": "q", "text": "2+2?"}, {"speaker": "a", "text": "4"}]}, tok)
    assert isinstance(sample, TokenizedSample)
    assert _trained_text(tok, sample) == "4<|im_end|>"
    wrong = _run({"messages": [{"role": "user", "content": "x"}]}, tok)
    assert isinstance(wrong, Reject) and wrong.reason == "malformed_record"


def test_system_field_and_tool_calls() -> None:
    record = json.loads((TEXT_SFT / "glaive-toolcall" / "glaive_toolcall_en_demo.json").read_text())[0]
    tok = _tok()
    sample = _run({**record, "system": "Be brief."}, tok)
    assert isinstance(sample, TokenizedSample)
    text = tok.model.tokenizer.decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "search_recipes"' in text
    assert "<|im_start|>user\n<tool_response>\n" in text
    trained = _trained_text(tok, sample)
    assert trained.count("<tool_call>\n{") == 1
    assert "<tool_response>" not in trained


def test_shared_text_sets_all_convert() -> None:
    tok = _tok()
    for name in ("fastchat", "glaive-toolcall"):
        raws = list(iter_records([str(TEXT_SFT / name / "*.json")]))
        results = [tok(r) for r in raws]
        assert all(isinstance(r, TokenizedSample) for r in results), name


def test_llava_records_without_images_are_missing_media() -> None:
    raws = list(iter_records([str(TEXT_SFT / "llava-instruct-100" / "*.json")]))[:5]
    results = [_tok()(r) for r in raws]
    assert {r.reason for r in results if isinstance(r, Reject)} == {"missing_media"}
    assert results[0].sample_id == raws[0].record["id"]


def test_truncate_keeps_vision_runs_whole() -> None:
    demo = SHARED / "datasets" / "llamafactory-mllm-demo" / "mllm_demo.json"
    sample = _tok()(next(iter_records([str(demo)])))
    assert isinstance(sample, TokenizedSample) and len(sample.media) == 2
    ids = sample.input_ids
    second_start = [i for i, t in enumerate(ids) if t == _tok().model.ids.vision_start][1]
    cut = _tok().truncate(sample, second_start + 5)
    assert cut is not None
    assert len(cut.input_ids) == second_start and len(cut.media) == 1
    assert cut.input_ids == ids[:second_start] and cut.labels == sample.labels[:second_start]
    assert _tok().truncate(sample, 20) is None
    assert _tok().truncate(sample, len(ids)) is sample


def test_packer_imports_carry_no_torch() -> None:
    """Loading the tokenizer and converting a record must not pull torch into a packer worker."""
    code = (
        "import sys\n"
        "from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig\n"
        "from packtrain.packer.sources.records import iter_records\n"
        "from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample\n"
        f"tok = SampleTokenizer(SourceConfig(paths=['x']), ModelConfig(path={str(MODEL)!r}), "
        "PackingConfig())\n"
        f"raw = next(iter_records([{str(VIDEO_DEMO)!r}]))\n"
        "assert isinstance(tok(raw), TokenizedSample)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_custom_chat_template_overrides_the_folder(tmp_path: Path) -> None:
    template = json.loads((MODEL / "chat_template.json").read_text())["chat_template"]
    custom = tmp_path / "t.jinja"
    custom.write_text(template.replace("You are a helpful assistant.", "Custom system."))
    source = SourceConfig(paths=["unused"])
    tok = SampleTokenizer(source, ModelConfig(path=str(MODEL), chat_template=str(custom)), PackingConfig())
    sample = _run(CHAT, tok)
    assert isinstance(sample, TokenizedSample)
    assert tok.model.tokenizer.decode(sample.input_ids).startswith(
        "<|im_start|>system\nCustom system.<|im_end|>"
    )
    assert _trained_text(tok, sample) == "Hello!<|im_end|>See you.<|im_end|>"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "assistant turns"),
        ("{{ raise_exception('no') }}", "does not render"),
    ],
)
def test_template_without_chatml_markers_is_a_config_error(tmp_path: Path, template: str, match: str) -> None:
    custom = tmp_path / "t.jinja"
    custom.write_text(template)
    with pytest.raises(ConfigError, match=match):
        SampleTokenizer(
            SourceConfig(paths=["x"]),
            ModelConfig(path=str(MODEL), chat_template=str(custom)),
            PackingConfig(),
        )


def test_bad_model_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.path"):
        SampleTokenizer(SourceConfig(paths=["x"]), ModelConfig(path=str(tmp_path / "none")), PackingConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError):
        SampleTokenizer(SourceConfig(paths=["x"]), ModelConfig(path=str(tmp_path / "empty")), PackingConfig())


def test_media_root_config(tmp_path: Path) -> None:
    mf.image(tmp_path / "media" / "a.png", 50, 50)
    record = {
        "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
        "images": ["a.png"],
    }
    source = SourceConfig(paths=["unused"], media_root="media")
    tok = SampleTokenizer(source, ModelConfig(path=str(MODEL)), PackingConfig(), base_dir=tmp_path)
    assert isinstance(_run(record, tok, tmp_path / "elsewhere" / "d.json"), TokenizedSample)
    with pytest.raises(ConfigError, match="mediaRoot"):
        SampleTokenizer(
            SourceConfig(paths=["x"], media_root=str(tmp_path / "nope")),
            ModelConfig(path=str(MODEL)),
            PackingConfig(),
        )
