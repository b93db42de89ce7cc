"""Timestep sampling, the flow-matching target and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from difftune.config import TrainConfig
from difftune.train.objectives import flow as objectives
from difftune.train.optimizers.schedule import lr_factor


def draw(method: str, tokens: int = 256, **kw: float) -> torch.Tensor:
    cfg = TrainConfig(timesteps=method, **kw)
    return objectives.sample_timesteps(cfg, 20000, tokens, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["uniform", "sigmoid", "shift", "flux_shift"])
def test_timesteps_in_open_interval(method: str) -> None:
    t = draw(method)
    assert t.min() > 0 and t.max() < 1


def test_methods_differ_as_documented() -> None:
    assert abs(draw("uniform").mean() - 0.5) < 0.01
    assert abs(draw("sigmoid").median() - 0.5) < 0.02
    # A shift of 3 moves the median of sigmoid(N(0,1)) from 0.5 to 3*0.5/(1+2*0.5) = 0.75.
    assert abs(draw("shift", shift=3.0).median() - 0.75) < 0.02
    # flux_shift grows with resolution: more tokens, noisier timesteps.
    assert draw("flux_shift", tokens=4096).median() > draw("flux_shift", tokens=256).median()
    assert abs(objectives.flux_mu(4096) - 1.15) < 1e-9


def test_noisy_and_target() -> None:
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([0.25, 1.0])
    noisy, target = objectives.noisy_and_target(x0, noise, t)
    assert torch.allclose(noisy[0], 0.75 * x0[0] + 0.25 * noise[0])
    assert torch.allclose(noisy[1], noise[1])
    assert torch.allclose(target, noise - x0)


def test_schedules_with_warmup() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, scheduler="cosine")
    assert lr_factor(0, cfg) < lr_factor(9, cfg) < 1.0
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    linear = TrainConfig(steps=100, scheduler="linear")
    assert lr_factor(50, linear) == pytest.approx(0.5)
    assert lr_factor(70, TrainConfig(steps=100)) == 1.0
