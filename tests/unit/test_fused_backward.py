"""FusedAdamW: stepping inside backward gives AdamW's numbers, with no gradient left behind."""

from __future__ import annotations

import torch

from difftune.memory.fused import FusedAdamW

SETTINGS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def build() -> torch.nn.Sequential:
    """A small seeded model: a frozen first layer, two trainable ones (one in its own group)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)
    return model


def groups(model: torch.nn.Sequential) -> list[dict]:
    """Two parameter groups with different weight decay (the lookup must pick the right one)."""
    return [{"params": list(model[2].parameters())},
            {"params": list(model[4].parameters()), "weight_decay": 0.0}]


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """An LR that changes every step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch i: inputs and targets."""
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler, steps: range) -> list[bool]:
    """Plain training steps; returns, per step, whether every grad was None after backward."""
    freed = []
    for i in steps:
        x, y = data(i)
        torch.nn.functional.mse_loss(model(x), y).backward()
        freed.append(all(p.grad is None for p in model.parameters()))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return freed


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Bitwise equal parameters."""
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_matches_adamw_bitwise_and_frees_grads() -> None:
    plain, fused = build(), build()
    ref = torch.optim.AdamW(groups(plain), **SETTINGS)
    opt = FusedAdamW(groups(fused), **SETTINGS)
    opt.attach()
    opt.attach()  # idempotent: one hook per parameter, so one step per backward
    assert len(opt._handles) == 4
    freed = train(fused, opt, schedule(opt), range(3))
    train(plain, ref, schedule(ref), range(3))
    assert freed == [True, True, True]
    assert same(plain, fused)
    assert not same(build(), fused)  # it did train
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]


def test_state_dict_moves_to_plain_adamw() -> None:
    plain, fused = build(), build()
    ref = torch.optim.AdamW(groups(plain), **SETTINGS)
    opt = FusedAdamW(groups(fused), **SETTINGS)
    opt.attach()
    train(fused, opt, schedule(opt), range(2))
    train(plain, ref, schedule(ref), range(2))
    state = opt.state_dict()
    assert state["state"][0]["step"].item() == 2.0
    resumed = build()
    resumed.load_state_dict(fused.state_dict())
    other = torch.optim.AdamW(groups(resumed), **SETTINGS)
    other.load_state_dict(state)
    for model, o in ((plain, ref), (resumed, other)):
        x, y = data(7)
        torch.nn.functional.mse_loss(model(x), y).backward()
        o.step()
    assert same(plain, resumed)


def test_detach_restores_adamw() -> None:
    plain, fused = build(), build()
    ref = torch.optim.AdamW(groups(plain), **SETTINGS)
    opt = FusedAdamW(groups(fused), **SETTINGS)
    sched = schedule(opt)
    opt.attach()
    train(fused, opt, sched, range(1))
    opt.detach()
    assert not opt.attached
    freed = train(fused, opt, sched, range(1, 3))
    assert freed == [False, False]  # gradients are kept again, and step() applies them
    train(plain, ref, schedule(ref), range(3))
    assert same(plain, fused)


def test_step_with_closure_returns_its_loss() -> None:
    model = build()
    opt = FusedAdamW(groups(model), **SETTINGS)
    opt.attach()
    x, y = data(0)

    def closure() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = [p.clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert opt.step() is None
    opt.zero_grad()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert changed == [False, False, True, True, True, True]


def test_lora_transformer_matches_adamw() -> None:
    from tests.unit.test_blockswap import batch, build as build_flux

    from difftune.adapters.lora import lora_parameters

    models = [build_flux(), build_flux()]
    data_ = batch()
    inputs = {k: v for k, v in data_.items() if k != "target"}
    opts = [torch.optim.AdamW(lora_parameters(models[0]), **SETTINGS),
            FusedAdamW(lora_parameters(models[1]), **SETTINGS)]
    opts[1].attach()
    for _ in range(3):
        for model, opt in zip(models, opts):
            out = model(**inputs, return_dict=False)[0]
            torch.nn.functional.mse_loss(out, data_["target"]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    pairs = zip(lora_parameters(models[0]), lora_parameters(models[1]), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(p.grad is None for p in lora_parameters(models[1]))



def test_clip_limits_each_gradient_to_its_own_norm() -> None:
    plain, fused = build(), build()
    opt_p = torch.optim.AdamW(groups(plain), **SETTINGS)
    opt_f = FusedAdamW(groups(fused), **SETTINGS)
    opt_f.clip = 0.01  # small enough to clip every tensor
    opt_f.attach()
    for i in range(3):
        x, y = data(i)
        torch.nn.functional.mse_loss(plain(x), y).backward()
        for p in plain.parameters():  # what the fused optimizer must do, tensor by tensor
            if p.grad is not None:
                torch.nn.utils.clip_grad_norm_([p], 0.01)
        opt_p.step()
        opt_p.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(fused(x), y).backward()
    assert same(plain, fused)
