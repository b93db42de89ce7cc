"""The memorization reference is each training image's VAE copy (report/vae_copies.py): the
round trip through a VAE of any kind, and the copy rule measured against it.

The tiny FLUX.1 VAE keeps the red circle only to 0.975 of itself under the tiny DINOv2, below
the circle's own copy floor (0.992): measured against the image, even the best copy the model
can make is not a copy; measured against its VAE copy, it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.config.metrics import MetricsConfig
from difftune.report.sample_metrics import measure, read_sample, reference
from difftune.report.scoring import Scorers
from difftune.report.vae_copies import read_index, round_trip, to_image, write_index
from difftune.verbs.demo import demo_dir
from tests.unit.test_sample_metrics import _noisy, _sample

CIRCLE = demo_dir() / "red_circle.png"


def _pixels(path: Path) -> torch.Tensor:
    """(1, 3, H, W) in [-1, 1]."""
    array = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 127.5 - 1
    return torch.from_numpy(array).permute(2, 0, 1)[None]


def test_the_round_trip_is_the_vaes_decode_of_its_encoding() -> None:
    """An image VAE (the tiny FLUX.1 one) and video VAEs (one frame through Qwen-Image's
    3D autoencoder and Qwen-Image 2.1's RGBA one, as their families encode and decode) give
    what their own calls give."""
    from diffusers import AutoencoderKLQwenImage

    from difftune.families.anima.tiny import TINY_VAE_CONFIG
    from difftune.families.common import frame_vae
    from difftune.families.common.tiny import load_tiny_vae

    x = _pixels(CIRCLE)
    vae = load_tiny_vae()
    with torch.no_grad():
        direct = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    assert torch.allclose(round_trip(vae, x), direct, atol=1e-6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        video = AutoencoderKLQwenImage(**TINY_VAE_CONFIG).eval()
    expected = frame_vae.decode(video, frame_vae.encode(video, x)).clamp(-1, 1)
    got = round_trip(video, x)
    assert got.shape == x.shape and torch.allclose(got, expected, atol=1e-4)
    # Qwen-Image 2.1's: RGBA, and its causal convolutions are no torch Conv3d.
    from diffusers import AutoencoderKLQwenImage21

    from difftune.families.qwen_image_21.tiny import TINY_VAE_CONFIG as RGBA_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        rgba = AutoencoderKLQwenImage21(**RGBA_CONFIG).eval()
    opaque = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    expected = frame_vae.decode(rgba, frame_vae.encode(rgba, opaque))[:, :3].clamp(-1, 1)
    assert torch.allclose(round_trip(rgba, x), expected, atol=1e-4)


def test_a_copy_through_the_vae_is_flagged_against_its_vae_copy(
        tmp_path: Path, scorer_models: tuple) -> None:
    from difftune.families.common.tiny import load_tiny_vae

    scorers = Scorers.load(MetricsConfig(enabled=True, dino=scorer_models[0]))
    copy_png = tmp_path / "red_circle-vae.png"
    to_image(round_trip(load_tiny_vae(), _pixels(CIRCLE))[0]).save(copy_png)
    # What a LoRA that reproduces the circle's latent draws: its VAE copy, as a sample.
    drawn = _sample(tmp_path / "drawn.png", Image.open(copy_png).convert("RGB"), "a circle")
    other = _sample(tmp_path / "ring.png", _noisy(demo_dir() / "pink_ring.png", 1), "a ring")
    samples = [read_sample(drawn), read_sample(other)]
    plain = reference(scorers, [CIRCLE], tmp_path / "cache")
    assert float(plain.floors[0]) > measure(scorers, plain, samples)["nearest_similarity"]
    assert not measure(scorers, plain, samples)["copying"]  # the image itself: out of reach
    ref = reference(scorers, [CIRCLE], tmp_path / "cache", copies=[copy_png])
    m = measure(scorers, ref, samples)
    assert m["copying"] and m["samples"][0]["nearest_similarity"] == pytest.approx(1, abs=1e-5)
    assert not measure(scorers, ref, samples[1:])["copying"]
    assert m["fidelity"] == pytest.approx(measure(scorers, plain, samples)["fidelity"])
    write_index(tmp_path / "run", [CIRCLE], [copy_png])  # what `runs rank` reads
    assert read_index(tmp_path / "run", [CIRCLE]) == [copy_png]
    copy_png.unlink()
    assert read_index(tmp_path / "run", [CIRCLE]) is None  # a copy gone: the images then
