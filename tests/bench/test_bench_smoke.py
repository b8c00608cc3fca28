"""The benchmark scripts run end to end at tiny sizes, so a broken bench fails CI rather than the report."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

HERE = Path(__file__).resolve().parent


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_fill_quick(shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("bench_fill").main(["--quick", "--n", "3000", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_fill.json").read_text())
    assert result["meta"]["lengths"] == "Qwen2-VL tokenizer"
    mixes = {row["mix"] for row in result["rows"]}
    assert {"fastchat", "glaive-toolcall", "llava-instruct-100", "synthetic mix"} <= mixes
    assert all(row["sequences"]["bfd"] >= row["lower_bound"] for row in result["rows"])
    assert "Sequences / lower bound" in capsys.readouterr().out


def test_bench_planner_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_planner")
    args = ["--sizes", "2000", "10000", "20000", "--baseline-max", "5000", "--results-dir", str(tmp_path)]
    assert bench.main(["--quick", *args]) in (0, 1)  # rates at tiny n are noise; the run must complete
    rows = json.loads((tmp_path / "bench_planner.json").read_text())["rows"]
    assert [row["n"] for row in rows] == [2000, 10000, 20000]
    assert rows[2]["swift"]["measured_on"] == 5000 and rows[2]["speedup_vs_swift"] > 1
    assert "extrapolated" in capsys.readouterr().out
    assert rows[2]["swift"]["seconds"] == rows[1]["swift"]["seconds"]  # one timing of the shared prefix

    assert bench.main(["--huge", "--huge-n", "50000", "--results-dir", str(tmp_path)]) in (0, 1)
    result = json.loads((tmp_path / "bench_planner_huge.json").read_text())["result"]
    assert result["valid"] and result["n"] == 50000 and result["peak_rss_gib_after_plan"] > 0


def test_bench_shard_format_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_shard_format")
    assert bench.main(["--quick"]) == 0
    rows = json.loads((bench.RESULTS / "bench_shard_format.json").read_text())["rows"]
    assert rows[0]["format"].startswith("arrow-ipc") and rows[0]["size_vs_ipc"] == 1.0
    assert {r["format"].split()[0] for r in rows} == {"arrow-ipc", "parquet"}
    assert "random read time/ipc" in capsys.readouterr().out


def test_bench_convert_scaling_quick(shared_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_convert_scaling")
    assert bench.main(["--quick", "--samples", "60", "--workers", "1", "2"]) == 0
    rows = json.loads((bench.RESULTS / "bench_convert_scaling.quick.json").read_text())["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["speedup"] == pytest.approx(1.0)
    assert "efficiency" in capsys.readouterr().out


def test_bench_loss_memory_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_loss_memory")
    args = ["--tokens", "64", "--vocab", "512", "--hidden", "32", "--fractions", "0.5", "--chunk", "8"]
    assert bench.main([*args, "--threads", "1", "--results-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_loss_memory.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["full", "labels", "chunked"]
    assert all(r["peak_kib"] >= r["growth_kib"] >= 0 and r["seconds"] > 0 for r in rows)
    assert rows[0]["loss"] == pytest.approx(rows[2]["loss"], rel=1e-5) == rows[1]["loss"]
    assert "labels / chunked" in capsys.readouterr().out


@pytest.mark.slow
def test_device_run_dry_run(tmp_path: Path) -> None:
    """The GPU machine's one command end to end on CPU (no install, tiny sizes, the reference kernel
    for the CUDA-only ones): one JSON with every section, the kernel checks passed and marked as
    not run on CUDA, packed == alone passed while the broken control was caught, one table."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(HERE / "device_run.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "device_run.json").read_text())
    assert report["passed"]
    assert {"phases", "kernel_check", "smoke", "bench", "summary"} <= set(report)
    status = {p["phase"]: p["status"] for p in report["phases"]}
    assert status == {
        "install": "skipped",
        "preflight": "ok",
        "kernels": "ok",
        "smoke": "ok",
        "bench": "skipped",
    }
    kernels = report["kernel_check"]
    assert kernels["passed"] and not kernels["cuda"]
    assert {c["check"] for c in kernels["checks"]} >= {
        "varlen fwd+bwd",
        "native GQA vs K/V copies",
        "flex vs reference",
    }
    assert all(
        c["kernel"].startswith("reference") for c in kernels["checks"] if c["check"] == "varlen fwd+bwd"
    )
    assert len([c for c in kernels["checks"] if c["check"] == "varlen fwd+bwd"]) == 8
    smoke = report["summary"]["smoke"]["tiny/sdpa"]
    assert smoke["packed_equal_alone"] and smoke["packed_vs_alone_ratio"] <= smoke["ratio_max"]
    assert smoke["broken_control_detected"] and smoke["control_ratio"] > smoke["ratio_max"]
    assert smoke["effective_tokens_per_second_padded"] > 0 and smoke["effective_speedup"] > 0
    assert report["bench"]["missing"].startswith("phase skipped: dry run")
    table = (tmp_path / "device_run.txt").read_text()
    assert "device run: PASSED" in table and "ok/caught" in table and "kernel check" in table
    assert "skip varlen: attention: varlen runs on CUDA only" in (tmp_path / "smoke.log").read_text()


