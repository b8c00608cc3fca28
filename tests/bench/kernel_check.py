"""Attention kernels on this GPU against fp32 references, before a benchmark trusts them.

The packed path's speed rests on kernels no CPU test can run: torch's varlen FlashAttention
(`trainer/model/attention.py` hands it grouped K/V as they are, relying on the kernel to handle H_kv < H_q
in the forward and to sum dK/dV per group in the backward), compiled flex attention, and the vision
tower's one call per block over every image, frame and window (`trainer/model/vision_attention.py`).
Each is compared with a reference of the same inputs: outputs and input gradients of the kernel
in bf16 must be within twice the error (RMS; 4x the max) of the same attention written out in
plain PyTorch in bf16, both measured against fp32 (FlashAttention's own test criterion: a kernel
may round, not compute something else). Uneven sample lengths (1 token to thousands) and every head layout the
families use (MHA; GQA with 2, 4, 8 query heads per K/V head; head_dim 64 and 128).

On a machine without CUDA (the CI dry run) the CUDA-only kernels are replaced by a per-sequence
SDPA of the same signature, tiny sizes run, and those results say `"kernel": "reference"`: they
check the plumbing (`varlen_call`'s GQA, scale and causality arguments, the one-call masks), not
the kernels.

    python tests/bench/kernel_check.py [--out kernel_check.json] [--tiny]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_bench  # noqa: E402  (the bench's packtrain import, model folder and tiny sizes)

# (query heads, K/V heads): MHA, then 2, 4 and 8 query heads per K/V head (Qwen2.5-VL-3B: 16/2).
LAYOUTS = ((16, 16), (16, 8), (16, 4), (16, 2))
HEAD_DIMS = (64, 128)
LENGTHS_CUDA = (1, 37, 511, 1024, 2900, 63, 3656)  # 8192 tokens, one of each kind of sample
LENGTHS_CPU = (1, 7, 33, 70, 17)
FACTOR, MAX_FACTOR, ATOL = 2.0, 4.0, 1e-5  # error <= FACTOR x plain bf16's + ATOL (see compare)


def reference_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """torch 2.11's `varlen_attn` signature, one SDPA per sequence: the CPU stand-in for the CUDA
    kernel (grouped K/V taken as they are, as FlashAttention-2 takes them)."""
    out = []
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
        out.append(
            F.scaled_dot_product_attention(
                q, k, v, is_causal=tuple(window_size) == (-1, 0), scale=scale, enable_gqa=True
            ).transpose(0, 1)
        )
    return torch.cat(out)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, causal: bool, dtype: torch.dtype
) -> torch.Tensor:
    """(T, H, D) attention written out per sequence in `dtype` (softmax in fp32): the reference."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        scores = (qs @ ks.transpose(1, 2)).float() * q.shape[-1] ** -0.5
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1).to(dtype) @ vs).transpose(0, 1))
    return torch.cat(out)


def forward_backward(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor
) -> list[torch.Tensor]:
    """fn's output and the gradients of its inputs (fresh leaves, so each call is independent)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves if x.grad is not None)]


def fp32(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The bf16 inputs as fp32 leaves: the reference's gradients then stay unrounded too."""
    return [x.float() for x in inputs]


def compare(
    kernel: list[torch.Tensor], plain: list[torch.Tensor], exact: list[torch.Tensor], names: list[str]
) -> dict[str, Any]:
    """Errors against fp32 of the kernel and of plain bf16, per tensor, and the verdict: RMS within
    FACTOR x plain's (rounding, not a different result), max within MAX_FACTOR x plain's (a single
    wrong sequence, e.g. the 1-token one, barely moves an RMS over 8192 tokens; bf16 maxima are
    quantised to ulps of the largest values, hence the wider factor)."""
    figures: dict[str, Any] = {}
    passed = True
    for name, got, low, ref in zip(names, kernel, plain, exact, strict=True):
        err, base = got.float() - ref.float(), low.float() - ref.float()
        rms, rms_bound = float(err.pow(2).mean().sqrt()), FACTOR * float(base.pow(2).mean().sqrt()) + ATOL
        worst, worst_bound = float(err.abs().max()), MAX_FACTOR * float(base.abs().max()) + ATOL
        figures[name] = {"error": rms, "bound": rms_bound, "max_error": worst, "max_bound": worst_bound}
        passed = passed and rms <= rms_bound and worst <= worst_bound
    return {"passed": passed, "errors": figures}


