"""The vision features reach the language model, or the run refuses to start.

transformers before 5.18 takes `mm_encoder_outputs` into `**kwargs` and ignores it: the loss is
then the same for any pixels and nothing fails. Here: the loss depends on the pixels for every
family and every backend that runs on CPU, and the start-up check refuses (exit 2) a model class
whose forward lacks the keyword.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
import vlm_fixtures as fx
from conftest import job_spec, write_job
from test_attention_backends import varlen_2_12

from packtrain.core.errors import EXIT_CONFIG, ConfigError
from packtrain.trainer import cli
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model.attention import VarlenKernel, register_varlen
from packtrain.trainer.model.build import VLMForTraining, build_model, load_config
from packtrain.trainer.model.vision_check import (
    MIN_TRANSFORMERS,
    base_model_class,
    check_vision_features,
    require_vision_features,
)


@pytest.fixture
def reference_varlen():
    yield lambda: register_varlen(VarlenKernel.of(varlen_2_12))
    register_varlen()


def _zeroed(inputs):
    return dataclasses.replace(
        inputs,
        pixel_values=torch.zeros_like(inputs.pixel_values),
        pixel_values_videos=torch.zeros_like(inputs.pixel_values_videos),
    )


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("family", fx.FAMILIES)
def test_loss_depends_on_the_pixels(family, shared_dir, reference_varlen):
    samples = fx.demo_samples(family)
    batch = collate_packed([fx.packed_row(samples[1:], family)], fx.spec(family))  # images and a video
    for backend in ("sdpa", "flex", "varlen"):
        model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], attention=backend)
        if backend == "varlen":
            reference_varlen()
        core = VLMForTraining(model, backend)
        with torch.no_grad():
            real = core(batch.inputs)["token_losses"]
            zero = core(_zeroed(batch.inputs))["token_losses"]
        assert (real - zero).abs().max() > 1e-4, f"{family} {backend}: the pixels do not reach the loss"


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_this_transformers_passes_the_check(family, shared_dir):
    config = load_config(fx.FOLDER[family], fx.TINY[family])
    require_vision_features(config)
    assert base_model_class(config).__name__.endswith("Model")


def _forward_without_the_keyword(self, input_ids=None, pixel_values=None, **kwargs):
    """What transformers < 5.18's forwards look like to the check: the keyword would land in kwargs."""


def test_a_forward_without_the_keyword_is_refused(monkeypatch, shared_dir):
    config = load_config(fx.FOLDER["qwen2-vl"], fx.TINY["qwen2-vl"])
    monkeypatch.setattr(transformers.Qwen2VLModel, "forward", _forward_without_the_keyword)
    with pytest.raises(ConfigError, match=rf"pip install 'transformers>={MIN_TRANSFORMERS}'"):
        require_vision_features(config)

    class Bare:
        pass

    with pytest.raises(ConfigError, match="silently dropped"):
        check_vision_features(Bare)


def test_train_exits_2_before_building_the_model(monkeypatch, tmp_path, shared_dir, capsys):
    """Through the CLI: exit 2 (a configuration error), the fix on stderr, before any data is read
    (the data folder here is not even a pack)."""
    monkeypatch.setattr(transformers.Qwen2VLModel, "forward", _forward_without_the_keyword)
    (tmp_path / "data").mkdir()
    job = write_job(tmp_path / "job.yaml", job_spec(tmp_path / "data", tmp_path / "out"))
    assert cli.main(["-c", str(job)]) == EXIT_CONFIG
    assert "pip install 'transformers>=5.18.0'" in capsys.readouterr().err
