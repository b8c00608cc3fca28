"""A video that does not decode is one `corrupt_media` reject, never a failed pack.

Convert counts a video's tokens from its headers without decoding a frame, so it rejects what the
headers and packets show (a truncated file, a header promising more frames than are present);
materialize decodes the sampled frames (for `original` storage too, as the trainer will) and
drops a sample whose video does not, from its sequence, as a reject. Either way the pack finishes,
its counts add up (overall, per reason, per source) and `pack verify` passes, whatever the number
of workers and however often materialize is re-run. Real PyAV on corrupted copies of the shared
demo videos.
"""

from __future__ import annotations

import errno
import io
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import media_factory as mf
import pytest
from support.pack_runner import run_in_process
from support.paths import DEMO, MODELS

from packtrain.core.config import PackConfig
from packtrain.core.errors import ConfigError, MediaError, ShardFormatError
from packtrain.core.output_lock import LOCK_FILE
from packtrain.core.pack.shards import MANIFEST, REJECTS, ShardReader, read_table
from packtrain.packer import local, tools
from packtrain.packer.cli import main as pack_main
from packtrain.packer.media.store import check_frames, decode_failure, video_frames
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.workdir import SHARD_REJECTS, PackRefused, refusal

DEMO_MEDIA = DEMO / "mllm_demo_data"
QWEN2 = MODELS / "qwen2-vl"
BAD = "bad-sample"
MAX_LENGTH = 384  # a video and a few text samples per sequence: the corrupt one shares its sequence


def _noise_middle(src: Path, dst: Path) -> None:
    """The bytes from 30% to 60% of the file overwritten with noise: headers and packet index intact."""
    data = bytearray(src.read_bytes())
    start, end = len(data) * 3 // 10, len(data) * 6 // 10
    rng = random.Random(0)
    data[start:end] = bytes(rng.randrange(256) for _ in range(end - start))
    dst.write_bytes(bytes(data))


def _noise_frames(src: Path, dst: Path) -> None:
    """Every byte of the mp4's media data noise: a well-formed container whose frames do not decode."""
    data = bytearray(src.read_bytes())
    start = data.find(b"mdat") + 4
    size = int.from_bytes(data[start - 8 : start - 4], "big")
    rng = random.Random(1)
    data[start : start + size - 8] = bytes(rng.randrange(256) for _ in range(size - 8))
    dst.write_bytes(bytes(data))


def _truncated(src: Path, dst: Path) -> None:
    mf.truncated_copy(src, dst, keep=0.9)


def _header_lies(src: Path, dst: Path) -> None:
    """An AVI whose stream header promises 100 more frames than the file holds."""
    data = bytearray(src.read_bytes())
    at = data.find(b"strh") + 8 + 32  # AVISTREAMHEADER.dwLength
    data[at : at + 4] = (int.from_bytes(data[at : at + 4], "little") + 100).to_bytes(4, "little")
    dst.write_bytes(bytes(data))


# name -> (source demo video, corruption, stage that finds it, words of the reject's detail)
CORRUPTIONS: dict[str, tuple[str, Callable[[Path, Path], None], str, str]] = {
    "noise_middle": ("1.mp4", _noise_middle, "materialize", "does not decode"),
    "noise_frames": ("3.mp4", _noise_frames, "materialize", "does not decode"),
    "truncated": ("1.mp4", _truncated, "convert", "does not open"),
    "header_lies": ("2.avi", _header_lies, "convert", "truncated"),
}