def packed_qkv(
    lengths: tuple[int, ...], heads: int, kv_heads: int, dim: int, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(heads * 1000 + kv_heads * 10 + dim)
    total = sum(lengths)
    shapes = [(total, heads, dim), (total, kv_heads, dim), (total, kv_heads, dim)]
    qkv = [torch.randn(s, generator=gen, device=device).to(torch.bfloat16) for s in shapes]
    grad = torch.randn(total, heads, dim, generator=gen, device=device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return qkv, grad, cu


def check_varlen(kernel: Any, label: str, device: torch.device, lengths: tuple[int, ...]) -> list[dict]:
    """varlen_call (the trainer's path into the kernel) vs plain attention, every head layout."""
    out = []
    for heads, kv_heads in LAYOUTS:
        for dim in HEAD_DIMS:
            qkv, grad, cu = packed_qkv(lengths, heads, kv_heads, dim, device)
            run = functools.partial(_varlen, kernel=kernel, cu=cu, longest=max(lengths))
            got = forward_backward(run, qkv, grad)
            plain = forward_backward(functools.partial(_math, cu=cu, dtype=torch.bfloat16), qkv, grad)
            exact = forward_backward(functools.partial(_math, cu=cu, dtype=torch.float32), fp32(qkv), grad)
            result = compare(got, plain, exact, ["out", "dq", "dk", "dv"])
            case = f"H{heads}/KV{kv_heads} d{dim}"
            out.append({"check": "varlen fwd+bwd", "case": case, "kernel": label, **result})
    return out


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel: Any, cu: torch.Tensor, longest: int
) -> Any:
    from packtrain.trainer.model.attention import varlen_call

    return varlen_call(kernel, q, k, v, cu, longest, causal=True, scale=None)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu: torch.Tensor, dtype: torch.dtype) -> Any:
    return math_attention(q, k, v, cu, True, dtype)


@contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, int | None]]:
    """Bytes allocated at peak over the block beyond what was allocated before (CUDA only)."""
    found: dict[str, int | None] = {"bytes": None}
    if device.type != "cuda":
        yield found
        return
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield found
    torch.cuda.synchronize(device)
    found["bytes"] = torch.cuda.max_memory_allocated(device) - before


def check_gqa(kernel: Any, label: str, device: torch.device, lengths: tuple[int, ...]) -> dict[str, Any]:
    """Grouped K/V handed to the kernel as they are vs repeated to the query heads first (what a
    kernel without GQA needs): the same outputs and gradients, and what each costs in memory."""
    from packtrain.trainer.model.attention import VarlenKernel, varlen_call

    if "grouped_kv" not in inspect.signature(VarlenKernel.of).parameters:
        reason = (
            "trainer/model/attention.py's VarlenKernel has no grouped_kv switch: "
            "no native GQA path to compare"
        )
        return {
            "check": "native GQA vs K/V copies",
            "case": "-",
            "kernel": label,
            "passed": None,
            "skipped": reason,
        }
    qkv, grad, cu = packed_qkv(lengths, 16, 2, 128, device)
    results, memory = {}, {}
    for name, variant in (("native", kernel), ("copies", VarlenKernel.of(kernel.fn, grouped_kv=False))):

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Any = variant) -> torch.Tensor:
            return varlen_call(variant, q, k, v, cu, max(lengths), causal=True, scale=None)

        with peak_memory(device) as peak:
            results[name] = forward_backward(run, qkv, grad)
        memory[name] = peak["bytes"]
    plain = forward_backward(functools.partial(_math, cu=cu, dtype=torch.bfloat16), qkv, grad)
    exact = forward_backward(functools.partial(_math, cu=cu, dtype=torch.float32), fp32(qkv), grad)
    names = ["out", "dq", "dk", "dv"]
    native, copies = (compare(results[n], plain, exact, names) for n in ("native", "copies"))
    between = {
        n: float((a.float() - b.float()).abs().max())
        for n, a, b in zip(names, results["native"], results["copies"], strict=True)
    }
    return {
        "check": "native GQA vs K/V copies",
        "case": "H16/KV2 d128",
        "kernel": label,
        "passed": native["passed"] and copies["passed"],
        "native": native["errors"],
        "copies": copies["errors"],
        "max_diff_native_vs_copies": between,
        "peak_bytes": memory if device.type == "cuda" else "cuda-only",
    }


