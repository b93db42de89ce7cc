"""DDPM objective (SDXL and SD1.x/2.x): noise schedule, noising, targets and loss weights.

Convention (as diffusers' DDPMScheduler): discrete timesteps t in [0, num) with 0 the least
noisy; x_t = sqrt(abar_t) * x_0 + sqrt(1 - abar_t) * noise, where abar_t ("alphas_cumprod") is
the running product of 1 - beta. The model predicts either the noise ("epsilon") or the velocity
v = sqrt(abar_t) * noise - sqrt(1 - abar_t) * x_0 ("v_prediction").

This module is self-contained and pure: every function takes the schedule and tensors it needs
and draws randomness only from the generator it is given, so a resumed run replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from difftune.errors import ConfigError
from difftune.train.objectives.base import Draw

Prediction = Literal["epsilon", "v_prediction"]

# SDXL's training schedule (its scheduler_config.json): "scaled_linear" from 0.00085 to 0.012.
SDXL_BETA_START, SDXL_BETA_END, SDXL_TIMESTEPS = 0.00085, 0.012, 1000


@dataclass(frozen=True, eq=False)
class DDPMSchedule:
    """A discrete DDPM noise schedule, held as its cumulative alphas (abar_t), float64 on the CPU.

    float64 because abar_t spans several orders of magnitude (0.999 down to ~0.005, or exactly 0
    with zero terminal SNR) and 1 - abar_t near t = 0 loses digits in float32; values are cast to
    the latents' dtype only when used. `eq=False`: tensors have no single truth value, so two
    schedules compare by identity.

    With `zero_terminal_snr` the last timestep is pure noise (abar = 0, SNR = 0). Then the model
    must be trained with v-prediction: at SNR 0 the noisy input *is* the noise, so an epsilon
    target is trivially x_T itself and carries no information about the image, and recovering
    x_0 = (x_t - sqrt(1 - abar) * eps) / sqrt(abar) divides by zero. v = -x_0 at that step, which
    is well defined and is exactly what the sampler needs to start from pure noise.
    """

    alphas_cumprod: torch.Tensor
    zero_terminal_snr: bool = False

    @classmethod
    def scaled_linear(
        cls,
        num: int = SDXL_TIMESTEPS,
        beta_start: float = SDXL_BETA_START,
        beta_end: float = SDXL_BETA_END,
        zero_terminal_snr: bool = False,
    ) -> DDPMSchedule:
        """SDXL's "scaled_linear" schedule: betas linear in sqrt-space, squared.

        `zero_terminal_snr` applies the rescale of Lin et al. 2023 ("Common Diffusion Noise
        Schedules and Sample Steps are Flawed", Algorithm 1); see the class docstring for why it
        requires v-prediction.
        """
        if num < 2 or not 0 < beta_start < beta_end < 1:
            raise ConfigError(
                f"DDPM schedule needs num >= 2 and 0 < beta_start < beta_end < 1, got num={num}, "
                f"beta_start={beta_start}, beta_end={beta_end}; use SDXL's 1000, 0.00085, 0.012"
            )
        # "scaled_linear": interpolate sqrt(beta) linearly, then square.
        betas = torch.linspace(beta_start**0.5, beta_end**0.5, num, dtype=torch.float64) ** 2
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        if zero_terminal_snr:
            alphas_cumprod = _rescale_zero_terminal_snr(alphas_cumprod)
        return cls(alphas_cumprod=alphas_cumprod, zero_terminal_snr=zero_terminal_snr)

    @property
    def num_train_timesteps(self) -> int:
        """How many discrete timesteps the schedule has (1000 for SDXL)."""
        return self.alphas_cumprod.numel()

    @property
    def betas(self) -> torch.Tensor:
        """The per-step betas that produce `alphas_cumprod` (for schedulers that want them)."""
        abar = self.alphas_cumprod
        alphas = torch.cat([abar[:1], abar[1:] / abar[:-1]])  # undo the cumulative product
        return 1.0 - alphas


def _rescale_zero_terminal_snr(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Shift and scale sqrt(abar) so its last value is 0 and its first is unchanged.

    An affine map of sqrt(abar): subtracting the last value makes the final step pure noise
    (SNR 0); scaling by s0 / (s0 - sT) restores the first value, so the least noisy step is as
    before. Everything in between stays monotone. This equals rescaling the betas, since the
    betas are recovered from abar by undoing the cumulative product.
    """
    root = alphas_cumprod.sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * (first / (first - last))
    return root**2


def check_prediction(schedule: DDPMSchedule, prediction: Prediction) -> None:
    """Refuse epsilon prediction on a zero-terminal-SNR schedule (see DDPMSchedule for why)."""
    if prediction not in ("epsilon", "v_prediction"):
        raise ConfigError(f"prediction must be 'epsilon' or 'v_prediction', got {prediction!r}")
    if schedule.zero_terminal_snr and prediction == "epsilon":
        raise ConfigError(
            "zero terminal SNR needs v-prediction: at SNR 0 the noisy input is pure noise, so an "
            "epsilon target is undefined as a prediction of the image; set the prediction to "
            "'v_prediction' or turn zero terminal SNR off"
        )


def sample_timesteps(
    batch: int, generator: torch.Generator, num: int = SDXL_TIMESTEPS
) -> torch.Tensor:
    """Uniform integer timesteps in [0, num), one per sample, drawn from `generator` on its device."""
    return torch.randint(0, num, (batch,), generator=generator, device=generator.device)


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape a (batch,) tensor to (batch, 1, ..., 1) so it broadcasts over `like`'s latent dims."""
    return values.view(-1, *([1] * (like.dim() - 1)))


def _abar(schedule: DDPMSchedule, t: torch.Tensor) -> torch.Tensor:
    """abar_t for integer timesteps t, in float64 on t's device."""
    return schedule.alphas_cumprod.to(t.device)[t.long()]


def _coefficients(
    schedule: DDPMSchedule, t: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt(abar_t) and sqrt(1 - abar_t), shaped and typed to broadcast over `like`."""
    abar = _abar(schedule, t.to(like.device))
    # Square roots in float64, cast once to the latents' dtype.
    signal = _per_sample(abar.sqrt(), like).to(like.dtype)
    sigma = _per_sample((1.0 - abar).sqrt(), like).to(like.dtype)
    return signal, sigma


def noisy(
    schedule: DDPMSchedule, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise, for any latent shape (batch first)."""
    signal, sigma = _coefficients(schedule, t, x0)
    return signal * x0 + sigma * noise


def target(
    schedule: DDPMSchedule,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    prediction: Prediction,
) -> torch.Tensor:
    """What the model should output at x_t: the noise, or v = sqrt(abar) noise - sqrt(1-abar) x_0.

    Raises ConfigError for epsilon on a zero-terminal-SNR schedule (see `check_prediction`).
    """
    check_prediction(schedule, prediction)
    if prediction == "epsilon":
        return noise
    signal, sigma = _coefficients(schedule, t, x0)
    return signal * noise - sigma * x0


def offset_noise(noise: torch.Tensor, strength: float, generator: torch.Generator) -> torch.Tensor:
    """Add strength * N(0, 1) per (sample, channel), constant over the spatial dims.

    The "noise offset" trick: plain Gaussian noise almost never shifts a channel's mean, so the
    model never learns to change an image's overall brightness; a per-channel offset teaches it.
    The offsets are drawn on the generator's device and then moved to the noise. Strength 0
    returns `noise` itself and draws nothing from the generator.
    """
    if strength == 0:
        return noise
    if noise.dim() < 2:
        raise ValueError(f"noise must be (batch, channels, ...), got shape {tuple(noise.shape)}")
    batch, channels = noise.shape[:2]
    offset = torch.randn(batch, channels, generator=generator, device=generator.device)
    offset = offset.to(device=noise.device, dtype=noise.dtype)
    return noise + strength * offset.view(batch, channels, *([1] * (noise.dim() - 2)))


def snr(schedule: DDPMSchedule, t: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio abar_t / (1 - abar_t) per timestep, float32.

    Finite everywhere: 1 - abar_t >= 1 - abar_0 = beta_0 > 0, and it is exactly 0 at the last
    step of a zero-terminal-SNR schedule.
    """
    abar = _abar(schedule, t)
    return (abar / (1.0 - abar)).float()


def min_snr_weights(
    schedule: DDPMSchedule, t: torch.Tensor, gamma: float, prediction: Prediction
) -> torch.Tensor:
    """Min-SNR-gamma loss weights per sample (Hang et al. 2023), float32.

    Epsilon: min(SNR, gamma) / SNR, written as gamma / max(SNR, gamma) -- the same value for
    SNR > 0, and at SNR 0 it gives 1, the limit as SNR -> 0 (low-SNR steps are never
    down-weighted), instead of 0/0. v-prediction: min(SNR, gamma) / (SNR + 1), which is finite by
    construction and 0 at SNR 0. That 0 is the continuous limit, not a guard: Min-SNR weights
    the equivalent x_0 loss by min(SNR, gamma), which vanishes as SNR -> 0, and the steps just
    before the last already carry weights of order SNR (~1e-5 with zero terminal SNR). Train
    without Min-SNR if the pure-noise step itself must be weighted.
    """
    if gamma <= 0:
        raise ConfigError(f"min-SNR gamma must be > 0 (5 is usual), got {gamma}")
    ratio = snr(schedule, t)
    if prediction == "epsilon":
        return gamma / ratio.clamp_min(gamma)
    if prediction == "v_prediction":
        return ratio.clamp_max(gamma) / (ratio + 1.0)
    raise ConfigError(f"prediction must be 'epsilon' or 'v_prediction', got {prediction!r}")


class DDPMObjective:
    """Discrete DDPM training (SDXL): integer t, epsilon or v target, optional noise offset
    and Min-SNR-gamma weighting. Satisfies `difftune.train.objectives.base.Objective`."""

    def __init__(self, schedule: DDPMSchedule, prediction: Prediction, noise_offset: float = 0.0,
                 min_snr_gamma: float | None = None) -> None:
        check_prediction(schedule, prediction)
        self.schedule, self.prediction = schedule, prediction
        self.noise_offset, self.min_snr_gamma = noise_offset, min_snr_gamma
        self.window: tuple[float, float] | None = None  # none of its families has experts

    def draw(self, latents: torch.Tensor, generator: torch.Generator) -> Draw:
        """Noise (with offset), then t uniform over the training steps (all from `generator`)."""
        noise = torch.randn(latents.shape, generator=generator)
        noise = offset_noise(noise, self.noise_offset, generator).to(latents.device)
        t = sample_timesteps(latents.shape[0], generator, self.schedule.num_train_timesteps)
        t = t.to(latents.device)
        weights = None
        if self.min_snr_gamma is not None:
            weights = min_snr_weights(self.schedule, t, self.min_snr_gamma, self.prediction)
        return Draw(t, noisy(self.schedule, latents, noise, t),
                    target(self.schedule, latents, noise, t, self.prediction), weights)

    def draw_at(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> Draw:
        """The draw at given timesteps `t` with given `noise` (no offset drawn: validation)."""
        noise, t = noise.to(latents.device), t.to(latents.device)
        weights = None
        if self.min_snr_gamma is not None:
            weights = min_snr_weights(self.schedule, t, self.min_snr_gamma, self.prediction)
        return Draw(t, noisy(self.schedule, latents, noise, t),
                    target(self.schedule, latents, noise, t, self.prediction), weights)

    def fixed_timesteps(self, n: int) -> torch.Tensor:
        """`n` integer timesteps spread evenly over [0, num), at the centres of n intervals."""
        num = self.schedule.num_train_timesteps
        return ((torch.arange(n, dtype=torch.float64) + 0.5) * num / n).long().clamp(0, num - 1)

    def noise_level(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(t / num from clean 0 to pure noise 1, noise-to-signal ratio sqrt((1 - abar) / abar))."""
        abar = _abar(self.schedule, t)
        ratio = ((1.0 - abar) / abar.clamp_min(1e-12)).sqrt().float()
        return t.float() / self.schedule.num_train_timesteps, ratio
