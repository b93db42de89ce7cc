"""FLUX.1 Kontext (the FLUX.1 family's "kontext" variant): chosen by config or a folder's
model_index.json; the transformer inputs difftune trains on equal FluxKontextPipeline's exactly
(CPU); control images are sized by the pipeline's rule and cached by content."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from difftune import families
from difftune.config import ModelConfig
from difftune.families.base import Conditioning
from difftune.families.common.latents import unpack
from difftune.families.flux import kontext
from difftune.families.flux.tiny import T5_MAX_LENGTH, build_tiny_flux

from .conftest import cpu_policy


def _setup() -> tuple[Any, Any, Any]:
    from diffusers import FluxKontextPipeline

    parts = build_tiny_flux("kontext")
    pipe = FluxKontextPipeline(**{k: v for k, v in parts.items() if k != "t5_max_length"})
    pipe.set_progress_bar_config(disable=True)
    family = families.get("flux", "kontext")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_variant_from_config_and_folder(tmp_path: Path) -> None:
    assert ModelConfig(family="flux", flavor="tiny").variant == "base"
    assert ModelConfig(family="flux", flavor="tiny", variant="kontext").variant == "kontext"
    for pipeline, variant in (("FluxKontextPipeline", "kontext"), ("FluxPipeline", "base")):
        folder = tmp_path / variant
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        assert ModelConfig(family="flux", path=folder).variant == variant
    spec = families.spec("flux", "kontext")
    assert spec.pipeline_class == "FluxKontextPipeline" and spec.control_images == 1
    assert families.spec("flux").control_images == 0
    assert families.spec("flux").pipeline_class == "FluxPipeline"


def test_tiny_fingerprints_keep_the_base_caches() -> None:
    policy = cpu_policy()
    base = families.get("flux").load(ModelConfig(family="flux", flavor="tiny"), policy)
    kon = families.get("flux", "kontext").load(
        ModelConfig(family="flux", flavor="tiny", variant="kontext"), policy)
    assert base.fingerprint == "tiny-flux-v1"  # as before variants existed
    assert kon.fingerprint == "tiny-flux-kontext-v1"


def test_preferred_resolutions_and_rule_equal_the_pipeline() -> None:
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    assert list(kontext.PREFERRED) == list(PREFERRED_KONTEXT_RESOLUTIONS)
    for w, h in ((1000, 600), (600, 1000), (512, 512), (3000, 1000), (777, 779), (1234, 987)):
        aspect = w / h
        _, pw, ph = min((abs(aspect - a / b), a, b) for a, b in PREFERRED_KONTEXT_RESOLUTIONS)
        assert kontext.control_size((w, h), 1024) == (pw // 16 * 16, ph // 16 * 16)
    # scaled to the dataset's resolution: about its area, multiples of 16
    w, h = kontext.control_size((1000, 600), 512)
    assert w % 16 == 0 and h % 16 == 0 and abs(w * h - 512 * 512) < 0.1 * 512 * 512
    assert kontext.control_size((40, 30), 16) == (16, 16)


def _capture(module: torch.nn.Module, into: list[dict[str, Any]]) -> Any:
    """Record the keyword arguments of each forward call of `module`."""
    def hook(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
        into.append(dict(kwargs))
    return module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("control", [(64, 32), (48, 32)])
def test_transformer_inputs_equal_the_pipeline_exactly(tmp_path: Path,
                                                       control: tuple[int, int]) -> None:
    from difftune.data.images import load_control_pixels

    pipe, family, comps = _setup()
    gen = torch.Generator().manual_seed(7)
    image_path = tmp_path / "before.png"
    pixels = torch.randint(0, 256, (control[1], control[0], 3), generator=gen, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(image_path)
    prompt, height, width = "make the circle red", 32, 48
    seen: list[dict[str, Any]] = []
    handle = _capture(comps.denoiser, seen)
    with Image.open(image_path) as img:
        pipe(image=img.convert("RGB"), prompt=prompt, height=height, width=width,
             max_area=height * width, _auto_resize=False, num_inference_steps=1,
             guidance_scale=2.5, generator=torch.Generator().manual_seed(0),
             output_type="latent", max_sequence_length=T5_MAX_LENGTH)
    want = seen.pop()
    h, w = height // 8, width // 8
    n = (h // 2) * (w // 2)
    noisy = unpack(want["hidden_states"][:, :n], h, w)
    control_latent = family.encode_images(comps, load_control_pixels(image_path, control))
    embeds = family.encode_text(comps, [prompt])
    cond = Conditioning(guidance=2.5, original_sizes=[(height, width)], crops=[(0, 0)],
                        target_sizes=[(height, width)], controls=(control_latent,))
    out = family.predict(comps, noisy, embeds, want["timestep"], cond)
    handle.remove()
    got = seen.pop()
    for key in ("hidden_states", "img_ids", "txt_ids", "guidance", "timestep",
                "encoder_hidden_states", "pooled_projections"):
        assert torch.equal(got[key], want[key]), key
    assert want["hidden_states"].shape[1] == n + (control[0] // 16) * (control[1] // 16)
    assert out.shape == noisy.shape  # the output is the target's tokens only


def test_sampling_resizes_by_the_rule_and_keeps_the_output_size() -> None:
    family = families.get("flux", "kontext")
    image = Image.new("RGB", (100, 60), (255, 0, 0))
    args = family.pipeline_images([image], 48, 32)
    assert args["max_area"] == 48 * 32 and args["_auto_resize"] is False
    assert args["image"].size == kontext.control_size((100, 60), round((48 * 32) ** 0.5))
    assert families.get("flux").pipeline_images([image], 48, 32) == {}