def check_flex(device: torch.device, lengths: tuple[int, ...]) -> dict[str, Any]:
    """Compiled flex attention with the trainer's BlockMask (GQA through enable_gqa), forward and
    backward; on CPU eager and forward only (torch has no CPU flex backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    from packtrain.trainer.model.attention import compiled_flex, flex_block_mask

    cuda = device.type == "cuda"
    qkv, grad, cu = packed_qkv(lengths, 16, 2, 128, device)
    total = sum(lengths)
    mask = flex_block_mask(cu, total)
    fn = compiled_flex() if cuda else flex_attention

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads_first = [x.transpose(0, 1)[None] for x in (q, k, v)]
        return fn(*heads_first, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return math_attention(q, k, v, cu, True, dtype)

    if cuda:
        got = forward_backward(run, qkv, grad)
        plain = forward_backward(functools.partial(reference, dtype=torch.bfloat16), qkv, grad)
        exact = forward_backward(functools.partial(reference, dtype=torch.float32), fp32(qkv), grad)
        names = ["out", "dq", "dk", "dv"]
        kernel = "compiled flex_attention"
    else:
        with torch.no_grad():
            got = [run(*qkv)]
            plain = [reference(*qkv, dtype=torch.bfloat16)]
            exact = [reference(*fp32(qkv), dtype=torch.float32)]
        names = ["out"]
        kernel = "eager flex_attention, forward only (compiled and backward: cuda-only)"
    return {
        "check": "flex vs reference",
        "case": "H16/KV2 d128",
        "kernel": kernel,
        **compare(got, plain, exact, names),
    }


# The vision check: the 3B's tower, 8 blocks (2 full-attention), or the bench's tiny one on CPU.
VISION_CUDA = {"num_hidden_layers": 1, "vision_config": {"depth": 8, "fullatt_block_indexes": [3, 7]}}
GRIDS_CUDA = [[1, 28, 40], [1, 16, 16], [2, 20, 28]]  # two images and a video of 2 temporal patches
GRIDS_CPU = [[1, 8, 8], [1, 4, 12], [2, 8, 8]]
CPU_VISION_KERNELS = {"varlen": "varlen (reference)", "flex": "flex (eager, forward only)", "sdpa": "sdpa"}
VISION_NAMES = ("one_call_vision", "per_segment", "counting_calls", "ONE_CALL_BACKENDS")


def vision_model(device: torch.device, tiny: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A random-init model (only its tower is run, frozen: gradients flow to the pixels alone),
    its grids and pixel patches."""
    from packtrain.trainer.model.build import build_model

    overrides = gpu_bench.TINY if tiny else VISION_CUDA
    hf = build_model(gpu_bench.MODEL, init="random", overrides=overrides, attention="sdpa", device=device)
    hf.requires_grad_(False)
    # At the config's init (std 0.02) attention adds ~1% to the residual stream: a tower that mixed
    # images would differ from per-segment attention by little more than bf16 rounding. Weights of
    # std 1/sqrt(fan_in) make each block's attention carry as much as its residual, so a leak shows.
    with torch.no_grad():
        for module in hf.model.visual.blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5, generator=_generator(device))
    vc = hf.config.vision_config
    grids = torch.tensor(GRIDS_CPU if tiny else GRIDS_CUDA, device=device)
    gen = _generator(device)
    width = 3 * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(int(grids.prod(-1).sum()), width, generator=gen, device=device)
    return hf, grids, pixels


@functools.cache
def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def check_vision(device: torch.device, tiny: bool, backends: list[str]) -> list[dict[str, Any]]:
    """One attention call per vision block vs transformers' call per image / frame / window, each
    backend in bf16, against the per-segment tower in fp32 (sdpa); and the calls counted."""
    try:
        from packtrain.trainer.model import vision_attention as va
    except ImportError:
        va = None
    missing = [n for n in VISION_NAMES if va is None or not hasattr(va, n)]
    if missing:
        reason = f"trainer/model/vision_attention.py lacks {', '.join(missing)}: no one-call vision attention"
        return [{"check": "one-call vision", "case": "-", "kernel": "-", "passed": None, "skipped": reason}]
    from packtrain.trainer.model.attention import register_flex

    hf, grids, pixels = vision_model(device, tiny)
    depth = len(hf.model.visual.blocks)
    grad = torch.randn(
        int(grids.prod(-1).sum()) // hf.config.vision_config.spatial_merge_size**2,
        hf.config.vision_config.out_hidden_size,
        device=device,
    )

    def tower(x: torch.Tensor, half: bool = True) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            return hf.model.visual(x, grid_thw=grids).pooler_output.float()

    if "flex" in backends:
        register_flex()  # per_segment's flex falls back to the language model's registration
    va.one_call_vision(hf, "sdpa")
    with va.per_segment(hf):
        exact = forward_backward(functools.partial(tower, half=False), [pixels], grad)
    out = []
    for backend in [b for b in backends if b in va.ONE_CALL_BACKENDS]:
        va.one_call_vision(hf, backend)
        backward = device.type == "cuda" or backend != "flex"  # no flex backward on CPU

        def run(fn: Callable[[torch.Tensor], torch.Tensor], backward: bool = backward) -> list[torch.Tensor]:
            return forward_backward(fn, [pixels], grad) if backward else _forward_only(fn, pixels)

        with va.counting_calls(hf) as one_calls:
            one = run(tower)
        with va.per_segment(hf), va.counting_calls(hf) as segment_calls:
            segments = run(tower)
        names = ["out", "dpixels"] if backward else ["out"]
        result = compare(one, segments, exact[: len(names)], names)
        calls_ok = len(one_calls) == depth < len(segment_calls)
        out.append(
            {
                "check": "one-call vision vs per segment",
                "case": f"{backend}, {len(grids)} media, {depth} blocks",
                "kernel": backend if device.type == "cuda" else CPU_VISION_KERNELS[backend],
                **result,
                "passed": result["passed"] and calls_ok,
                "calls": {"one_call": len(one_calls), "per_segment": len(segment_calls)},
            }
        )
    return out


