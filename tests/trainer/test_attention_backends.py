"""Attention backends: which one `auto` picks, and the varlen wrapper's arguments.

torch's `varlen_attn` is FlashAttention and has no CPU kernel (it raises NotImplementedError
here), so the varlen tests substitute a CPU reference implementation with the exact signature of
each torch version (2.10: `is_causal`, no scale, no `enable_gqa`; 2.11: `window_size` and `scale`;
2.12 and later: also `enable_gqa`) for the kernel. The reference refuses what the real kernel
refuses (unknown keywords, K/V heads that do not divide Q's, fewer K/V heads without `enable_gqa`
from 2.12 on, mixed dtypes) and, like FlashAttention-2 behind 2.10/2.11, takes grouped K/V as
they are, so the wrapper's argument building (cu_seq, max lengths, causality, scale, grouped K/V
passed through, autocast dtype) runs for real; it is compared with SDPA under the dense block
mask. The kernel itself has never run in these tests: that is the device benchmark's job.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import vlm_fixtures as fx
from test_equivalence import _double_batch

from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model import attention as attn
from packtrain.trainer.model.attention import (
    VarlenKernel,
    block_causal_mask,
    register_varlen,
    resolve_attention,
    varlen_attention,
)
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.model.loss import per_sample_sums

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ALL = {"varlen": True, "flash": True, "flex": True}


@pytest.mark.parametrize(
    ("device", "available", "dtype", "expected"),
    [
        (CPU, ALL, torch.float32, "sdpa"),
        (CPU, ALL, torch.bfloat16, "sdpa"),
        (CUDA, ALL, torch.bfloat16, "varlen"),
        (CUDA, {**ALL, "varlen": False}, torch.bfloat16, "flash"),
        (CUDA, {"varlen": False, "flash": False, "flex": True}, torch.bfloat16, "flex"),
        (CUDA, {"varlen": False, "flash": False, "flex": False}, torch.bfloat16, "sdpa"),
        (CUDA, ALL, torch.float32, "flex"),  # the FlashAttention kernels are bf16/fp16 only
    ],
)
def test_auto_picks_per_device_availability_and_dtype(device, available, dtype, expected):
    assert resolve_attention("auto", device, available, dtype=dtype) == expected


def test_explicit_backends_are_checked():
    assert resolve_attention("varlen", CUDA, ALL) == "varlen"
    assert resolve_attention("flex", CPU, ALL) == "flex"
    assert resolve_attention("sdpa", CUDA, {}) == "sdpa"
    with pytest.raises(RuntimeError, match="varlen runs on CUDA only"):
        resolve_attention("varlen", CPU, ALL)
    with pytest.raises(RuntimeError, match=r"varlen needs torch >= 2\.10"):
        resolve_attention("varlen", CUDA, {**ALL, "varlen": False})
    with pytest.raises(RuntimeError, match="flash-attn"):
        resolve_attention("flash", CUDA, {**ALL, "flash": False})
    with pytest.raises(RuntimeError, match="bf16/fp16 only"):
        resolve_attention("varlen", CUDA, ALL, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_attention("xformers", CUDA, ALL)
    # this torch has varlen and flex; its CPU default stays sdpa
    assert attn.varlen_available() and attn.flex_available()
    assert resolve_attention("auto", CPU) == "sdpa"


# -- CPU references with each torch version's varlen_attn signature ----------------------------


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale=None, gqa=True):
    """`gqa`: K/V with fewer heads are accepted (FlashAttention-2 takes them natively)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"mixed dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or not torch.equal(cu_q, cu_k):
        raise RuntimeError("cu_seq must be int32 and equal for q and k here")
    if q.shape[1] % k.shape[1] or (k.shape[1] != q.shape[1] and not gqa):
        raise RuntimeError("number of heads in key/value must divide (or equal) those of query")
    gqa = k.shape[1] != q.shape[1]
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    if max(lengths) != max_q or max_k != max_q:
        raise RuntimeError(f"max lengths {max_q}, {max_k} but longest sequence {max(lengths)}")
    if int(cu_q[-1]) != q.shape[0]:
        raise RuntimeError("cu_seq does not cover the packed tokens")
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        out.append(
            F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa
            ).transpose(0, 1)
        )
    return torch.cat(out)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)


def _causal(window_size):
    if tuple(window_size) not in ((-1, 0), (-1, -1)):
        raise NotImplementedError(f"window {window_size}")
    return tuple(window_size) == (-1, 0)


def varlen_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    return _reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, _causal(window_size), scale)


