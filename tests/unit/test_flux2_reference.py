"""FLUX.2 reference images (klein and dev): the transformer inputs difftune trains on with one
and with two references equal what Flux2KleinPipeline / Flux2Pipeline pass their transformer
exactly (CPU); the size rule is the pipelines' at resolution 1024; text-to-image predict is
unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from difftune import families
from difftune.families.base import Conditioning
from difftune.families.flux2 import reference
from difftune.families.flux2.family import unpatchify

from .test_flux2 import _setup


def _capture(module: torch.nn.Module, into: list[dict[str, Any]]) -> Any:
    """Record the keyword arguments of each forward call of `module`."""
    def hook(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
        into.append(dict(kwargs))
    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _image(path: Path, size: tuple[int, int], seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def test_spec_and_rule_are_the_pipelines() -> None:
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    for variant in ("klein", "dev"):
        assert families.spec("flux2", variant).control_images == 4
    for w, h in ((2000, 1000), (1100, 990), (3000, 777), (1024, 1025), (640, 480), (81, 70)):
        image = Image.new("RGB", (w, h))
        if w * h > 1024 * 1024:
            image = Flux2ImageProcessor._resize_to_target_area(image, 1024 * 1024)
        assert reference.fit_size((w, h), 1024 * 1024) == image.size
        iw, ih = image.size
        assert reference.control_size((w, h), 1024 * 1024) == (iw // 16 * 16, ih // 16 * 16)
    w, h = reference.control_size((1000, 600), 512 * 512)  # scaled to the resolution
    assert w % 16 == 0 and h % 16 == 0 and w * h <= 512 * 512


@pytest.mark.parametrize("variant", ["klein", "dev"])
@pytest.mark.parametrize("sizes", [[(80, 72)], [(80, 72), (1100, 990)]],
                         ids=["one", "two-one-over-the-cap"])
def test_transformer_inputs_equal_the_pipeline_exactly(
        tmp_path: Path, variant: str, sizes: list[tuple[int, int]]) -> None:
    pipe, family, comps = _setup(variant)
    paths = [_image(tmp_path / f"ref{i}.png", s, i) for i, s in enumerate(sizes)]
    prompt, height, width = "put the hat on the cat", 32, 48
    seen: list[dict[str, Any]] = []
    handle = _capture(comps.denoiser, seen)
    images = [Image.open(p).convert("RGB") for p in paths]
    pipe(image=images, prompt=prompt, height=height, width=width, num_inference_steps=1,
         guidance_scale=2.5 if variant == "dev" else 1.0,
         generator=torch.Generator().manual_seed(0), output_type="latent")
    want = seen.pop()
    n = (height // 16) * (width // 16)
    ch = want["hidden_states"].shape[2]
    noisy = unpatchify(want["hidden_states"][:, :n].permute(0, 2, 1)
                       .reshape(1, ch, height // 16, width // 16))
    refs = []
    for p, s in zip(paths, sizes):
        size = family.control_size(s, (width, height), 1024)
        refs.append(family.encode_images(comps, family.control_pixels(p, size, 1024)))
    embeds = family.encode_text(comps, [prompt])
    cond = Conditioning(guidance=2.5, original_sizes=[], crops=[], target_sizes=[],
                        controls=tuple(refs))
    out = family.predict(comps, noisy, embeds, want["timestep"], cond)
    handle.remove()
    got = seen.pop()
    for key in ("hidden_states", "img_ids", "txt_ids", "timestep", "encoder_hidden_states",
                "guidance"):
        if want[key] is None:
            assert got[key] is None, key
        else:
            assert torch.equal(got[key], want[key]), key
    assert (want["guidance"] is not None) == (variant == "dev")
    firsts = want["img_ids"][0, n:, 0].unique().tolist()
    assert firsts == [10 * (i + 1) for i in range(len(sizes))]  # a time offset per reference
    assert out.shape == noisy.shape  # the output is the target's tokens only


def test_without_references_predict_is_unchanged() -> None:
    _, family, comps = _setup("klein")
    seen: list[dict[str, Any]] = []
    handle = _capture(comps.denoiser, seen)
    noisy = torch.randn(1, 8, 4, 6, generator=torch.Generator().manual_seed(2))
    embeds = family.encode_text(comps, ["a cat"])
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    family.predict(comps, noisy, embeds, torch.full((1,), 0.5), cond)
    handle.remove()
    got = seen.pop()
    assert got["hidden_states"].shape[1] == 6 and got["img_ids"][..., 0].eq(0).all()


def test_sampling_sizes_references_by_the_rule() -> None:
    family = families.get("flux2", "klein")
    big, small = Image.new("RGB", (200, 150)), Image.new("RGB", (70, 66))
    args = family.pipeline_images([big, small], 96, 96)
    assert [im.size for im in args["image"]] == [reference.control_size((200, 150), 96 * 96),
                                                 (64, 64)]
    assert family.pipeline_images([], 64, 64) == {}
    tiny = Image.new("RGB", (64, 96))  # the rule at 64x64 would go under 64 px: kept as is
    assert family.pipeline_images([tiny], 64, 64)["image"][0] is tiny


def test_reference_latents_are_keyed_by_resolution_and_cropped(tmp_path: Path) -> None:
    """The crop depends on the area cap, so a reference's cache key names the resolution; an
    image under the cap is cropped, never scaled; the tiny fingerprints are unchanged."""
    from difftune.cache.controls import ControlSource
    from difftune.cache.store import MemoryStore
    from difftune.data.discover import Item
    from difftune.data.images import load_control_pixels

    _, family, comps = _setup("klein")
    path = _image(tmp_path / "ref.png", (90, 70), 5)
    size = family.control_size((90, 70), (64, 64), 1024)
    assert size == (80, 64)
    pixels = family.control_pixels(path, size, 1024)
    whole = load_control_pixels(path, (90, 70))
    assert torch.equal(pixels, whole[:, :, 3:67, 5:85])  # the center crop, no resampling
    item = Item(path=path, caption="", size=(64, 64), bucket=(64, 64), dataset=0, subset=0,
                repeats=1, flip=False, crop="center", controls=(path,), control_sizes=(size,))
    keys = [ControlSource(family, comps, [item], MemoryStore(), (r,)).keys() for r in (512, 1024)]
    assert keys[0] != keys[1]
    policy = type("P", (), {"device": torch.device("cpu"), "denoiser_home": torch.device("cpu"),
                            "denoiser": torch.float32, "vae": torch.float32,
                            "text_encoders": torch.float32})()
    from difftune.config import ModelConfig

    loaded = families.get("flux2").load(ModelConfig(family="flux2", flavor="tiny"), policy)
    assert loaded.fingerprint == "tiny-flux2-klein-v1"
