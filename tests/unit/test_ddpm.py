"""The DDPM (SDXL) objective, checked against diffusers' DDPMScheduler where it has a twin."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler

from difftune.errors import ConfigError
from difftune.train.objectives import ddpm
from difftune.train.losses import batch_mean, elementwise, per_sample


def sdxl_scheduler(zero_snr: bool) -> DDPMScheduler:
    """diffusers' own scheduler with SDXL's training schedule."""
    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        rescale_betas_zero_snr=zero_snr,
    )


def latents_noise_t(shape: tuple[int, ...] = (4, 4, 8, 8)) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.tensor([0, 1, 500, 999])[: shape[0]]
    return x0, noise, t


@pytest.mark.parametrize("zero_snr", [False, True])
def test_alphas_cumprod_match_diffusers(zero_snr: bool) -> None:
    ours = ddpm.DDPMSchedule.scaled_linear(zero_terminal_snr=zero_snr).alphas_cumprod
    theirs = sdxl_scheduler(zero_snr).alphas_cumprod.double()
    assert ours.shape == (1000,)
    # diffusers works in float32; ours in float64.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_zero_terminal_snr_ends() -> None:
    plain = ddpm.DDPMSchedule.scaled_linear()
    zero = ddpm.DDPMSchedule.scaled_linear(zero_terminal_snr=True)
    ends = torch.tensor([0, 999])
    assert ddpm.snr(zero, ends)[1].item() == 0.0
    assert zero.alphas_cumprod[-1].item() == 0.0
    assert zero.alphas_cumprod[0].item() == pytest.approx(plain.alphas_cumprod[0].item(), rel=1e-12)
    assert ddpm.snr(plain, ends)[1].item() > 0
    # Still a valid, strictly decreasing schedule; betas reproduce it.
    assert (zero.alphas_cumprod.diff() < 0).all()
    torch.testing.assert_close(torch.cumprod(1 - zero.betas, 0), zero.alphas_cumprod)


@pytest.mark.parametrize("zero_snr", [False, True])
def test_noisy_and_velocity_match_diffusers(zero_snr: bool) -> None:
    schedule = ddpm.DDPMSchedule.scaled_linear(zero_terminal_snr=zero_snr)
    scheduler = sdxl_scheduler(zero_snr)
    x0, noise, t = latents_noise_t()
    torch.testing.assert_close(
        ddpm.noisy(schedule, x0, noise, t), scheduler.add_noise(x0, noise, t), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        ddpm.target(schedule, x0, noise, t, "v_prediction"),
        scheduler.get_velocity(x0, noise, t),
        rtol=1e-5,
        atol=1e-5,
    )


def test_noisy_any_shape_and_dtype() -> None:
    schedule = ddpm.DDPMSchedule.scaled_linear()
    x0, noise, t = latents_noise_t((2, 16, 3, 4, 5))
    out = ddpm.noisy(schedule, x0.half(), noise.half(), t)
    assert out.shape == x0.shape and out.dtype == torch.float16
    abar = schedule.alphas_cumprod[t[1]].item()
    expected = abar**0.5 * x0[1] + (1 - abar) ** 0.5 * noise[1]
    torch.testing.assert_close(out[1].float(), expected, rtol=1e-2, atol=1e-2)


def test_epsilon_target_and_zero_snr_refusal() -> None:
    x0, noise, t = latents_noise_t()
    plain = ddpm.DDPMSchedule.scaled_linear()
    assert ddpm.target(plain, x0, noise, t, "epsilon") is noise
    zero = ddpm.DDPMSchedule.scaled_linear(zero_terminal_snr=True)
    with pytest.raises(ConfigError, match="v-prediction"):
        ddpm.target(zero, x0, noise, t, "epsilon")
    # At SNR 0 the velocity is -x_0 exactly.
    v = ddpm.target(zero, x0, noise, t, "v_prediction")
    torch.testing.assert_close(v[3], -x0[3])


def test_min_snr_weights_by_hand() -> None:
    schedule = ddpm.DDPMSchedule.scaled_linear()
    t = torch.tensor([0, 250, 500, 999])
    abar = schedule.alphas_cumprod[t]
    s = abar / (1 - abar)
    torch.testing.assert_close(ddpm.snr(schedule, t), s.float())
    gamma = 5.0
    eps = [min(x, gamma) / x for x in s.tolist()]
    v = [min(x, gamma) / (x + 1) for x in s.tolist()]
    torch.testing.assert_close(
        ddpm.min_snr_weights(schedule, t, gamma, "epsilon"), torch.tensor(eps)
    )
    torch.testing.assert_close(
        ddpm.min_snr_weights(schedule, t, gamma, "v_prediction"), torch.tensor(v)
    )
    # t = 0 has a huge SNR (~1175): clipped to gamma / SNR; t = 999 is below gamma: weight 1.
    assert s[0] > gamma and s[3] < gamma
    assert ddpm.min_snr_weights(schedule, t, gamma, "epsilon")[3].item() == pytest.approx(1.0)


def test_min_snr_weights_finite_at_zero_snr() -> None:
    zero = ddpm.DDPMSchedule.scaled_linear(zero_terminal_snr=True)
    t = torch.arange(1000)
    for prediction in ("epsilon", "v_prediction"):
        w = ddpm.min_snr_weights(zero, t, 5.0, prediction)
        assert torch.isfinite(w).all() and (w >= 0).all()
    assert ddpm.min_snr_weights(zero, t[-1:], 5.0, "epsilon").item() == 1.0
    assert ddpm.min_snr_weights(zero, t[-1:], 5.0, "v_prediction").item() == 0.0
    with pytest.raises(ConfigError):
        ddpm.min_snr_weights(zero, t, 0.0, "epsilon")


def test_offset_noise() -> None:
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(64, 4, 16, 16, generator=g)
    assert ddpm.offset_noise(noise, 0.0, g) is noise
    out = ddpm.offset_noise(noise, 0.1, torch.Generator().manual_seed(2))
    assert out.shape == noise.shape and out.dtype == noise.dtype
    offset = out - noise
    # Constant over the spatial dims, one value per (sample, channel).
    torch.testing.assert_close(offset, offset[:, :, :1, :1].expand_as(offset))
    per_channel = offset[:, :, 0, 0]
    assert abs(per_channel.mean().item()) < 0.03
    assert per_channel.std().item() == pytest.approx(0.1, rel=0.2)
    # Deterministic from the generator.
    again = ddpm.offset_noise(noise, 0.1, torch.Generator().manual_seed(2))
    assert torch.equal(out, again)


def test_sample_timesteps() -> None:
    t = ddpm.sample_timesteps(20000, torch.Generator().manual_seed(0))
    assert t.dtype == torch.long and t.shape == (20000,)
    assert t.min() >= 0 and t.max() <= 999
    assert abs(t.float().mean().item() - 499.5) < 10
    assert torch.equal(t, ddpm.sample_timesteps(20000, torch.Generator().manual_seed(0)))
    small = ddpm.sample_timesteps(500, torch.Generator().manual_seed(0), num=10)
    assert small.max() <= 9 and len(small.unique()) == 10


def weighted_mse(pred: torch.Tensor, tgt: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return batch_mean(per_sample(elementwise(pred, tgt)), weights)


def test_weighted_mse() -> None:
    pred = torch.zeros(3, 2, 2, dtype=torch.bfloat16)
    tgt = torch.stack([torch.full((2, 2), v) for v in (1.0, 2.0, 3.0)]).bfloat16()
    weights = torch.tensor([1.0, 0.5, 0.0])
    loss = weighted_mse(pred, tgt, weights)
    assert loss.dtype == torch.float32
    # Per-sample MSEs 1, 4, 9 weighted 1, 0.5, 0 -> (1 + 2 + 0) / 3.
    assert loss.item() == pytest.approx(1.0)
    ones = torch.ones(3)
    assert weighted_mse(pred, tgt, ones).item() == pytest.approx(14 / 3)