def _dataset(root: Path, corruption: str) -> Path:
    """Two sources: demo videos, an image and one corrupt video among text samples; and text only."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name in ("1.mp4", "3.mp4", "2.avi", "1.jpg"):
        shutil.copyfile(DEMO_MEDIA / name, data / name)
    src, corrupt, _, _ = CORRUPTIONS[corruption]
    bad = data / f"{corruption}{Path(src).suffix}"
    corrupt(DEMO_MEDIA / src, bad)

    def chat(n: int, prompt: str, **media: list[str]) -> dict:
        return {
            "messages": [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": f"Answer {n}."},
            ],
            **media,
        }

    rows = [
        {"id": "v1", **chat(1, "<video>What happens?", videos=["1.mp4"])},
        {"id": "t1", **chat(2, "Say hi.")},
        {"id": BAD, **chat(3, "<video>Describe it.", videos=[bad.name])},
        {"id": "t2", **chat(4, "Count to three.")},
        {"id": "i1", **chat(5, "<image>What is this?", images=["1.jpg"])},
        {"id": "v3", **chat(6, "<video>And this one?", videos=["3.mp4"])},
        {"id": "v2", **chat(7, "<video>What is she doing?", videos=["2.avi"])},
    ]
    (data / "media.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = [{"id": f"x{n}", **chat(10 + n, "Tell me something. " * (1 + n % 5))} for n in range(12)]
    (data / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    return data


def _config(data: Path, storage: str = "original", max_length: int = MAX_LENGTH) -> PackConfig:
    return PackConfig.model_validate(
        {
            "source": {"paths": [str(data / "media.jsonl"), str(data / "text.jsonl")]},
            "model": {
                "path": str(QWEN2),
                "family": "qwen2-vl",
                "maxPixels": 100_000,
                "videoMaxPixels": 60_000,
                "fps": 1.0,
            },
            "packing": {
                "maxLength": max_length,
                "mediaStorage": storage,
                "sequencesPerShard": 2,
                "maxRejectedFraction": 1.0,  # rejects are the point here; the limit has its own test
            },
        }
    )


def _sequence_of(out: Path, sample_id: str) -> list[str]:
    """The ids of the samples plan put in one sequence with `sample_id` (itself included)."""
    part = read_table(out / "work" / "convert" / "part-00000-of-00001.arrow").column("sample_id").to_pylist()
    for rows in read_table(out / "work" / "plan.arrow").column("rows").to_pylist():
        if sample_id in (ids := [part[r] for r in rows]):
            return ids
    raise AssertionError(f"{sample_id} is in no planned sequence")


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.relative_to(out).parts[0] not in ("work", LOCK_FILE)  # `pack run`'s claim
    }


def _assert_one_reject(out: Path, manifest: dict, detail: str, bad_name: str) -> None:
    counts = manifest["counts"]
    assert (counts["input"], counts["packed"], counts["rejected"]) == (19, 18, 1)
    assert counts["rejected_by_reason"] == {"corrupt_media": 1}
    assert counts["sources"] == {
        str(out.parent / "data" / "media.jsonl"): {"records": 7, "input": 7, "packed": 6, "rejected": 1},
        str(out.parent / "data" / "text.jsonl"): {"records": 12, "input": 12, "packed": 12, "rejected": 0},
    }
    (reject,) = [json.loads(line) for line in (out / REJECTS).read_text().splitlines()]
    assert (reject["id"], reject["index"], reject["reason"]) == (BAD, 2, "corrupt_media")
    assert bad_name in reject["detail"] and detail in reject["detail"], reject["detail"]
    assert tools.verify(out) == []
    assert BAD not in {s["id"] for s in tools.unpack(out)}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_video_is_one_reject_wherever_it_is_found(corruption: str, tmp_path: Path) -> None:
    src, _, stage, detail = CORRUPTIONS[corruption]
    data = _dataset(tmp_path, corruption)
    out = tmp_path / "pack"
    manifest = local.run_all(_config(data), out, workers=1, show_progress=False)
    _assert_one_reject(out, manifest, detail, f"{corruption}{Path(src).suffix}")
    plan = json.loads((out / "work" / "plan.json").read_text())["summary"]
    found_by_plan = plan["rejected"] == 1
    assert found_by_plan == (stage == "convert")
    if stage == "materialize":  # planned with the others, dropped from its sequence by materialize
        part = read_table(out / "work" / "convert" / "part-00000-of-00001.arrow").to_pylist()
        bad_length = next(r["length"] for r in part if r["sample_id"] == BAD)
        assert plan["packed"] == 19 and manifest["tokens"] == plan["tokens"] - bad_length
        planned = _sequence_of(out, BAD)
        assert len(planned) > 1  # it shared its sequence: the others stay, the sequence is shorter
        rows = [r["sample_ids"] for r in ShardReader(out)]
        assert [i for i in planned if i != BAD] in rows
        assert manifest["sequences"] == plan["sequences"] == len(rows)
        assert manifest["lower_bound"] == -(-manifest["tokens"] // MAX_LENGTH)
        assert manifest["fill_ratio"] == round(manifest["tokens"] / (manifest["sequences"] * MAX_LENGTH), 6)


@pytest.fixture(scope="module")
def materialize_reject(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A pack, one worker, whose corrupt video materialize found."""
    root = tmp_path_factory.mktemp("one")
    out = root / "pack"
    manifest = local.run_all(_config(_dataset(root, "noise_middle")), out, workers=1, show_progress=False)
    return out, manifest


