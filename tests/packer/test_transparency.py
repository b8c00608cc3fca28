"""Transparent images (`model.alpha`): the pixels equal their references, and a pack decides them.

`white` (the default) is transformers' `convert_to_rgb` (composite onto white; what the processor
does with an in-memory PIL image, and what qwen-vl-utils' `to_rgb` and vLLM do with RGBA images:
paste onto white with the alpha band as mask). `drop` is PIL's `convert("RGB")`. Whichever a pack
was made with, its `resized` media and the trainer's decode of its originals give the same pixels,
and the trainer takes the rule from the manifest (packs from before the setting: `drop`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support.pack_runner import run_in_process
from support.paths import MODELS

from packtrain.core.config import Alpha, PackConfig
from packtrain.core.errors import ConfigError, PackIntegrityError
from packtrain.core.pack.integrity import stored_config_hash
from packtrain.core.pack.shards import MANIFEST
from packtrain.core.pixels import decode_rgb, pack_alpha
from packtrain.core.vision import upright
from packtrain.packer.stages.workdir import check_output_config

torch = pytest.importorskip("torch")
QWEN2 = MODELS / "qwen2-vl"
ORIENTATION = 0x0112


def _alpha_band(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Every kind of alpha: fully transparent, fully opaque and everything between."""
    band = rng.integers(0, 256, (height, width), dtype=np.uint8)
    band[:, ::4] = 0
    band[:, 1::4] = 255
    return band


def transparent_images(folder: Path) -> dict[str, Path]:
    """One small file per way an image can carry transparency (made on the fly, deterministic)."""
    rng = np.random.default_rng(5)
    folder.mkdir(parents=True, exist_ok=True)
    rgba = np.dstack([rng.integers(0, 256, (61, 83, 3), dtype=np.uint8), _alpha_band(rng, 61, 83)])
    la = np.dstack([rng.integers(0, 256, (47, 70), dtype=np.uint8), _alpha_band(rng, 47, 70)])
    palette = Image.fromarray(rng.integers(0, 16, (52, 66), dtype=np.uint8), "P")
    palette.putpalette([int(v) for v in rng.integers(0, 256, 768)])
    files = {
        "rgba.png": lambda p: Image.fromarray(rgba, "RGBA").save(p),
        "rgba.webp": lambda p: Image.fromarray(rgba, "RGBA").save(p, lossless=True),
        "rgba-lossy.webp": lambda p: Image.fromarray(rgba, "RGBA").save(p, quality=60),
        "la.png": lambda p: Image.fromarray(la, "LA").save(p),
        "p-index.png": lambda p: palette.save(p, transparency=3),
        "p-table.png": lambda p: palette.save(p, transparency=bytes(range(0, 256, 16))),
        "p.gif": lambda p: palette.save(p, transparency=5),
        "rgb-key.png": lambda p: Image.fromarray(rgba[..., :3] // 64 * 64).save(p, transparency=(64, 128, 0)),
        "rgba-rotated.png": lambda p: Image.fromarray(rgba, "RGBA").save(p, exif=_exif(6)),
    }
    paths = {}
    for name, save in files.items():
        save(folder / name)
        paths[name] = folder / name
    return paths


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    return exif.tobytes()


def transformers_rgb(path: Path) -> np.ndarray:
    """The reference for `white`: transformers' own `convert_to_rgb` of the upright PIL image."""
    from transformers.image_transforms import convert_to_rgb

    with Image.open(path) as img:
        return np.asarray(convert_to_rgb(upright(img), return_numpy=True))


def paste_on_white_rgb(path: Path) -> np.ndarray:
    """qwen-vl-utils' `to_rgb` rule (vLLM's `rgba_to_rgb` too), written from its documentation: a
    white RGB canvas, the image pasted on it with its alpha band as the mask. Both apply it to mode
    RGBA only (LA and palette images are `convert("RGB")`-ed); here every image is made RGBA first."""
    with Image.open(path) as img:
        rgba = upright(img).convert("RGBA")
    canvas = Image.new("RGB", rgba.size, (255, 255, 255))
    canvas.paste(rgba, mask=rgba.split()[3])
    return np.asarray(canvas)


def dropped_rgb(path: Path) -> np.ndarray:
    """The reference for `drop`: PIL's `convert("RGB")` of the upright image."""
    with Image.open(path) as img, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PIL's note on palettes with an alpha table
        return np.asarray(upright(img).convert("RGB"))


REFERENCE = {"white": transformers_rgb, "drop": dropped_rgb}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return transparent_images(tmp_path_factory.mktemp("transparent"))


def test_every_test_image_is_transparent(images: dict[str, Path]) -> None:
    """The fixtures do test something: compositing changes pixels of each (the measured gap)."""
    for name, path in images.items():
        gap = np.abs(transformers_rgb(path).astype(int) - dropped_rgb(path).astype(int))
        assert gap.max() > 0, name


@pytest.mark.parametrize("alpha", ["white", "drop"])
def test_decoded_pixels_equal_the_reference(images: dict[str, Path], alpha: Alpha) -> None:
    for name, path in images.items():
        got = decode_rgb(path.read_bytes(), alpha)
        want = REFERENCE[alpha](path)
        assert got.shape == want.shape and np.array_equal(got, want), f"{name}: {alpha} differs"


def test_white_is_also_paste_with_the_alpha_mask(images: dict[str, Path]) -> None:
    """qwen-vl-utils' and vLLM's rule (paste with the mask) gives the same pixels as alpha_composite."""
    for name, path in images.items():
        assert np.array_equal(decode_rgb(path.read_bytes(), "white"), paste_on_white_rgb(path)), name


def test_white_is_what_the_processor_makes_of_an_in_memory_image(images: dict[str, Path]) -> None:
    """transformers' image processor given the PIL image (as at inference): the same `pixel_values`."""
    from transformers import AutoProcessor

    from packtrain.trainer.data.media import PixelSpec, media_pixels

    processor = AutoProcessor.from_pretrained(str(QWEN2)).image_processor
    spec = PixelSpec.from_folder(QWEN2)
    for name, path in images.items():
        if "rotated" in name:  # the processor does not apply EXIF orientation to a PIL image
            continue
        with Image.open(path) as img:
            want = processor(images=[img], return_tensors="pt")
        t, gh, gw = want["image_grid_thw"][0].tolist()
        ref = {"kind": "image", "key": name, "height": gh * 14, "width": gw * 14}
        ref |= {"grid_t": t, "grid_h": gh, "grid_w": gw}
        got = media_pixels({"encoding": "original", "data": path.read_bytes(), "frames": []}, ref, spec)
        assert torch.equal(got, want["pixel_values"]), name


def _config(data: Path, alpha: str | None, storage: str) -> PackConfig:
    model: dict[str, Any] = {"path": str(QWEN2), "maxPixels": 48 * 28 * 28}
    if alpha is not None:
        model["alpha"] = alpha
    return PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": model,
            "packing": {"maxLength": 1024, "mediaStorage": storage},
        }
    )