def varlen_2_12(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    return _reference(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, _causal(window_size), scale, enable_gqa
    )


KERNELS = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.12": varlen_2_12}


def test_kernel_signatures_are_read_once_per_version():
    assert VarlenKernel.of(varlen_2_10) == VarlenKernel(
        varlen_2_10, window_size=False, scale=False, gqa=False
    )
    assert VarlenKernel.of(varlen_2_11) == VarlenKernel(varlen_2_11, window_size=True, scale=True, gqa=False)
    assert VarlenKernel.of(varlen_2_12) == VarlenKernel(varlen_2_12, window_size=True, scale=True, gqa=True)
    real = attn.torch_varlen_kernel()  # this torch (>= 2.12)
    assert (real.window_size, real.scale, real.gqa) == (True, True, True)
    with pytest.raises(RuntimeError, match="neither window_size nor is_causal"):
        VarlenKernel.of(lambda q, k, v, cu_q, cu_k, max_q, max_k: q)


class _Module(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(total, heads=4, kv_heads=2, dim=8, batch=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, h, total, dim, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("version", sorted(KERNELS))
@pytest.mark.parametrize("scale", [None, 0.2])
def test_varlen_packed_rows_match_sdpa_with_the_block_mask(version, scale):
    cu = torch.tensor([0, 5, 6, 17, 24], dtype=torch.int32)
    q, k, v = _qkv(24)
    kernel = VarlenKernel.of(KERNELS[version])
    out, _ = varlen_attention(
        _Module(True),
        q,
        k,
        v,
        None,
        scale,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=11,
        max_length_k=11,
        kernel=kernel,
    )
    mask = block_causal_mask(cu, 24)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    assert out.shape == (1, 24, 4, 8)  # transformers' (B, T, H, D)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("version", sorted(KERNELS))
def test_varlen_without_boundaries_is_one_sequence_per_row(version):
    """The vision tower's per-segment calls (bidirectional: is_causal=False) and the padded
    baseline's rows (causal, from the module), each row one sequence."""
    kernel = VarlenKernel.of(KERNELS[version])
    q, k, v = _qkv(9, heads=2, kv_heads=2, batch=3)
    vision, _ = varlen_attention(_Module(False), q, k, v, None, 0.5, is_causal=False, kernel=kernel)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    torch.testing.assert_close(vision, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    text, _ = varlen_attention(_Module(True), q, k, v, None, None, kernel=kernel)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(text, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_varlen_casts_to_the_autocast_dtype():
    """Rotary embeddings leave q and k in fp32 under autocast while v is bf16; the kernel takes one
    half dtype (the reference raises on mixed dtypes, as the real kernel does)."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = _qkv(8, dtype=torch.float32)
    kernel = VarlenKernel.of(varlen_2_12)
    with pytest.raises(RuntimeError, match="mixed dtypes"):
        varlen_attention(_Module(True), q, k, v.bfloat16(), None, cu_seq_lens_q=cu, kernel=kernel)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention(_Module(True), q, k, v.bfloat16(), None, cu_seq_lens_q=cu, kernel=kernel)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(cu, 8), enable_gqa=True)
    torch.testing.assert_close(out.float(), ref.transpose(1, 2), rtol=2e-2, atol=2e-2)


def varlen_equal_heads(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """A kernel that needs as many K/V heads as Q heads (declared with grouped_kv=False)."""
    return _reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, _causal(window_size), scale, False)


@pytest.mark.parametrize(
    ("kernel", "kv_heads_seen"),
    [
        (VarlenKernel.of(varlen_2_10), 2),
        (VarlenKernel.of(varlen_2_11), 2),
        (VarlenKernel.of(varlen_2_12), 2),
        (VarlenKernel.of(varlen_equal_heads, grouped_kv=False), 4),
    ],
)
def test_grouped_kv_reach_the_kernel_as_they_are(kernel, kv_heads_seen):
    """2.10/2.11 (no enable_gqa, FlashAttention-2 takes grouped heads) and 2.12+ (enable_gqa) get
    the 2 K/V heads unrepeated; only a kernel declared to need equal heads gets 4 copies."""
    seen = []

    def recording(query, key, value, *args, **kwargs):
        seen.append(key.shape[1])
        return kernel.fn(query, key, value, *args, **kwargs)

    recorder = VarlenKernel(recording, kernel.window_size, kernel.scale, kernel.gqa, kernel.grouped_kv)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = _qkv(12)
    out, _ = varlen_attention(_Module(True), q, k, v, None, cu_seq_lens_q=cu, max_length_q=7, kernel=recorder)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(cu, 12), enable_gqa=True)
    assert seen == [kv_heads_seen]
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)


class _FlashLike(torch.autograd.Function):
    """Saves for the backward what torch's varlen_attn saves: q, k, v, cu_seq, out, lse."""

    @staticmethod
    def forward(ctx, q, k, v, cu):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, cu, out, torch.empty(q.shape[1], q.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *_ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


def _flash_like_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    return _FlashLike.apply(query, key, value, cu_seq_q)


def _saved_bytes(kernel, total, heads, kv_heads, dim):
    q, k, v = (
        torch.randn(1, h, total, dim, dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        varlen_attention(
            _Module(True),
            q,
            k,
            v,
            None,
            cu_seq_lens_q=torch.tensor([0, total], dtype=torch.int32),
            max_length_q=total,
            kernel=kernel,
        )
    return sum(storages.values())


def test_grouped_kv_are_not_saved_as_copies():
    """The backward's saved tensors: with K/V passed as they are, 2 x (H - H_kv) x T x D elements
    fewer than with the copies (Qwen2.5-VL-3B, 16 over 2 heads of 128, 8192 tokens, 36 layers:
    56 MiB a layer, 1.97 GiB in all)."""
    total, heads, kv_heads, dim = 64, 16, 2, 32
    native = _saved_bytes(VarlenKernel.of(_flash_like_2_11), total, heads, kv_heads, dim)
    copied = _saved_bytes(VarlenKernel.of(_flash_like_2_11, grouped_kv=False), total, heads, kv_heads, dim)
    assert copied - native == 2 * (heads - kv_heads) * total * dim * 2  # bf16


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_casts_to_the_autocast_dtype():
    """Under autocast, rotary embeddings leave q and k in fp32 while v is bf16; flex_attention
    takes one dtype (torch 2.10 raises otherwise): all three go to the autocast dtype."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = _qkv(8, dtype=torch.float32)
    mask = attn.flex_block_mask(cu, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attn._flex_attention(_Module(True), q, k, v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(cu, 8), enable_gqa=True)
    torch.testing.assert_close(out.float(), ref.transpose(1, 2), rtol=2e-2, atol=2e-2)
    q2, k2, v2 = attn.one_dtype(q, k, v.bfloat16())  # without autocast: v's dtype
    assert q2.dtype == k2.dtype == v2.dtype == torch.bfloat16


def test_varlen_refuses_a_mask():
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="not a mask"):
        varlen_attention(_Module(True), q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))


# -- the whole model --------------------------------------------------------------------------


@pytest.fixture
def reference_varlen():
    """A function registering the 2.12-signature CPU reference as the varlen kernel (call it after
    `build_model`, which registers torch's); torch's is registered again afterwards."""
    yield lambda: register_varlen(VarlenKernel.of(varlen_2_12))
    register_varlen()


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_varlen_model_trains_like_sdpa(family, shared_dir, reference_varlen):
    """Packed rows with images and a video, LLM and vision tower through the varlen wrapper: losses
    and gradients equal SDPA's with the dense block mask (which test_equivalence proves equal to
    each sample alone), fp64."""
    samples = fx.demo_samples(family)
    batch = collate_packed(
        [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)], fx.spec(family)
    )
    batch = _double_batch(batch)
    results, grads = {}, {}
    for backend in ("varlen", "sdpa"):
        model = build_model(
            fx.FOLDER[family],
            init="random",
            overrides=fx.TINY[family],
            dtype=torch.float64,
            attention=backend,
            seed=1,
        )
        if backend == "varlen":
            reference_varlen()
        out = VLMForTraining(model, backend)(batch.inputs)
        (out["loss_sum"] / batch.info.num_label_tokens).backward()
        results[backend], grads[backend] = out["token_losses"].detach(), _grads(model)
    # Qwen3.5's RMSNorms and delta rule compute in fp32 inside (as transformers writes them): fp64 inputs that
    # differ in their last bits between the two kernels round to fp32 apart now and then.
    fp32_inside = family == "qwen3.5"
    rtol = 1e-6 if fp32_inside else 1e-10
    torch.testing.assert_close(results["varlen"], results["sdpa"], rtol=rtol, atol=1e-12)
    assert set(grads["varlen"]) == set(grads["sdpa"])
    assert any("visual" in name for name in grads["varlen"])
    for name, g in grads["sdpa"].items():
        if fp32_inside:  # relative to the whole tensor: single entries near 0 carry fp32 noise
            assert ((grads["varlen"][name] - g).norm() / g.norm().clamp_min(1e-300)).item() <= 1e-6, name
        else:
            torch.testing.assert_close(grads["varlen"][name], g, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_flex_packed_equals_each_sample_alone(family, shared_dir):
    """flex on CPU (forward only: torch has no flex backward on CPU): per-sample mean losses of a
    packed row equal each sample run alone through the same backend."""
    samples = fx.demo_samples(family)
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], attention="flex", seed=3)
    core = VLMForTraining(model, "flex")
    with torch.no_grad():
        batch = collate_packed([fx.packed_row(samples, family)], fx.spec(family))
        out = core(batch.inputs)
        n = len(samples)
        sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
        singles = [collate_packed([fx.packed_row([s], family)], fx.spec(family)) for s in samples]
        alone = torch.stack([core(one.inputs)["token_losses"].sum() for one in singles])
    torch.testing.assert_close(sums, alone, rtol=1e-5, atol=1e-5)


def test_chosen_backend_is_a_metric_label():
    from packtrain.core.contract import TRAIN_INFO
    from packtrain.trainer.metrics import TrainMetrics

    metrics = TrainMetrics(rank=0, device=CPU)
    metrics.info(attention="varlen", mode="packed")
    samples = [s for m in metrics.registry.collect() if m.name == TRAIN_INFO for s in m.samples]
    assert [(s.labels, s.value) for s in samples] == [
        ({"rank": "0", "attention": "varlen", "mode": "packed"}, 1.0)
    ]