def test_the_same_pack_and_counts_for_one_two_and_three_workers(
    materialize_reject: tuple[Path, dict], tmp_path: Path
) -> None:
    out1, manifest1 = materialize_reject
    cfg = _config(out1.parent / "data")
    assert len(manifest1["shards"]) > 1  # the reject's shard is one of several
    forked = tmp_path / "forked"
    assert local.run_all(cfg, forked, workers=2, show_progress=False) == manifest1
    assert _files(forked) == _files(out1)
    for workers in (2, 3):  # the stages' own slicing, as pods run them
        out = tmp_path / f"sliced-{workers}"
        assert run_in_process(cfg, out, workers=workers) == manifest1
        assert _files(out) == _files(out1)


def test_rerun_and_resumed_materialize_count_the_reject_once(
    materialize_reject: tuple[Path, dict], tmp_path: Path
) -> None:
    done, manifest = materialize_reject
    out = tmp_path / "pack"
    shutil.copytree(done, out)  # the manifest's paths are relative to the pack: a copy is the same pack
    cfg = _config(done.parent / "data")
    again = materialize(cfg, out, 0, 1)
    assert (again["written"], again["rejected"], again["manifest"]) == (0, 1, True)
    assert again["pack"] is not None and again["pack"]["rejected_by_reason"] == {"corrupt_media": 1}
    assert _files(out) == _files(done)
    # A killed run: the reject's shard and the manifest are gone; materialize writes them again.
    shard = next(
        p
        for p in sorted((out / "work" / "shards").glob("*.json"))
        if json.loads(p.read_text())[SHARD_REJECTS]
    )
    (out / MANIFEST).unlink()
    (out / json.loads(shard.read_text())["file"]).unlink()
    shard.unlink()
    for i in range(2):
        materialize(cfg, out, i, 2)
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert _files(out) == _files(done)


