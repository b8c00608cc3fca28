"""The slips a new user hits in the first hour, driven as a user would: the `packtrain` command in a
subprocess, on real files. Each ends in one line saying what to do and the documented exit code
(2: configuration, 130: Ctrl-C), never a traceback, and leaves no process behind."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from support.paths import SHARED

REPO = Path(__file__).resolve().parents[1]
PACKTRAIN = str(Path(sys.executable).parent / "packtrain")
QWEN2 = SHARED / "models" / "qwen2-vl"
CHATS = SHARED / "datasets" / "text-sft" / "fastchat"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
}


def packtrain(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PACKTRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _env() -> dict[str, str]:
    return os.environ | {"COLUMNS": "200", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def one_line_error(result: subprocess.CompletedProcess, code: int) -> str:
    """The result's stderr, checked to be the documented exit code and no traceback."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    return result.stderr


def chats(n: int) -> list[dict]:
    records = json.loads(next(CHATS.glob("*.json")).read_text())
    return [{**r, "id": f"chat-{i}"} for i, r in enumerate(records[:n])]


def image_record(sample_id: str, image: str) -> dict:
    return {
        "id": sample_id,
        "conversations": [
            {"from": "human", "value": "<image>What is this?"},
            {"from": "gpt", "value": "A picture."},
        ],
        "images": [image],
    }


@pytest.fixture(scope="module")
def lossy_pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A pack of 6 chats and 4 records whose images lie outside the media root (40% rejected)."""
    root = tmp_path_factory.mktemp("lossy")
    for folder in ("media", "data", "elsewhere"):
        (root / folder).mkdir()
    outside = root / "elsewhere" / "image.png"
    outside.write_bytes(b"not read: the path is refused first")
    records = chats(6) + [image_record(f"img-{i}", str(outside)) for i in range(4)]
    (root / "data" / "data.json").write_text(json.dumps(records))
    out = root / "pack"
    result = packtrain(
        "pack", "run", "--input", str(root / "data" / "data.json"), "--model", str(QWEN2), "--media-root",
        str(root / "media"), "--max-length", "512", "-o", str(out), "--workers", "1", "--no-progress",
        "--max-rejected-fraction", "0.5",  # over the 0.05 default: this pack loses 40% on purpose
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_a_lossy_pack_says_so_loudly(lossy_pack: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, result = lossy_pack
    err = result.stderr
    assert "WARNING 4 of 10 samples (40.0%) were rejected" in err
    assert "media_outside_root 4" in err and "source.mediaRoot" in err and "mediaPathMap" in err
    assert str(out / "rejects.jsonl") in err and "maxRejectedFraction" in err


def test_unpack_of_an_unknown_or_rejected_sample(
    lossy_pack: tuple[Path, subprocess.CompletedProcess],
) -> None:
    out, _ = lossy_pack
    err = one_line_error(packtrain("pack", "unpack", str(out), "--sample", "no-such-id"), 2)
    assert "no sample 'no-such-id'" in err and "neither packed nor rejected" in err
    rejected = packtrain("pack", "unpack", str(out), "--sample", "img-1", "--sample", "chat-0")
    assert rejected.returncode == 0, rejected.stderr
    lines = [json.loads(line) for line in rejected.stdout.splitlines()]
    assert [(r["id"], r.get("rejected", False)) for r in lines] == [("chat-0", False), ("img-1", True)]
    assert lines[1]["reason"] == "media_outside_root"


def test_inspect_tables_keep_whole_paths(lossy_pack: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = lossy_pack
    result = subprocess.run(
        [PACKTRAIN, "pack", "inspect", str(out)],
        capture_output=True,
        text=True,
        env=_env() | {"COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout  # folded, never cut


def test_train_of_a_pack_job_ref_without_data(tmp_path: Path) -> None:
    job = tmp_path / "sft.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "packtrain.dev/v1alpha1",
                "kind": "SFTJob",
                "metadata": {"name": "s"},
                "spec": {"data": {"packJobRef": "demo"}, "model": {"path": str(QWEN2)}},
            }
        )
    )
    err = one_line_error(packtrain("train", "-c", str(job)), 2)
    assert "data.packJobRef 'demo'" in err and "pass --data PACK" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("module", "argv"),
    [("jsonschema", ["render", str(REPO / "examples" / "quickstart.yaml")]), ("kopf", ["operator"])],
)
def test_a_missing_extra_says_what_to_install(module: str, argv: list[str]) -> None:
    """What a core install (`pip install packtrain`) lacks: `packtrain render` and `packtrain operator`."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; from packtrain.operator.cli import main; "
        f"sys.exit(main({argv!r}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    err = one_line_error(result, 2)
    assert f"needs {module}" in err and "pip install 'packtrain[operator]'" in err


