"""One attention call per vision block equals transformers' per-segment calls.

Every family's tower, on the demo images and video (Qwen2.5-VL with its windows), through each
backend that runs on CPU (sdpa, flex eager, varlen with the CPU reference kernel of
test_attention_backends): `one_call_vision` against `per_segment` (transformers' own loop over
images, frames and windows, the behaviour before), fp64. And the count on Qwen2.5-VL-3B's
geometry (32 blocks, 28 of them windowed over 112-pixel windows): one call per block.
"""

from __future__ import annotations

import pytest
import torch
import vlm_fixtures as fx
from test_attention_backends import varlen_2_12
from test_equivalence import _double_batch

from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model.attention import VarlenKernel, register_backend, register_varlen
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.model.vision_attention import counting_calls, one_call_vision, per_segment, vision_name

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
BACKENDS = ("sdpa", "flex", "varlen")


@pytest.fixture
def reference_varlen():
    """The CPU reference as the varlen kernel (after build_model); torch's again afterwards."""
    yield lambda: register_varlen(VarlenKernel.of(varlen_2_12))
    register_varlen()


def _media(family):
    batch = _double_batch(collate_packed([fx.packed_row(fx.demo_samples(family), family)], fx.spec(family)))
    inputs = batch.inputs
    pixels = torch.cat([inputs.pixel_values, inputs.pixel_values_videos])
    return pixels, torch.cat([inputs.image_grid_thw, inputs.video_grid_thw])


def _tower(model, pixels, grid):
    out = model.model.visual(pixels, grid_thw=grid)
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_one_call_equals_per_segment(family, shared_dir, reference_varlen):
    """Only the tower runs, so one model serves every backend: the tower's name is switched."""
    pixels, grid = _media(family)
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64)
    depth = len(model.model.visual.blocks)
    for backend in BACKENDS:
        register_backend(backend)  # the per-segment reference's function
        if backend == "varlen":
            reference_varlen()
        one_call_vision(model, backend)
        with torch.no_grad():
            with counting_calls(model) as calls:
                one = _tower(model, pixels, grid)
            with per_segment(model), counting_calls(model) as before:
                ref = _tower(model, pixels, grid)
        assert len(calls) == depth, backend
        assert len(before) > 2 * depth, backend  # the demo has 3 images and a 2-frame video
        for a, b in zip(one, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{family} {backend}")


def test_the_model_wrapper_switches_the_tower(shared_dir):
    model = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], attention="flex")
    VLMForTraining(model, "flex")
    assert model.model.visual.config._attn_implementation == vision_name("flex")
    assert model.model.language_model.config._attn_implementation == "packtrain_flex"  # untouched


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_one_call_gradients_equal_per_segment(family, shared_dir):
    """The backward too (sdpa: flex has no CPU backward, varlen's is the kernel's)."""
    pixels, grid = _media(family)
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64)
    one_call_vision(model, "sdpa")
    grads = []
    for context in (per_segment(model), torch.enable_grad()):
        with context:
            sum(f.square().sum() for f in _tower(model, pixels, grid)).backward()
        grads.append(
            {n: p.grad.clone() for n, p in model.model.visual.named_parameters() if p.grad is not None}
        )
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_calls_per_row_on_the_3b_geometry(shared_dir):
    """Qwen2.5-VL-3B's tower layout (patch 14, merge 2, 112-pixel windows, full attention in blocks
    7, 15, 23, 31), narrow: a 504x392 image (36x28 patches: 5x4 windows) and a 4-frame 224x224
    video (2 temporal patches of 16x16: 2x2 windows each). Before: a call per window in each of 28
    blocks and per image / frame in 4; after: one per block."""
    vision = {"depth": 32, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}
    vision |= {"fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112}
    overrides = {**fx.TINY["qwen2.5-vl"], "vision_config": vision}
    model = build_model(fx.FOLDER["qwen2.5-vl"], init="random", overrides=overrides)
    one_call_vision(model, "sdpa")
    grid = torch.tensor([[1, 36, 28], [2, 16, 16]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        with per_segment(model), counting_calls(model) as before:
            ref = model.model.visual(pixels, grid_thw=grid).pooler_output
        with counting_calls(model) as after:
            one = model.model.visual(pixels, grid_thw=grid).pooler_output
    windows, segments = 5 * 4 + 2 * (2 * 2), 1 + 2
    assert len(before) == 28 * windows + 4 * segments == 796
    assert len(after) == 32
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-6)