def _forward_only(fn: Callable[[torch.Tensor], torch.Tensor], pixels: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [fn(pixels)]


# -- the run --------------------------------------------------------------------------------------


def varlen_kernel(device: torch.device) -> tuple[Any, str]:
    """torch's varlen kernel on CUDA; elsewhere (or in a torch without it) the per-sequence stand-in."""
    from packtrain.trainer.model.attention import VarlenKernel, torch_varlen_kernel, varlen_available

    if device.type == "cuda" and varlen_available():
        return torch_varlen_kernel(), "torch varlen_attn"
    why = "cuda-only kernel not run" if device.type != "cuda" else "this torch has no varlen_attn"
    return VarlenKernel.of(reference_varlen), f"reference ({why})"


def run_checks(device: torch.device, tiny: bool, write: Callable[[], None], report: dict[str, Any]) -> None:
    """Each check in turn, its results written as soon as it ends (a timeout keeps what ran); a
    check that raises is recorded as failed with its error."""
    from packtrain.trainer.model.attention import available_backends, register_varlen

    kernel, label = varlen_kernel(device)
    register_varlen(kernel)  # the vision tower's varlen delegates to this registration
    lengths = LENGTHS_CPU if tiny else LENGTHS_CUDA
    have = available_backends()
    backends = [b for b in ("varlen", "flex", "sdpa") if have.get(b)]
    steps: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        ("varlen fwd+bwd", lambda: check_varlen(kernel, label, device, lengths)),
        ("native GQA vs K/V copies", lambda: [check_gqa(kernel, label, device, lengths)]),
        ("flex vs reference", lambda: [check_flex(device, lengths)] if have.get("flex") else []),
        ("one-call vision", lambda: check_vision(device, tiny, backends)),
    ]
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            found = step()
        except Exception as e:  # a kernel that fails to run is a failed check, reported
            found = [{"check": name, "case": "-", "kernel": "-", "passed": False, "error": repr(e)[:500]}]
        for item in found:
            item.setdefault("seconds", time.perf_counter() - t0)
        report["checks"] += found
        print(f"{name}: {sum(c['passed'] is True for c in found)}/{len(found)} passed", flush=True)
        write()


def table_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"{'kernel check':32} {'case':30} {'result':7} {'worst error / bound':>20}  kernel"]
    for c in report["checks"]:
        result = "skipped" if c["passed"] is None else "ok" if c["passed"] else "FAILED"
        errors = c.get("errors") or c.get("native") or {}
        worst = max(errors.items(), key=lambda kv: kv[1]["error"] / kv[1]["bound"], default=None)
        figure = "-" if worst is None else f"{worst[0]} {worst[1]['error']:.1e}/{worst[1]['bound']:.1e}"
        lines.append(f"{c['check']:32} {c['case']:30} {result:7} {figure:>20}  {c['kernel']}")
        for note in ("skipped", "error"):
            if c.get(note):
                lines.append(f"    {note}: {c[note]}")
        if isinstance(c.get("peak_bytes"), dict):
            mem = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in c["peak_bytes"].items() if v is not None)
            lines.append(f"    peak memory of forward+backward: {mem}")
        if c.get("calls"):
            lines.append(f"    attention calls: {c['calls']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, help="write the results as JSON here (after every check)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (always on without CUDA)")
    args = p.parse_args(argv)
    gpu_bench.import_packtrain()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda": device.type == "cuda",
        "torch": torch.__version__,
        "checks": [],
    }

    def write() -> None:
        checks = report["checks"]
        report["passed"] = bool(checks) and all(c["passed"] is not False for c in checks)
        report["seconds"] = time.perf_counter() - started
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))

    run_checks(device, args.tiny or device.type != "cuda", write, report)
    write()
    print("\n" + "\n".join(table_lines(report)), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
