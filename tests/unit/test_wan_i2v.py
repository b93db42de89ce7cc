"""Wan's image-to-video variants (2.2 I2V A14B, 2.1 I2V 14B): what difftune trains with of the
start frame is, bit for bit, what WanImageToVideoPipeline builds from the same image (an image
sample and a clip's first frame: the latent condition, and 2.1's CLIP features), and `predict`
gives the transformers what the pipeline gives them (CPU, tiny flavors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from difftune import families
from difftune.data.images import load_pixels
from difftune.families.base import Conditioning
from difftune.families.wan.tiny import build_tiny_wan

from .conftest import cpu_policy

VARIANTS = ["2.2-i2v-a14b", "2.1-i2v-14b"]
PARTS = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler",
         "image_encoder", "image_processor")


def _pipe_and_family(variant: str = VARIANTS[0]) -> tuple[Any, Any, Any]:
    """The tiny variant's own WanImageToVideoPipeline (the A14B pair's switching at 0.9), the
    family and its components (the same modules)."""
    from diffusers import WanImageToVideoPipeline

    parts = build_tiny_wan(variant)
    family = families.get("wan", variant)
    pipe = WanImageToVideoPipeline(**{k: parts[k] for k in PARTS if k in parts},
                                   boundary_ratio=parts.get("boundary_ratio"))
    pipe.set_progress_bar_config(disable=True)
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def _start_image(tmp_path: Path, width: int = 48, height: int = 32) -> Path:
    """A noisy RGB image at the sample size (so neither side resizes it)."""
    rng = np.random.default_rng(5)
    path = tmp_path / "start.png"
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def _transformer_inputs(pipe: Any, family: Any, comps: Any, image: Image.Image,
                        frames: int) -> list[dict[str, Any]]:
    """The keyword arguments of every expert call of a 3-step sample from `image`."""
    calls: list[dict[str, Any]] = []
    for expert in filter(None, (pipe.transformer, pipe.transformer_2)):
        expert.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    embeds = family.encode_text(comps, ["a red circle"])
    kwargs = {**family.pipeline_inputs(embeds, None, 1.0, 1.0),  # as the sample runner joins
              **family.pipeline_images([image], 48, 32), **family.clip_inputs(frames)}
    pipe(**kwargs, height=32, width=48, num_inference_steps=3, output_type="latent",
         generator=torch.Generator().manual_seed(1))
    return calls


@pytest.mark.parametrize(("variant", "frames"), [
    (VARIANTS[0], 1), (VARIANTS[1], 5),
    pytest.param(VARIANTS[0], 5, marks=pytest.mark.full_only)])  # (2.1's covers a clip)
def test_start_condition_is_the_pipelines_bit_for_bit(tmp_path: Path, variant: str,
                                                      frames: int) -> None:
    """The training pixels of an image (a one-frame sample) or of a clip whose first frame it
    is give the condition the pipeline concatenates to the noisy latents at every step when
    sampling from that image (the 4 mask channels and 16 of the encoded start frame), and
    for Wan 2.1 the CLIP features of the start image it passes beside them."""
    pipe, family, comps = _pipe_and_family(variant)
    path = _start_image(tmp_path)
    pixels = load_pixels(path, (48, 32), (0, 0, 48, 32), False)  # (3, H, W), as the cache does
    clip = torch.cat([pixels[:, None], torch.rand(3, frames - 1, 32, 48) * 2 - 1], dim=1)
    found = family.encode_start(comps, clip[None])
    ours = found["start"]
    calls = _transformer_inputs(pipe, family, comps, Image.open(path).convert("RGB"), frames)
    assert len(calls) == 3
    for kwargs in calls:
        theirs = kwargs["hidden_states"][:, 16:]
        assert theirs.shape == ours.shape == (1, 20, (frames - 1) // 4 + 1, 4, 6)
        assert torch.equal(ours.to(theirs.dtype), theirs)
        image = kwargs["encoder_hidden_states_image"]
        assert (image is None) == ("start_image" not in found) == (variant == VARIANTS[0])
        assert image is None or torch.equal(found["start_image"], image)
    assert ours[:, :4, 0].eq(1).all() and not ours[:, :4, 1:].any()  # the first-frame mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_predict_gives_each_transformer_what_the_pipeline_gives_it(tmp_path: Path,
                                                                  variant: str) -> None:
    """Each denoising step's transformer call (of A14B, the high-noise expert at t >= 900, the
    low one below): `predict` on its noisy channels at t = timestep / 1000 with our condition
    and embeddings returns the same velocity."""
    pipe, family, comps = _pipe_and_family(variant)
    path = _start_image(tmp_path)
    outs: list[torch.Tensor] = []
    for expert in filter(None, (pipe.transformer, pipe.transformer_2)):
        expert.register_forward_hook(lambda m, a, out: outs.append(out[0]))
    calls = _transformer_inputs(pipe, family, comps, Image.open(path).convert("RGB"), 1)
    timesteps = [float(kw["timestep"][0]) for kw in calls]
    assert timesteps[0] >= 900 > timesteps[-1]  # (A14B: both experts ran)
    embeds = family.encode_text(comps, ["a red circle"])
    start = family.encode_start(comps, load_pixels(path, (48, 32), (0, 0, 48, 32),
                                                   False)[None, :, None])
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[], **start)
    for kwargs, out in list(zip(calls, outs)):  # (the hooks go on recording our calls)
        with torch.no_grad():
            ours = family.predict(comps, kwargs["hidden_states"][:, :16, 0], embeds,
                                  kwargs["timestep"].float() / 1000, cond)
        torch.testing.assert_close(ours, out[:, :, 0], rtol=0, atol=1e-6)


def test_clip_vision_encoder_leaves_the_accelerator_with_the_vae_after_caching() -> None:
    """Wan 2.1 I2V's image encoder fills the latent cache with the VAE (the start image's
    features): `cache.offload` moves it off with the VAE once latents are cached, and keeps
    it where latents are encoded per step. (Sampling moves it back with the VAE: its
    pipeline encodes each sample's start image.)"""
    from types import SimpleNamespace

    from difftune.config.data import CacheConfig
    from difftune.train.setup import offloaded

    comps = _pipe_and_family(VARIANTS[1])[2]
    encoder = comps.extras["image_encoder"]

    def run(latents: str) -> Any:
        return SimpleNamespace(cfg=SimpleNamespace(cache=CacheConfig(latents=latents)),
                               comps=comps, text_targets={}, embeddings=None)

    assert any(m is encoder for m in offloaded(run("memory"), live=False))
    assert not any(m is encoder for m in offloaded(run("none"), live=False))