def test_a_model_folder_without_tokenizer_files(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((QWEN2 / "config.json").read_text())
    data = tmp_path / "d.json"
    data.write_text(json.dumps(chats(2)))
    result = packtrain("pack", "run", "--input", str(data), "--model", str(model), "-o", str(tmp_path / "o"))
    err = one_line_error(result, 2)
    assert "no tokenizer files (expected tokenizer.json, tokenizer_config.json, added_tokens.json)" in err


def test_a_relative_path_names_the_folder_it_was_looked_up_in(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text(json.dumps(chats(2)))
    result = packtrain(
        "pack", "run", "--input", "data/d.json", "--model", str(QWEN2), "-o", "out", cwd=tmp_path
    )
    err = one_line_error(result, 2)
    assert "'data/d.json': no such file" in err
    assert f"relative paths resolve against the current directory, {tmp_path}" in err


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    from packtrain.operator import cli, local_run, render
    from packtrain.packer import cli as pack_cli
    from packtrain.trainer import cli as train_cli

    yield "packtrain", cli.parser()
    yield "packtrain pack", pack_cli.parser()
    yield "packtrain train", train_cli.build_parser()
    yield "packtrain run", local_run.build_parser()
    yield "packtrain render", render.build_parser()


def _actions(name: str, ap: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _actions(f"{name} {sub}", subparser)
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_flag_has_help_with_its_default() -> None:
    missing = [
        (where, action.option_strings or action.dest)
        for name, ap in _parsers()
        for where, action in _actions(name, ap)
        if not action.help or (action.option_strings and not action.required and "default" not in action.help)
    ]
    assert missing == []


def test_top_level_help_lists_every_subcommand() -> None:
    result = packtrain("--help")
    assert result.returncode == 0
    for command in ("pack", "train", "run", "render", "operator", "crds", "docs"):
        assert f"\n    {command} " in result.stdout, command
    for sub in ("convert", "plan", "materialize", "run", "inspect", "verify", "unpack", "export"):
        assert sub in result.stdout.split("pack …", 1)[1].splitlines()[0], sub
    assert "export" in packtrain("pack", "--help").stdout


def _as_in_a_terminal() -> None:
    """Ctrl-C's default action, as a command typed at a terminal has it. A shell without job control
    starts a background command (`pytest … &`, as `.ci/run` does) with SIGINT ignored, and children
    inherit that: Python then installs no KeyboardInterrupt handler, and Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(
    cmd: list[str], ready: Callable[[], bool], delay: float = 1.0, sig: int = signal.SIGINT
) -> tuple[int, str]:
    """Start `cmd` in its own process group, wait until `ready()` (then `delay` seconds), press Ctrl-C
    (SIGINT to the group, as a terminal does; any other signal goes to the process alone, as `kill`
    or `timeout` send it); its exit code and stderr."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
        preexec_fn=_as_in_a_terminal,
    )
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    time.sleep(delay)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    pressed = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - pressed < 15, "Ctrl-C took too long to stop everything"
    return proc.returncode, err


def _alive(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a test's unique folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.name.isdigit() and marker in cmdline and "pytest" not in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.slow
def test_ctrl_c_in_pack_run_then_the_same_command_again(tmp_path: Path) -> None:
    data = tmp_path / "many.json"
    data.write_text(json.dumps(chats(500) * 40))  # 20,000 chats: several seconds of convert
    out = tmp_path / "pack"
    cmd = [
        PACKTRAIN,
        "pack",
        "run",
        "--input",
        str(data),
        "--model",
        str(QWEN2),
        "-o",
        str(out),
        "--workers",
        "2",
    ]
    code, err = _interrupt(cmd, ready=lambda: (out / "work").is_dir(), delay=0.5)  # convert has started
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "packtrain pack run: interrupted — run the same command again to resume"
    )
    time.sleep(0.5)
    assert _alive(str(out)) == []
    again = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["packed"] == 20_000


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    return s


def _pipeline(tmp_path: Path, port: int, lr: float = 1e-3, steps: int = 2) -> Path:
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(chats(24)))
    docs = [
        {
            "apiVersion": "packtrain.dev/v1alpha1",
            "kind": "PackJob",
            "metadata": {"name": "tiny"},
            "spec": {
                "source": {"paths": [str(data)]},
                "model": {"path": str(QWEN2)},
                "packing": {"maxLength": 512, "sequencesPerShard": 8},
                "output": {"claimName": "c"},
            },
        },
        {
            "apiVersion": "packtrain.dev/v1alpha1",
            "kind": "SFTJob",
            "metadata": {"name": "tiny"},
            "spec": {
                "data": {"packJobRef": "tiny", "numWorkers": 0},
                "model": {"path": str(QWEN2), "init": "random", "configOverrides": TINY},
                "training": {"maxSteps": steps, "lr": lr},
                "metricsPort": port,
                "resources": {"nodes": 1, "gpusPerNode": 0},
                "volumes": {"checkpoints": {"claimName": "ck"}},
            },
        },
    ]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump_all(docs))
    return job