def test_inspect_and_verify_report_the_final_counts(
    materialize_reject: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    out, manifest = materialize_reject
    assert pack_main(["inspect", str(out), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["samples"], line["packed"], line["rejected"]) == (19, 18, 1)
    assert line["sequences"] == manifest["sequences"]
    assert pack_main(["verify", str(out)]) == 0
    assert "18 packed + 1 rejected = 19" in capsys.readouterr().out
    tools.print_stats(manifest, out)
    assert "rejected: corrupt_media" in capsys.readouterr().err


def test_a_sequence_left_empty_is_dropped(tmp_path: Path) -> None:
    """At 320 tokens the corrupt video's sample (294) sits alone: its whole sequence goes."""
    out = tmp_path / "pack"
    manifest = local.run_all(
        _config(_dataset(tmp_path, "noise_middle"), max_length=320), out, workers=1, show_progress=False
    )
    assert _sequence_of(out, BAD) == [BAD]
    plan = json.loads((out / "work" / "plan.json").read_text())["summary"]
    assert manifest["sequences"] == plan["sequences"] - 1 == sum(s["rows"] for s in manifest["shards"])
    _assert_one_reject(out, manifest, "does not decode", "noise_middle.mp4")


def test_resized_storage_rejects_the_same_sample(tmp_path: Path) -> None:
    data = _dataset(tmp_path, "noise_middle")
    out = tmp_path / "pack"
    manifest = local.run_all(_config(data, "resized"), out, workers=1, show_progress=False)
    _assert_one_reject(out, manifest, "does not decode", "noise_middle.mp4")


def test_sampled_frames_the_stream_does_not_have_are_corrupt_media(tmp_path: Path) -> None:
    """A header that promises frames the bitstream does not hold: decoding ends before the sampled ones."""
    video = mf.video(tmp_path / "short.mp4", frames=6)
    with av.open(str(video)) as c:
        assert c.streams.video[0].frames == 6
    with video.open("rb") as f, pytest.raises(MediaError) as err:
        check_frames(f, [0, 4, 9, 11], "short.mp4")
    assert err.value.reason == "corrupt_media"
    assert "short.mp4" in err.value.detail and "[9, 11]" in err.value.detail


def test_the_operator_shows_the_counts_materialize_reported(
    materialize_reject: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pods' termination messages, as the operator reads them: the PackJob's stats end with the
    manifest's counts, not plan's (which still counted the corrupt video's sample as packed)."""
    from packtrain.operator.status import pack_stats

    done, manifest = materialize_reject
    out = tmp_path / "pack"
    shutil.copytree(done, out)
    (out / MANIFEST).unlink()
    for p in (out / "work" / "shards").glob("*.json"):
        p.unlink()
    (tmp_path / "spec.json").write_text(json.dumps(_config(done.parent / "data").dump()))
    messages = []
    for stage, index in (("plan", None), ("materialize", 0), ("materialize", 1)):
        log = tmp_path / f"{stage}-{index}.log"
        monkeypatch.setenv("PACKTRAIN_TERMINATION_LOG", str(log))
        slice_ = ["--index", str(index), "--count", "2"] if index is not None else []
        assert pack_main([stage, "-c", str(tmp_path / "spec.json"), "-o", str(out), *slice_]) == 0
        messages.append((stage, json.loads(log.read_text())))
    assert json.loads((out / MANIFEST).read_text()) == manifest
    summaries: dict[str, list[dict]] = {"plan": [], "materialize": []}
    for stage, message in messages:
        summaries[stage].append(message)
    assert summaries["plan"][0]["packed"] == 19
    assert sum(m["rejected"] for m in summaries["materialize"]) == 1
    stats = pack_stats(None, summaries)
    c = manifest["counts"]
    assert (stats["samplesIn"], stats["samplesPacked"], stats["samplesRejected"]) == (c["input"], 18, 1)
    assert stats["rejectedByReason"] == {"corrupt_media": 1}
    assert (stats["sequences"], stats["tokens"]) == (manifest["sequences"], manifest["tokens"])


def test_a_pack_left_without_samples_by_materialize_fails_no_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every sample's video does not decode: plan packed them all, materialize rejects them all. Both
    `pack materialize` and `pack run` exit 2 with NoSamples and publish no manifest (nothing can train
    on the pack; verify says why), the final counts still reach the operator, and a re-run refuses again."""
    from packtrain.operator.status import pack_stats

    data = _dataset(tmp_path, "noise_middle")
    (data / "only.jsonl").write_text((data / "media.jsonl").read_text().splitlines()[2] + "\n")
    spec = _config(data).dump()
    spec["source"]["paths"] = [str(data / "only.jsonl")]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    staged, log = tmp_path / "staged", tmp_path / "termination.log"
    monkeypatch.setenv("PACKTRAIN_TERMINATION_LOG", str(log))
    flags = ["-c", str(tmp_path / "spec.json"), "-o", str(staged)]
    assert pack_main(["convert", *flags]) == 0 and pack_main(["plan", *flags]) == 0
    assert pack_main(["materialize", *flags]) == 2
    said = json.loads(log.read_text())
    assert (said["reason"], said["stage"], said["pack"]["packed"]) == ("NoSamples", "materialize", 0)
    assert "no sample was packed" in capsys.readouterr().err
    stats = pack_stats(None, {"materialize": [said]})
    assert (stats["samplesPacked"], stats["rejectedByReason"]) == (0, {"corrupt_media": 1})
    assert not (staged / MANIFEST).exists()
    (problem,) = tools.verify(staged)
    assert "refused pack" in problem and "no sample was packed" in problem, problem
    assert pack_main(["verify", str(staged)]) == 2
    assert "refused pack" in capsys.readouterr().err
    with pytest.raises(ShardFormatError):  # what a trainer opens
        ShardReader(staged)
    assert pack_main(["materialize", *flags]) == 2  # a re-run: the same refusal, still no manifest
    assert json.loads(log.read_text()) == {**said, "written": 0} and not (staged / MANIFEST).exists()
    assert pack_main(["run", *flags[:2], "-o", str(tmp_path / "run"), "--workers", "1", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    line = json.loads(out.splitlines()[-1])  # the run's summary line
    assert (line["samples"], line["packed"], line["rejected"], line["sequences"]) == (1, 0, 1, 0)
    assert line["sources"] == {
        str(data / "only.jsonl"): {"records": 1, "input": 1, "packed": 0, "rejected": 1}
    }
    assert "no sample was packed" in err
    assert not (tmp_path / "run" / MANIFEST).exists()
    assert [json.loads(r)["reason"] for r in (tmp_path / "run" / REJECTS).read_text().splitlines()] == [
        "corrupt_media"
    ]


def test_too_many_rejected_by_materialize_publishes_no_manifest(
    materialize_reject: tuple[Path, dict], tmp_path: Path
) -> None:
    """1 of 19 rejected by materialize is over maxRejectedFraction 0.05 (plan saw none rejected): every
    worker count and every re-run refuses, and none leaves a manifest."""
    spec = _config(materialize_reject[0].parent / "data").dump()
    spec["packing"]["maxRejectedFraction"] = 0.05
    cfg = PackConfig.model_validate(spec)
    out = tmp_path / "pack"
    for _ in range(2):
        with pytest.raises(PackRefused) as refused:
            run_in_process(cfg, out, workers=2)
        assert refused.value.report["reason"] == "TooManyRejected"
        assert "1 of 19 samples rejected" in refused.value.report["error"]
        assert refused.value.summary is not None and refused.value.summary["pack"]["rejected"] == 1
        assert not (out / MANIFEST).exists()
    forked = tmp_path / "forked"
    with pytest.raises(PackRefused, match="maxRejectedFraction"):
        local.run_all(cfg, forked, workers=2, show_progress=False)
    assert not (forked / MANIFEST).exists()
    assert refusal(forked) == refusal(out) and refusal(out) is not None


class _FailingRead(io.RawIOBase):
    """A real video file whose reads fail past `at` bytes, as network storage can (EIO, ESTALE) or
    as memory runs out. Simulated: a real storage fault cannot be made in a test."""

    def __init__(self, path: Path, at: int, error: BaseException) -> None:
        self.f, self.at, self.error = path.open("rb"), at, error

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, b: Any) -> int:
        if self.f.tell() + len(b) > self.at:
            raise self.error
        return self.f.readinto(b)

    def close(self) -> None:
        self.f.close()
        super().close()


@pytest.mark.parametrize("storage", ["original", "resized"])
def test_a_read_error_while_decoding_is_a_config_error_not_a_reject(storage: str, tmp_path: Path) -> None:
    """Real PyAV decoding a real demo video whose storage fails mid-file: EIO is a ConfigError (restore
    the file, or re-pack), a MemoryError stops the stage; neither becomes a permanent reject."""
    video = DEMO_MEDIA / "1.mp4"
    at = video.stat().st_size // 2
    decode = check_frames if storage == "original" else (lambda f, i, n: video_frames(f, i, 64, 64, n))
    with (
        _FailingRead(video, at, OSError(errno.EIO, "Input/output error")) as f,
        pytest.raises(ConfigError, match="could not be read while decoding") as err,
    ):
        decode(f, list(range(0, 60, 10)), "1.mp4")
    assert "Input/output error" in str(err.value) and "re-pack" in str(err.value)
    with _FailingRead(video, at, MemoryError()) as f, pytest.raises(MemoryError):
        decode(f, list(range(0, 60, 10)), "1.mp4")
    with _FailingRead(video, 10**12, MemoryError()) as f:  # the same reads, nothing failing: it decodes
        decode(f, list(range(0, 60, 10)), "1.mp4")


def test_decode_failure_tells_storage_errors_from_corrupt_content(tmp_path: Path) -> None:
    stale = decode_failure(OSError(errno.ESTALE, "Stale file handle"), "v.mp4")
    assert isinstance(stale, ConfigError) and "v.mp4" in str(stale)
    with pytest.raises(av.error.FFmpegError) as ffmpeg_os:  # PyAV's own OSError kind: the content's
        av.open(str(tmp_path / "missing.mp4"))
    assert isinstance(ffmpeg_os.value, OSError)
    for exc in (ffmpeg_os.value, ValueError("bad"), RuntimeError("decoder")):
        bad = decode_failure(exc, "v.mp4")
        assert (
            isinstance(bad, MediaError) and bad.reason == "corrupt_media" and "does not decode" in bad.detail
        )
