"""The memory of video clips (memory/clips.py, memory/estimate.py): a clip's tokens are its
latent frames' (Wan: 4N+1 frames -> N+1), image families ignore frames, and each card's advice
names what fits: the savers (checkpointing, block swap), else fewer frames."""

from __future__ import annotations

from difftune.memory import clips, estimate

SETTINGS = {"precision.denoiser": "bf16", "precision.text_encoders": "bf16",
            "precision.mixed": "bf16", "datasets[0].resolution": 480, "adapter.rank": 16}


def test_a_clip_has_the_tokens_of_its_latent_frames() -> None:
    spec, size = estimate.released("wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers")
    one = estimate.tokens(size, spec, estimate.Setup(resolution=480))
    clip = estimate.tokens(size, spec, estimate.Setup(resolution=480, frames=81))
    text = spec.text_encoders[0].max_length
    assert clip - text == 21 * (one - text)
    flux, flux_size = estimate.released("flux", estimate.registry.spec("flux").sizes[0].name)
    assert estimate.tokens(flux_size, flux, estimate.Setup(frames=81)) == \
        estimate.tokens(flux_size, flux, estimate.Setup())


def test_check_names_the_setting_that_fits_each_card() -> None:
    """81 frames at 480 on the 14B: savers and block swap fit 24 GiB; on 12 GiB they are not
    enough and the advice is the most frames that fit (a 4N+1 count)."""
    spec, size = estimate.released("wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers")
    values = {**SETTINGS, estimate.CLIP_FRAMES: 81}
    line = clips.clip_line(values, size, spec)
    assert "81 frames, 21 latent frames, at 480x480" in line and "19,412 tokens" in line
    big = clips.card_advice(values, size, spec, 24)
    assert big.startswith("24 GiB with gradient checkpointing") and "block swap" in big
    small = clips.card_advice(values, size, spec, 12)
    assert small.startswith("12 GiB with at most 65 frames") and (65 - 1) % 4 == 0