def test_gpu_bench_imports_without_pyav() -> None:
    """The GPU machine has no PyAV: the trainer's model code and the benchmarks must import
    without it (PyAV is imported only where a video is opened or decoded)."""
    script = f"""
import importlib, importlib.util, sys
sys.modules["av"] = None  # any `import av` now raises ImportError
spec = importlib.util.spec_from_file_location("gpu_bench", {str(HERE / "gpu_bench.py")!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
bench.import_packtrain()
for name in ("model.build", "model.attention", "model.loss", "data.rope", "metrics", "data.batch"):
    importlib.import_module("packtrain.trainer." + name)
importlib.import_module("packtrain.core.families")
importlib.import_module("packtrain.core.sft_config")
sys.path.insert(0, {str(HERE)!r})
importlib.import_module("kernel_check")
assert "av" not in {{k for k, v in sys.modules.items() if v is not None}}
print("imported")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


def test_bench_model_folder_is_the_shared_3b(shared_dir: Path) -> None:
    """The GPU run reads its model from the checkout (the shared folder does not travel): the same
    config, and the same special-token ids and vision settings as the shared model folder gives."""
    from packtrain.core.model_spec import model_spec

    ours, shared = HERE / "models" / "qwen2.5-vl-3b", shared_dir / "models" / "qwen2.5-vl"
    for name in ("config.json", "preprocessor_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((shared / name).read_text()), name
    assert model_spec(ours) == dataclasses.replace(model_spec(shared), folder=ours)
    assert sum(f.stat().st_size for f in ours.iterdir()) < 16_000  # small config files only


def test_kernel_check_fails_a_kernel_that_crosses_sequences() -> None:
    """The kernel check can fail: a varlen kernel that ignores the boundaries (the whole row as
    one causal sequence) fails every layout, the per-sequence reference passes them."""
    import torch

    from packtrain.trainer.model.attention import VarlenKernel

    check = load("kernel_check")

    def crossing(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # type: ignore[no-untyped-def]
        whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        total = q.shape[0]
        return check.reference_varlen(
            q, k, v, whole, whole, total, total, scale=scale, window_size=window_size
        )

    cpu = torch.device("cpu")
    good = check.check_varlen(VarlenKernel.of(check.reference_varlen), "reference", cpu, check.LENGTHS_CPU)
    bad = check.check_varlen(VarlenKernel.of(crossing), "crossing", cpu, check.LENGTHS_CPU)
    assert all(c["passed"] for c in good) and not any(c["passed"] for c in bad)


def test_equivalence_flags_a_leak_and_passes_rounding() -> None:
    """The packed == alone verdict on made-up losses: rounding-sized errors pass, an error that
    rounding cannot make fails, whichever side it is on."""
    import torch

    bench = load("gpu_bench")
    gen = torch.Generator().manual_seed(0)
    ref = [12 + torch.randn(40, generator=gen) for _ in range(3)]
    alone = [r + 1e-3 * torch.randn(40, generator=gen) for r in ref]
    packed = [r + 1e-3 * torch.randn(40, generator=gen) for r in ref]
    leaked = [r + (0.05 if i else 0.0) * torch.randn(40, generator=gen) for i, r in enumerate(ref)]
    ok = bench.equivalence(ref, alone, packed, leaked)
    assert ok["equal"] and ok["control_detected"] and ok["passed"]
    assert ok["samples"][0]["control_ratio"] < bench.RATIO_MAX < ok["samples"][1]["control_ratio"]
    wrong = bench.equivalence(ref, alone, leaked, packed)
    assert not wrong["equal"] and not wrong["control_detected"] and not wrong["passed"]


def test_gpu_bench_batches_are_the_trainers(shared_dir: Path) -> None:
    """The benchmark collates in memory (no media-decoding imports on the device); what it builds
    must be exactly what the trainer's collators build from the same rows."""
    import torch

    from packtrain.trainer.data import packed as data
    from packtrain.trainer.model.build import checked_spec, load_config

    bench = load("gpu_bench")
    config = load_config(bench.MODEL, bench.TINY)
    fam = checked_spec(bench.MODEL, config)
    samples = bench.draw_samples(60, 0, 4096, fam, config.vision_start_token_id)
    assert {m["kind"] for s in samples for m in s["media"]} == {"image", "video"}
    rows = bench.pack(samples, 4096)
    assert sum(len(r["seq_lens"]) for r in rows) == 60 and all(len(r["input_ids"]) <= 4096 for r in rows)
    pairs = [
        (bench.collate_packed(rows[:2], fam), data.collate_packed(rows[:2], fam)),
        (bench.collate_padded(samples[:3], fam, 7), data.collate_padded(samples[:3], fam, 7)),
    ]
    for ours, trainers in pairs:
        for part in ("inputs", "info"):
            mine, theirs = getattr(ours, part), getattr(trainers, part)
            for field in dataclasses.fields(mine):
                value, expected = getattr(mine, field.name), getattr(theirs, field.name)
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, expected), field.name
                else:
                    assert value == expected, field.name


