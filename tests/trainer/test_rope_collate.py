"""mRoPE positions, label shifting and the collators, against `transformers` where it has an answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vlm_fixtures as fx

from packtrain.trainer.data.packed import collate_packed, collate_padded, shift_labels, split_row
from packtrain.trainer.data.rope import sample_positions
from packtrain.trainer.model.build import build_model


@pytest.fixture(scope="module", params=fx.FAMILIES)
def family_samples(request):
    return request.param, fx.demo_samples(request.param)


def test_positions_match_get_rope_index_for_each_sample(family_samples, shared_dir):
    family, samples = family_samples
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family])
    for s in samples:
        kw = {k: s.hf[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in s.hf}
        if not kw:  # text only: transformers uses plain arange
            want = torch.arange(len(s.input_ids)).expand(3, -1).numpy()
        else:
            want = model.model.get_rope_index(s.hf["input_ids"], s.hf["mm_token_type_ids"], **kw)[0][
                :, 0
            ].numpy()
        got = sample_positions(s.input_ids, s.media, fx.spec(family))
        np.testing.assert_array_equal(got, want, err_msg=f"{family} {s.name}")


def test_packed_batch_restarts_everything_per_sample(family_samples, shared_dir):
    family, samples = family_samples
    rows = [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)]
    batch = collate_packed(rows, fx.spec(family))
    lens = [len(s.input_ids) for s in samples]
    assert batch.info.seq_lens == lens
    assert batch.inputs.cu_seq_lens.tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert batch.inputs.max_length == max(lens)
    assert batch.inputs.input_ids.shape == (1, sum(lens))
    pos = batch.inputs.position_ids[:, 0]
    for k, start in enumerate(batch.inputs.cu_seq_lens[:-1].tolist()):
        n = lens[k]
        assert pos[0, start : start + n].tolist() == list(range(n))  # 1-D text row restarts
        assert pos[1:, start].tolist() == [0, 0, 0]  # mRoPE restarts: no inherited offset
        alone = collate_packed([fx.packed_row([samples[k]], family)], fx.spec(family))
        assert torch.equal(pos[:, start : start + n], alone.inputs.position_ids[:, 0])
        # The last token of a sample predicts nothing: the next sample's first label is never
        # learned from this sample's context.
        assert batch.inputs.shift_labels[0, start + n - 1] == -100
    images = [p for r in rows for p, m in zip(r["pixels"], r["media"], strict=True) if m["kind"] == "image"]
    assert torch.equal(batch.inputs.pixel_values, torch.cat(images))
    assert batch.inputs.image_grid_thw.shape == (3, 3)
    assert batch.inputs.video_grid_thw.shape == (1, 3)
    assert (batch.inputs.second_per_grid_ts is not None) == (family == "qwen2.5-vl")
    assert batch.info.num_label_tokens == int((batch.inputs.shift_labels != -100).sum())


def test_pixels_match_the_hf_processor(family_samples, shared_dir):
    family, samples = family_samples
    for s in samples[1:]:
        row = fx.packed_row([s], family)
        for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            mine = [p for p, m in zip(row["pixels"], row["media"], strict=True) if m["kind"] == kind]
            if mine:
                assert torch.equal(torch.cat(mine), s.hf[key]), f"{family} {s.name} {kind}"


def test_shift_labels_stay_inside_samples():
    labels = np.array([-100, 5, 6, -100, 7, 8, 9])
    out = shift_labels(labels, [3, 4])
    assert out.tolist() == [5, 6, -100, 7, 8, 9, -100]


def test_padded_collate_is_the_same_data_one_sample_per_row(family_samples, shared_dir):
    family, samples = family_samples
    packed_row = fx.packed_row(samples, family)
    parts = split_row(packed_row)
    assert [p["input_ids"] for p in parts] == [s.input_ids for s in samples]
    padded = collate_padded(parts, fx.spec(family))
    packed = collate_packed([packed_row], fx.spec(family))
    width = max(len(s.input_ids) for s in samples)
    assert padded.inputs.input_ids.shape == (len(samples), width)
    assert padded.inputs.attention_mask.sum() == packed.info.num_tokens
    assert padded.info.num_label_tokens == packed.info.num_label_tokens
    assert padded.info.padded_tokens == len(samples) * width
    for k, s in enumerate(samples):
        n = len(s.input_ids)
        start = packed.inputs.cu_seq_lens[k]
        assert torch.equal(
            padded.inputs.position_ids[:, k, :n], packed.inputs.position_ids[1:, 0, start : start + n]
        )
    assert torch.equal(padded.inputs.pixel_values, packed.inputs.pixel_values)


def test_mismatched_grid_is_an_error(shared_dir):
    spec = fx.spec("qwen2-vl")
    ids = [1, 2] + [spec.token_ids.image_pad] * 4 + [3]
    image = {"kind": "image", "grid_t": 1, "grid_h": 4, "grid_w": 6}
    with pytest.raises(ValueError, match="placeholder tokens"):
        sample_positions(ids, [image], spec)
    with pytest.raises(ValueError, match="no image grid"):
        sample_positions(ids, [], spec)