@pytest.mark.slow
def test_local_runs_on_a_busy_port_reruns_and_changed_settings(tmp_path: Path) -> None:
    busy = _listening()  # another run's metrics port
    port = busy.getsockname()[1]
    job, out = _pipeline(tmp_path, port), tmp_path / "out"
    first = packtrain("run", str(job), "--workers", "1", "--output", str(out), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"port {port} (spec.metricsPort) is in use" in first.stderr
    for expected in ("next:", f"packtrain pack verify {out / 'pack' / 'tiny'}", "--plot", "from_pretrained"):
        assert expected in first.stdout, expected
    assert str(out / "train" / "tiny" / "final") in first.stdout and str(out / "logs") in first.stdout

    again = packtrain("run", str(job), "--workers", "1", "--output", str(out), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete, nothing trained this run" in again.stdout

    _pipeline(tmp_path, port, lr=2e-3)
    changed = packtrain("run", str(job), "--workers", "1", "--output", str(out), timeout=600)
    err = one_line_error(changed, 2)
    assert "training.lr 0.001 -> 0.002" in err and "--output" in err and "ChildFailedError" not in err
    busy.close()


@pytest.mark.slow
def test_trainer_on_a_busy_metrics_port(
    tmp_path: Path, lossy_pack: tuple[Path, subprocess.CompletedProcess]
) -> None:
    busy = _listening()
    port = busy.getsockname()[1]
    job = tmp_path / "sft.yaml"
    spec = {
        "data": {"path": str(lossy_pack[0]), "numWorkers": 0},
        "model": {"path": str(QWEN2), "init": "random", "configOverrides": TINY},
        "training": {"maxSteps": 1, "metricsPort": port, "outputDir": str(tmp_path / "run")},
    }
    job.write_text(yaml.safe_dump({"kind": "SFTJob", "metadata": {"name": "s"}, "spec": spec}))
    err = one_line_error(packtrain("train", "-c", str(job), "--log-format", "json"), 2)
    assert f"cannot serve /metrics on port {port}" in err and "training.metricsPort" in err
    busy.close()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_ctrl_c_in_local_run_training(tmp_path: Path, sig: int) -> None:
    busy = _listening()
    job, out = _pipeline(tmp_path, busy.getsockname()[1], steps=2000), tmp_path / "out"
    log = out / "logs" / "tiny-train.log"
    code, err = _interrupt(
        [PACKTRAIN, "run", str(job), "--workers", "1", "--output", str(out)],
        ready=lambda: log.is_file() and '"event": "step"' in log.read_text(),
        sig=sig,
    )
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "interrupted — run the same command again to resume" in err.strip().splitlines()[-1]
    time.sleep(0.5)
    assert _alive(str(out)) == []  # torchrun and its workers stopped too
    busy.close()


def test_the_family_is_detected_from_the_model_folder(tmp_path: Path) -> None:
    """`--model` without `--family` packs for the folder's own family, as `--family`'s help says."""
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(chats(4)))
    out = tmp_path / "o"
    model = SHARED / "models" / "qwen3-vl"
    result = packtrain(
        "pack", "run", "--input", str(data), "--model", str(model), "-o", str(out), "--no-progress"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["family"] == "qwen3-vl"
