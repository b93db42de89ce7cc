"""Flow-matching objective: timestep sampling, noising and the loss.

Convention (as FLUX.1 and SD3): x_t = (1 - t) * x_0 + t * noise with t in [0, 1] (1 = pure
noise), and the model predicts the velocity noise - x_0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from difftune.config import TrainConfig
from difftune.train.objectives.base import Draw


# FLUX.1's resolution-dependent shift: mu grows linearly with the image token count from
# base_shift at 256 tokens to max_shift at 4096 tokens (the FLUX.1-dev scheduler settings).
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT = 256, 4096, 0.5, 1.15


@dataclass(frozen=True)
class DynamicShift:
    """A resolution-dependent shift (`train.timesteps = "flux_shift"`): mu grows linearly with
    the image token count from `base_shift` at `base_seq` tokens to `max_shift` at `max_seq`,
    and t is shifted by exp(mu). FLUX.1's constants by default; a family whose pipeline uses
    other ones (its scheduler config's) passes them to `FlowMatching`."""

    base_seq: int = BASE_SEQ
    max_seq: int = MAX_SEQ
    base_shift: float = BASE_SHIFT
    max_shift: float = MAX_SHIFT

    def mu(self, image_tokens: int) -> float:
        """mu for an image of `image_tokens` packed latent tokens."""
        slope = (self.max_shift - self.base_shift) / (self.max_seq - self.base_seq)
        return self.base_shift + slope * (image_tokens - self.base_seq)


FLUX_SHIFT = DynamicShift()


def scheduler_shift(config: Any) -> DynamicShift:
    """The resolution-dependent shift a dynamic-shifting scheduler config declares (its
    `base_image_seq_len`, `max_image_seq_len`, `base_shift`, `max_shift`), the fixed
    `flow_shift` of a scheduler over flow sigmas (UniPC's, as Wan's pipeline samples with:
    the same shift at every size), FLUX.1's for a scheduler without either, so `flux_shift`
    trains as the family's pipeline shifts."""
    if config.get("use_flow_sigmas", False) and config.get("flow_shift") is not None:
        mu = math.log(float(config["flow_shift"]))
        return DynamicShift(BASE_SEQ, MAX_SEQ, mu, mu)
    if not config.get("use_dynamic_shifting", False):
        return FLUX_SHIFT
    return DynamicShift(int(config.get("base_image_seq_len", BASE_SEQ)),
                        int(config.get("max_image_seq_len", MAX_SEQ)),
                        float(config.get("base_shift", BASE_SHIFT)),
                        float(config.get("max_shift", MAX_SHIFT)))


def flux_mu(image_tokens: int) -> float:
    """The flux_shift mu for an image of `image_tokens` packed latent tokens (FLUX.1's)."""
    return FLUX_SHIFT.mu(image_tokens)


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Shift t towards noise: shift * t / (1 + (shift - 1) * t) (the SD3 shift)."""
    return shift * t / (1 + (shift - 1) * t)


def _shift_of(cfg: TrainConfig, image_tokens: int, dynamic: DynamicShift) -> float:
    """The shift the configured method applies after its logit-normal draw (1: none)."""
    if cfg.timesteps == "shift":
        return cfg.shift
    return math.exp(dynamic.mu(image_tokens)) if cfg.timesteps == "flux_shift" else 1.0


def _quantile(cfg: TrainConfig, u: torch.Tensor, shift: float) -> torch.Tensor:
    """The t at probability `u` of the configured distribution (its inverse CDF)."""
    if cfg.timesteps == "uniform":
        return u
    t = torch.sigmoid(torch.special.ndtri(u) * cfg.sigmoid_std + cfg.sigmoid_mean)
    return shift_time(t, shift)


def _cdf(cfg: TrainConfig, t: float, shift: float) -> float:
    """The probability that the configured distribution draws below `t` (its CDF)."""
    if cfg.timesteps == "uniform" or t <= 0.0 or t >= 1.0:
        return min(max(t, 0.0), 1.0)
    x = t / (shift - (shift - 1) * t)  # the shift undone
    z = (math.log(x / (1 - x)) - cfg.sigmoid_mean) / cfg.sigmoid_std
    return 0.5 * math.erfc(-z / math.sqrt(2))


def window_timesteps(cfg: TrainConfig, batch: int, image_tokens: int,
                     generator: torch.Generator, window: tuple[float, float],
                     dynamic: DynamicShift = FLUX_SHIFT) -> torch.Tensor:
    """Draw t in [low, high) (`window`; high 1 includes it, less the ends' margin) from the
    configured distribution restricted to it: a uniform draw between the CDF's values at
    the window's ends, through the inverse CDF, so each expert of a two-expert model trains
    its side of the boundary with the same density the whole schedule has there."""
    low, high = window
    shift = _shift_of(cfg, image_tokens, dynamic)
    a, b = _cdf(cfg, low, shift), _cdf(cfg, high, shift)
    u = a + torch.rand(batch, generator=generator, dtype=torch.float64) * (b - a)
    t = _quantile(cfg, u.clamp(1e-12, 1 - 1e-12), shift).float()
    top = (1 - 1e-5) if high >= 1.0 else high - 1e-5  # below the boundary, as the pipeline
    return t.clamp(max(low, 1e-5), top)


def sample_timesteps(
    cfg: TrainConfig, batch: int, image_tokens: int, generator: torch.Generator,
    dynamic: DynamicShift = FLUX_SHIFT,
) -> torch.Tensor:
    """Draw a batch of t in (0, 1) by the configured method (on the CPU, from `generator`);
    `dynamic` gives flux_shift's constants."""
    if cfg.timesteps == "uniform":
        t = torch.rand(batch, generator=generator)
    else:
        normal = torch.randn(batch, generator=generator) * cfg.sigmoid_std + cfg.sigmoid_mean
        t = torch.sigmoid(normal)
        if cfg.timesteps == "shift":
            t = shift_time(t, cfg.shift)
        elif cfg.timesteps == "flux_shift":
            t = shift_time(t, math.exp(dynamic.mu(image_tokens)))
    # Keep away from the exact ends, where x_t carries no signal or no noise.
    return t.clamp(1e-5, 1 - 1e-5)


def noisy_and_target(
    latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t and the velocity target for latents x_0, noise and times t (one per sample)."""
    tt = t.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - tt) * latents + tt * noise, noise - latents


class FlowMatching:
    """Rectified flow (FLUX.1, SD3): t in (0, 1), velocity target, no weighting; `dynamic` is
    the resolution-dependent shift of `train.timesteps = "flux_shift"` (FLUX.1's by default)."""

    def __init__(self, cfg: TrainConfig, dynamic: DynamicShift = FLUX_SHIFT) -> None:
        self.cfg = cfg
        self.dynamic = dynamic
        # The times [low, high) the next draws keep to (a two-expert model's active expert's
        # side of the boundary, set before each step by `train/experts.py`); None: all.
        self.window: tuple[float, float] | None = None

    def draw(self, latents: torch.Tensor, generator: torch.Generator) -> Draw:
        """Noise from `generator` (CPU, then moved), then t drawn by `train.timesteps`."""
        noise = torch.randn(latents.shape, generator=generator).to(latents.device)
        # Image tokens of 2x2 latent patches, as the flow transformers see them (flux_shift);
        # a clip's (B, C, f, h, w) latents have f frames of them.
        tokens = math.prod(latents.shape[2:]) // 4
        if self.window is None:
            t = sample_timesteps(self.cfg, latents.shape[0], tokens, generator, self.dynamic)
        else:
            t = window_timesteps(self.cfg, latents.shape[0], tokens, generator, self.window,
                                 self.dynamic)
        t = t.to(latents.device)
        noisy, target = noisy_and_target(latents, noise, t)
        return Draw(t, noisy, target)

    def draw_at(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> Draw:
        """The draw at given times `t` with given `noise` (validation: nothing is drawn)."""
        noisy, target = noisy_and_target(latents, noise.to(latents.device), t.to(latents.device))
        return Draw(t.to(latents.device), noisy, target)

    def fixed_timesteps(self, n: int) -> torch.Tensor:
        """`n` times spread evenly over (0, 1), at the centres of n equal intervals."""
        return (torch.arange(n, dtype=torch.float32) + 0.5) / n

    def noise_level(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position of t from clean 0 to pure noise 1, noise-to-signal ratio t / (1 - t))."""
        t = t.float()
        return t, t / (1 - t).clamp_min(1e-5)
