"""Qwen-Image-Edit (the Qwen-Image family's edit variants): chosen by config or a folder's
model_index.json; the transformer inputs difftune trains on (the VL prompt embeddings of the
instruction with the image, the packed reference latents, img_shapes) equal the edit pipeline's
exactly (CPU); text entries are keyed by the image they read."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from difftune import families
from difftune.cache.sources import TextSource
from difftune.cache.store import MemoryStore
from difftune.cache.text_images import from_file
from difftune.config import ModelConfig
from difftune.families.base import Conditioning
from difftune.families.common.latents import unpack
from difftune.families.qwen_image import edit
from difftune.families.qwen_image.tiny import build_tiny_qwen_image

from .conftest import cpu_policy

PIPELINES = {"edit": "QwenImageEditPipeline", "edit-plus": "QwenImageEditPlusPipeline"}


def _setup(variant: str) -> tuple[Any, Any, Any]:
    import diffusers

    parts = build_tiny_qwen_image(variant)
    pipe = getattr(diffusers, PIPELINES[variant])(**parts)
    pipe.set_progress_bar_config(disable=True)
    family = families.get("qwen_image", variant)
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def _image(path: Path, size: tuple[int, int], seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def test_variants_from_config_and_folder(tmp_path: Path) -> None:
    assert ModelConfig(family="qwen_image", flavor="tiny").variant == "base"
    for variant, pipeline in {"base": "QwenImagePipeline", **PIPELINES}.items():
        folder = tmp_path / variant
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        assert ModelConfig(family="qwen_image", path=folder).variant == variant
        assert families.spec("qwen_image", variant).pipeline_class == pipeline
    assert families.spec("qwen_image", "edit").control_images == 1
    assert families.spec("qwen_image", "edit-plus").control_images == 3
    assert families.spec("qwen_image").control_images == 0


def test_tiny_fingerprints_keep_the_base_caches() -> None:
    policy = cpu_policy()
    base = families.get("qwen_image").load(ModelConfig(family="qwen_image", flavor="tiny"),
                                           policy)
    assert base.fingerprint == "tiny-qwen_image-v1"  # as before variants existed
    spec = families.spec("qwen_image").text_encoders[0]
    assert "image_prompt" not in spec.key_fields()
    for variant in PIPELINES:
        comps = families.get("qwen_image", variant).load(
            ModelConfig(family="qwen_image", flavor="tiny", variant=variant), policy)
        assert comps.fingerprint == f"tiny-qwen_image-{variant}-v1"


def test_sizes_follow_the_pipeline_rule() -> None:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as one
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    for size in ((1000, 600), (600, 1000), (512, 512), (3000, 1000), (777, 779), (40, 30)):
        for area in (1024 * 1024, 384 * 384):
            assert edit.dimensions(area, size) == one.calculate_dimensions(
                area, size[0] / size[1])[:2]
            assert edit.dimensions(area, size) == plus.calculate_dimensions(
                area, size[0] / size[1])[:2]
        assert edit.control_size(size, 1024) == edit.dimensions(1024 * 1024, size)
    # the areas the Plus pipeline sizes its inputs by, as released
    assert plus.VAE_IMAGE_SIZE == 1024 * 1024
    assert plus.CONDITION_IMAGE_SIZE == edit.text_area(True) == 384 * 384
    # the edit pipeline's one size, inline (tests/e2e/contract/test_qwen_image_edit.py
    # shrinks exactly that call in its pipeline runs)
    assert edit.text_area(False) == 1024 * 1024
    assert "calculate_dimensions(1024 * 1024," in inspect.getsource(
        one.QwenImageEditPipeline.__call__)
    assert edit.control_size((3000, 100), 64) == (352, 32)  # never below one 32-pixel side


def _capture(module: torch.nn.Module, into: list[dict[str, Any]]) -> Any:
    """Record the keyword arguments of each forward call of `module`."""
    def hook(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
        into.append(dict(kwargs))
    return module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("variant", list(PIPELINES))
def test_transformer_inputs_equal_the_pipeline_exactly(tmp_path: Path, variant: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The edit pipeline encodes its input image at 1024 x 1024 (inline), so that variant runs
    at resolution 1024; the Plus pipeline reads its VAE area from a module constant, which is
    set here to 256 x 256 (three images at 1024 x 1024 through the VAE twice cost 20 s):
    difftune's sizes at resolution 256 against the pipeline's at that area. That the constant
    is 1024 x 1024 as released, and that resolution 1024 gives it, the sizes test asserts."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from difftune.data.images import load_control_pixels

    resolution = 1024 if variant == "edit" else 256
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", resolution * resolution)
    pipe, family, comps = _setup(variant)
    sizes = [(40, 30), (24, 40), (32, 32)][: family.control_images]
    paths = [_image(tmp_path / f"in{n}.png", s, n) for n, s in enumerate(sizes)]
    prompt, height, width = "make the circle red", 32, 48
    seen: list[dict[str, Any]] = []
    handle = _capture(comps.denoiser, seen)
    inputs = [Image.open(p).convert("RGB") for p in paths]
    pipe(image=inputs if len(inputs) > 1 else inputs[0], prompt=prompt, height=height,
         width=width, num_inference_steps=2, true_cfg_scale=1.0,
         generator=torch.Generator().manual_seed(0), output_type="latent")
    want = seen[0]  # the first step (one step alone gives a NaN sigma with shift_terminal)
    seen.clear()
    h, w = height // 8, width // 8
    n = (h // 2) * (w // 2)
    noisy = unpack(want["hidden_states"][:, :n], h, w)
    # At resolution 1024 the VAE sizes are the pipeline's own (at 256, the patched Plus's).
    controls = tuple(family.encode_images(
        comps, load_control_pixels(p, family.control_size(s, (0, 0), resolution))) for p, s in
        zip(paths, sizes))
    images = tuple(from_file(p, family.text_image_size(s, (0, 0)), family.text_image_rule)
                   for p, s in zip(paths, sizes))
    embeds = TextSource(family, comps, MemoryStore()).get([prompt], [images])
    cond = Conditioning(guidance=1.0, original_sizes=[(height, width)], crops=[(0, 0)],
                        target_sizes=[(height, width)], controls=controls)
    out = family.predict(comps, noisy, embeds, want["timestep"], cond)
    handle.remove()
    got = seen.pop()
    for key in ("hidden_states", "encoder_hidden_states", "timestep", "img_shapes",
                "guidance"):
        assert (torch.equal(got[key], want[key]) if torch.is_tensor(want[key])
                else got[key] == want[key]), key
    assert got["encoder_hidden_states_mask"] is None and want["encoder_hidden_states_mask"] is None
    assert len(want["img_shapes"][0]) == 1 + len(paths)
    assert out.shape == noisy.shape  # the output is the target's tokens only


def test_text_entries_are_keyed_by_the_image(tmp_path: Path) -> None:
    _, family, comps = _setup("edit")
    store = MemoryStore()
    texts = TextSource(family, comps, store)
    path = _image(tmp_path / "a.png", (40, 30), 1)
    size = family.text_image_size((40, 30), (0, 0))

    def images() -> list[tuple[Any, ...]]:
        return [(from_file(path, size, family.text_image_rule),)]

    first = texts.get(["make it red"], images())
    assert len(store) == 1
    texts.get(["make it red"], images())
    assert len(store) == 1  # the same instruction and image: the same entry
    second = texts.get(["make it blue"], images())
    assert len(store) == 2
    _image(path, (40, 30), 2)  # the same file, edited
    third = texts.get(["make it red"], images())
    assert len(store) == 3
    assert not torch.equal(first.tensors["prompt_embeds"], third.tensors["prompt_embeds"])
    assert second.tensors["prompt_embeds"].shape[-1] == first.tensors["prompt_embeds"].shape[-1]
    other = from_file(path, size, "another-rule")
    texts.get(["make it red"], [(other,)])
    assert len(store) == 4  # the size rule is part of the key


def test_training_reads_pair_images_at_the_pipelines_text_sizes(tmp_path: Path) -> None:
    from difftune.cache.controls import ControlSource
    from difftune.data.discover import Item

    paths = [_image(tmp_path / f"in{n}.png", s, n) for n, s in enumerate([(40, 30), (30, 60)])]
    item = Item(tmp_path / "t.png", "make it red", (64, 64), (64, 64), 0, 0, 1, False,
                "center", controls=tuple(paths), control_sizes=((64, 64), (32, 64)))
    for variant, area in (("edit", 1024 * 1024), ("edit-plus", 384 * 384)):
        _, family, comps = _setup(variant)
        images = ControlSource(family, comps, [item], MemoryStore()).text_images(0)
        assert [i.size for i in images] == [edit.dimensions(area, (40, 30)),
                                             edit.dimensions(area, (30, 60))]
        assert images[0].load().size == images[0].size
        assert family.text_image_rule in images[0].key
    # a family whose encoders read no images gets none (its text keys stay as they were)
    flux = families.get("flux", "kontext")
    comps = flux.load(ModelConfig(family="flux", flavor="tiny", variant="kontext"), cpu_policy())
    assert ControlSource(flux, comps, [item], MemoryStore()).text_images(0) == ()