def test_bench_train_options_quick(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load("bench_train_options").main(["--quick", "--results-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_train_options.quick.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["baseline", "activation+vision_checkpointing"]
    assert all(r["peak_rss_gib"] > 0 and r["step_seconds"] > 0 for r in rows)
    assert rows[0]["losses"] == rows[1]["losses"]  # recomputation changes memory and time, not results
    assert "peak RSS" in capsys.readouterr().out


def test_bench_freeze_memory_quick(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load("bench_freeze_memory").main(["--quick", "--results-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_freeze_memory.quick.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["none", "vision", "vision+merger", "llm"]
    assert len({r["trainable_params"] + r["frozen_params"] for r in rows}) == 1
    assert (
        rows[0]["frozen_params"]
        == 0
        < rows[1]["frozen_params"]
        < rows[2]["frozen_params"]
        < rows[3]["frozen_params"]
    )
    assert len({r["losses"][0] for r in rows}) == 1  # freezing changes what trains, not the forward
    assert "growth saved" in capsys.readouterr().out


def test_bench_lora_memory_quick(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load("bench_lora_memory").main(["--quick", "--results-dir", str(tmp_path)]) == 0
    full, lora = json.loads((tmp_path / "bench_lora_memory.quick.json").read_text())["rows"]
    assert (full["case"], lora["case"]) == ("full", "lora-r16")
    assert full["frozen_params"] == 0 and lora["frozen_params"] == full["trainable_params"]
    assert 0 < lora["trainable_params"] < full["trainable_params"] // 100
    assert (
        full["losses"] == lora["losses"]
    )  # adapters start with B = 0: the first forward is the base model's
    assert lora["growth_gib"] < full["growth_gib"]
    assert "growth saved" in capsys.readouterr().out


def test_bench_context_parallel_quick(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One process and two context-parallel gloo ranks train the same packed rows: equal losses,
    the model state sharded over the group, each rank's activations below the single process's."""
    args = ["--quick", "--work-dir", str(tmp_path / "work"), "--results-dir", str(tmp_path)]
    assert load("bench_context_parallel").main(args) == 0
    result = json.loads((tmp_path / "bench_context_parallel.quick.json").read_text())
    one, two = result["rows"]
    assert (one["cp"], two["cp"]) == (1, 2) and one["tokens"] == two["tokens"] > 512
    assert one["loss_equal"] and two["loss_equal"]
    assert 0 < two["state_mib"] < 0.6 * one["state_mib"]
    assert 0 < two["activations_mib"] < one["activations_mib"]
    assert two["mask_mib"] >= one["mask_mib"] > 0 and two["step_s"] > 0  # the row padded to 2N
    ranks = result["runs"]["1024"]["2"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(len(r["steps"]) == 2 for r in ranks)
    assert "loss = CP 1" in capsys.readouterr().out


def test_bench_scale_small(shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--samples", "60", "--media-pool", "8", "--planner-n", "50000", "--results-dir", str(tmp_path)]
    assert load("bench_scale").main(args) == 0
    result = json.loads((tmp_path / "bench_scale.small.json").read_text())
    runs = result["runs"]
    assert [r["workers"] for r in runs] == [1, 2]
    assert result["counts_add_up"] and result["same_pack_any_workers"]
    assert all(set(r["stages"]) == {"load", "convert", "plan", "materialize"} for r in runs)
    assert len(runs[1]["stages"]["convert"]["worker_peak_rss_mib"]) == 2
    assert all(r["sequences"] >= r["lower_bound"] > 0 and r["output_bytes"] > 0 for r in runs)
    assert result["planner"]["valid"] and result["planner"]["n"] == 50000
    assert [r["workers"] for r in result["overhead_10_samples"]] == [1, 2]
    assert all(r["cpu_s"] > 0 for r in [*runs, *result["overhead_10_samples"]])
    assert "load avg" in capsys.readouterr().out


def test_bench_parquet_quick(shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("bench_parquet").main(["--quick", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_parquet.quick.json").read_text())
    assert result["convert"]["parquet"]["samples_per_cpu_second"] > 0 and result["parquet_vs_jsonl"] > 0
    assert result["read_large_file"]["rows"] == 64
    assert "Parquet / JSONL convert rate" in capsys.readouterr().out


def test_bench_pixels_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("bench_pixels").main(["--quick", "--repeat", "1", "--results-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_pixels.json").read_text())["rows"]
    assert rows and all(r["numpy_equal"] for r in rows)
    assert "torchvision ms" in capsys.readouterr().out