def _dataset_file(images: dict[str, Path]) -> Path:
    """One record per image, in the images' folder (the default media root)."""
    folder = next(iter(images.values())).parent
    data = folder / "d.jsonl"
    with data.open("w") as f:
        for name in images:
            turns = [{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "it"}]
            f.write(json.dumps({"id": name, "messages": turns, "images": [name]}) + "\n")
    return data


@pytest.fixture(scope="module")
def packs(images: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """The same data packed with each alpha and each storage."""
    data = _dataset_file(images)
    root = tmp_path_factory.mktemp("packs")
    out = {}
    for alpha in ("white", "drop"):
        for storage in ("original", "resized"):
            manifest = run_in_process(_config(data, alpha, storage), root / f"{alpha}-{storage}")
            assert manifest["counts"]["packed"] == len(images), manifest["counts"]
            out[alpha, storage] = root / f"{alpha}-{storage}"
    return out


def _trained_pixels(pack: Path, pixel_alpha: str = "white") -> dict[str, Any]:
    """Each media key's patches as the trainer's dataset decodes them, with a PixelSpec whose own
    alpha is `pixel_alpha` (the dataset must replace it with the pack's)."""
    from packtrain.core.model_spec import model_spec
    from packtrain.trainer.data.media import PixelSpec
    from packtrain.trainer.data.packed import PackedDataset

    spec = dataclasses.replace(PixelSpec.from_folder(QWEN2), alpha=pixel_alpha)
    ds = PackedDataset(pack, model_spec(QWEN2), spec)
    got: dict[str, Any] = {}
    for seq in range(len(ds.seq_lens)):
        row = ds._decoded_row(seq, {})
        got |= {ref["key"]: (ref, px) for ref, px in zip(row["media"], row["pixels"], strict=True)}
    return got


def _reference_pixels(path: Path, alpha: str, ref: dict[str, Any]) -> Any:
    """The reference RGB at the source size, then the trainer's resize, normalize and patchify."""
    from packtrain.trainer.data.media import PixelSpec, image_pixels

    buf = io.BytesIO()
    Image.fromarray(REFERENCE[alpha](path), "RGB").save(buf, format="PNG")
    return image_pixels(buf.getvalue(), ref["height"], ref["width"], PixelSpec.from_folder(QWEN2))


@pytest.mark.parametrize("alpha", ["white", "drop"])
def test_both_storage_modes_train_on_the_reference_pixels(
    images: dict[str, Path], packs: dict[tuple[str, str], Path], alpha: str
) -> None:
    by_key = {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in images.values()}
    original, resized = _trained_pixels(packs[alpha, "original"]), _trained_pixels(packs[alpha, "resized"])
    assert set(original) == set(resized) == set(by_key)
    for key, (ref, px) in original.items():
        assert torch.equal(px, resized[key][1]), f"{by_key[key].name}: original and resized differ"
        assert torch.equal(px, _reference_pixels(by_key[key], alpha, ref)), by_key[key].name
    manifest = json.loads((packs[alpha, "original"] / MANIFEST).read_text())
    assert manifest["config"]["model"]["alpha"] == alpha


def test_the_pack_decides_not_the_trainers_default(packs: dict[tuple[str, str], Path]) -> None:
    """A `drop` pack decoded with a PixelSpec that says white trains on dropped pixels, and back."""
    for alpha, other in (("drop", "white"), ("white", "drop")):
        want = _trained_pixels(packs[alpha, "original"], pixel_alpha=alpha)
        got = _trained_pixels(packs[alpha, "original"], pixel_alpha=other)
        assert all(torch.equal(px, want[k][1]) for k, (_, px) in got.items()), alpha
    white, drop = _trained_pixels(packs["white", "original"]), _trained_pixels(packs["drop", "original"])
    assert all(not torch.equal(px, drop[k][1]) for k, (_, px) in white.items())


def test_token_counts_do_not_depend_on_alpha(packs: dict[tuple[str, str], Path]) -> None:
    from packtrain.core.pack.shards import ShardReader

    rows = {}
    for alpha in ("white", "drop"):
        reader = ShardReader(packs[alpha, "resized"])
        rows[alpha] = list(reader)
    for a, b in zip(rows["white"], rows["drop"], strict=True):
        assert a["input_ids"] == b["input_ids"] and a["media"] == b["media"]


def _as_made_before_the_setting(pack: Path) -> None:
    """Rewrite a manifest as a packer without `model.alpha` wrote it (no key, its hash)."""
    manifest = json.loads((pack / MANIFEST).read_text())
    del manifest["config"]["model"]["alpha"]
    manifest["config_hash"] = stored_config_hash(manifest["config"])
    (pack / MANIFEST).write_text(json.dumps(manifest))


def test_a_pack_from_before_the_setting_reads_as_drop(
    packs: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    """Older packs dropped alpha (their resized media were made so): their originals decode the same."""
    import shutil

    from packtrain.packer.tools import verify

    old = tmp_path / "old"
    shutil.copytree(packs["drop", "original"], old)
    _as_made_before_the_setting(old)
    assert pack_alpha(json.loads((old / MANIFEST).read_text())) == "drop"
    assert verify(old) == []
    want = _trained_pixels(packs["drop", "original"])
    got = _trained_pixels(old, pixel_alpha="white")
    assert all(torch.equal(px, want[k][1]) for k, (_, px) in got.items())


def test_an_unknown_alpha_in_a_manifest_is_refused(
    packs: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    import shutil

    from packtrain.packer.tools import verify

    bad = tmp_path / "bad"
    shutil.copytree(packs["white", "original"], bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["config"]["model"]["alpha"] = "black"
    manifest["config_hash"] = stored_config_hash(manifest["config"])
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PackIntegrityError, match="alpha"):
        _trained_pixels(bad)
    assert any("not a valid pack configuration" in p for p in verify(bad))


def test_alpha_is_part_of_the_config_hash(
    images: dict[str, Path], packs: dict[tuple[str, str], Path]
) -> None:
    """A re-run or resume with the other alpha is refused, not mixed into the same folder."""
    data = _dataset_file(images)
    white, drop = _config(data, "white", "resized"), _config(data, "drop", "resized")
    assert white.config_hash() != drop.config_hash()
    assert _config(data, None, "resized").config_hash() == white.config_hash()  # white is the default
    check_output_config(white, packs["white", "resized"])
    with pytest.raises(ConfigError, match="different configuration .*settings that differ: model.alpha\\)"):
        check_output_config(drop, packs["white", "resized"])


def test_a_folder_claimed_before_the_setting_is_not_resumed(images: dict[str, Path], tmp_path: Path) -> None:
    """A half-made pack of a packer that dropped alpha is not finished by one that composites."""
    from packtrain.packer.stages.workdir import CONFIG_CLAIM, work_dir

    cfg = _config(_dataset_file(images), None, "original")
    old = cfg.dump()
    del old["model"]["alpha"]
    work_dir(tmp_path).mkdir()
    claim = {"config_hash": stored_config_hash(old), "config": old}
    (work_dir(tmp_path) / CONFIG_CLAIM).write_text(json.dumps(claim))
    with pytest.raises(ConfigError, match="settings that differ: model.alpha\\)"):
        check_output_config(cfg, tmp_path)


def test_pack_alpha_reads_the_manifest() -> None:
    assert pack_alpha({"config": {"model": {"path": "m", "alpha": "white"}}}) == "white"
    assert pack_alpha({"config": {"model": {"path": "m", "alpha": "drop"}}}) == "drop"
    assert pack_alpha({"config": {"model": {"path": "m"}}}) == "drop"  # made before the setting
    with pytest.raises(PackIntegrityError, match="alpha"):
        pack_alpha({"config": {"model": {"path": "m", "alpha": True}}})
