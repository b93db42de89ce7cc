"""train.ema: the averaged weights follow the documented formula, in place or in host memory,
enter the model only while asked, and resume from their state exactly."""

from __future__ import annotations

import pytest
import torch

from difftune.config.sections import EmaConfig
from difftune.train.ema import Ema, using


def _weights(k: int) -> torch.Tensor:
    """The weights after optimizer step k of a made-up run."""
    return torch.linspace(-1, 1, 6).reshape(2, 3) * (k + 1) + k


def _expected(steps: int, cfg: EmaConfig) -> torch.Tensor:
    """The formula of the docs: the first update takes the weights; the j-th after it
    (j >= 2) uses d = min(decay, j / (9 + j)) (warmup) or d = decay."""
    ema, j = _weights(0).double(), 0
    for k in range(1, steps + 1):
        if k % cfg.every_n_steps:
            continue
        j += 1
        d = 0.0 if j == 1 else min(cfg.decay, j / (9 + j)) if cfg.warmup else cfg.decay
        ema = d * ema + (1 - d) * _weights(k).double()
    return ema


@pytest.mark.parametrize("cpu, warmup, every", [(False, True, 1), (True, False, 2)])
def test_ema_follows_the_formula(cpu: bool, warmup: bool, every: int) -> None:
    cfg = EmaConfig(enabled=True, decay=0.9, cpu=cpu, warmup=warmup, every_n_steps=every)
    p = torch.nn.Parameter(_weights(0))
    ema = Ema([p], {id(p): "w"}, cfg)
    for k in range(1, 13):
        with torch.no_grad():
            p.copy_(_weights(k))
        ema.update(k)
    got = ema.state_dict()["tensors"]["w"].clone()
    assert torch.allclose(got.double(), _expected(12, cfg), atol=1e-5, rtol=1e-6)
    # The average enters the model only inside `using(..., purpose)`, and leaves it exactly.
    before = p.detach().clone()
    with using(ema, "samples"):
        assert torch.equal(p, before)  # use_for = ["saves"] only
    with using(ema, "saves"):
        assert torch.equal(p.detach(), got)
    assert torch.equal(p.detach(), before)


def test_ema_state_resumes_exactly() -> None:
    cfg = EmaConfig(enabled=True, decay=0.99)
    p, q = torch.nn.Parameter(_weights(0)), torch.nn.Parameter(_weights(0))
    a, b = Ema([p], {id(p): "w"}, cfg), Ema([q], {id(q): "w"}, cfg)
    for k in range(1, 5):
        with torch.no_grad():
            p.copy_(_weights(k))
        a.update(k)
    saved = a.state_dict()
    b.load_state_dict({"plain": dict(saved["plain"]),
                       "tensors": {k: v.clone() for k, v in saved["tensors"].items()}})
    for k in range(5, 8):
        with torch.no_grad():
            p.copy_(_weights(k))
            q.copy_(_weights(k))
        a.update(k)
        b.update(k)
    assert torch.equal(a.state_dict()["tensors"]["w"], b.state_dict()["tensors"]["w"])
