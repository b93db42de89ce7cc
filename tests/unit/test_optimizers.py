"""The optimizer registry: every CPU optimizer's state survives the checkpoint's round trip
(JSON groups, safetensors tensors) so a resumed optimizer steps bit for bit like the
uninterrupted one; the memory estimate equals the state the library really keeps; options are
checked at config load; schedule-free's evaluation weights come and go exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from difftune.config import TrainConfig
from difftune.train.optimizers.build import make_optimizer
from difftune.train.optimizers.modes import eval_weights, step_lr
from difftune.train.optimizers.schedule import lr_factor
from difftune.train.optimizers.specs import OPTIMIZERS, parse_args, state_bytes, warnings
from difftune.train.state import load_optimizer, optimizer_groups, optimizer_tensors

# (optimizer, optimizer_args) for every optimizer that runs on the CPU, and a mode or two.
CASES = [("adamw", {}), ("prodigy", {}), ("prodigy", {"slice_p": 2, "safeguard_warmup": True}),
         ("adafactor", {}), ("adafactor", {"relative_step": True, "warmup_init": True,
                                           "scale_parameter": True, "beta1": 0.9}),
         ("schedulefree_adamw", {}), ("came", {}), ("lion", {})]
SHAPES = [(4, 6), (6, 4), (5,), (3, 2, 4)]


def _params(seed: int = 0, zero_up: bool = False) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    if zero_up:  # a LoRA up matrix starts at zero
        out[1].data.zero_()
    return out


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _groups(name: str, params: list[torch.nn.Parameter]) -> list[dict]:
    """Two groups, the second at its own lr (prodigy takes one lr for all)."""
    second = {} if OPTIMIZERS[name].single_lr else {"lr": 3e-3}
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def _cfg(name: str, args: dict) -> TrainConfig:
    extra = {} if name == "adafactor" and args.get("relative_step") else {"lr": 1e-2}
    return TrainConfig(optimizer=name, optimizer_args=args, weight_decay=0.01, **extra)


@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}-{len(a)}" for n, a in CASES])
def test_state_round_trip_resumes_bit_for_bit(tmp_path: Path, name: str, args: dict) -> None:
    cfg = _cfg(name, args)
    a_params = _params(zero_up=True)
    a = make_optimizer(_groups(name, a_params), cfg)
    names = {id(p): f"w{i}" for i, p in enumerate(a_params)}
    _train(a, a_params, range(3))
    with eval_weights(a, a_params):  # a sample or LoRA save between steps changes nothing
        pass
    # The checkpoint's path: groups through JSON, tensors through safetensors.
    groups = json.loads(json.dumps(optimizer_groups(a, names)))
    save_file(optimizer_tensors(a, names), tmp_path / "opt.safetensors")
    b_params = _params(seed=1)
    with torch.no_grad():
        for p, q in zip(b_params, a_params):
            p.copy_(q)
    b = make_optimizer(_groups(name, b_params), cfg)
    load_optimizer(b, {id(p): f"w{i}" for i, p in enumerate(b_params)}, groups,
                   load_file(tmp_path / "opt.safetensors"))
    _train(a, a_params, range(3, 6))
    _train(b, b_params, range(3, 6))
    assert all(torch.equal(p, q) for p, q in zip(a_params, b_params))
    for p, q in zip(a_params, b_params):
        sa, sb = a.state[p], b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            same = (torch.equal(sa[key], sb[key]) if torch.is_tensor(sa[key])
                    else sa[key] == sb[key])
            assert same, key
    assert [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b.param_groups]


@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}-{len(a)}" for n, a in CASES])
def test_memory_estimate_is_the_state_the_library_keeps(name: str, args: dict) -> None:
    params = _params()
    opt = make_optimizer(params, _cfg(name, args))
    _train(opt, params, range(1))
    real = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    assert real == state_bytes(name, parse_args(name, args), SHAPES)


def test_prodigy_estimate_bounds_a_zero_started_weight() -> None:
    params = _params(zero_up=True)  # p0 of an all-zero weight is a scalar: the estimate bounds it
    opt = make_optimizer(params, _cfg("prodigy", {}))
    _train(opt, params, range(1))
    real = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    estimate = state_bytes("prodigy", parse_args("prodigy", {}), SHAPES)
    assert real == estimate - 4 * 24  # the (6, 4) weight's p0


def test_eight_bit_estimates_follow_bitsandbytes_layout() -> None:
    args = parse_args("adamw8bit", {})
    small, big = [(64, 32)], [(4096, 4)]  # below and above min_8bit_size
    assert state_bytes("adamw8bit", args, small) == 8 * 64 * 32  # 32-bit state
    assert state_bytes("adamw8bit", args, big) == 2 * (16384 + 64 * 4 + 256 * 4)
    assert state_bytes("lion8bit", args, big) == 16384 + 64 * 4 + 256 * 4


def test_schedule_free_eval_weights_are_its_average_and_go_back_exactly() -> None:
    params = _params()
    opt = make_optimizer(params, _cfg("schedulefree_adamw", {}))
    _train(opt, params, range(3))
    y = [p.detach().clone() for p in params]
    beta1 = opt.param_groups[0]["betas"][0]
    with eval_weights(opt, params):
        with eval_weights(opt, params):  # re-entrant: one switch only
            x = [p.detach().clone() for p in params]
    for p, yy, xx in zip(params, y, x):
        z = opt.state[p]["z"]
        assert torch.allclose(xx, yy.lerp(z, 1 - 1 / beta1)) and not torch.allclose(xx, yy)
        assert torch.equal(p, yy)  # the training weights, bit for bit
    assert opt.param_groups[0]["train_mode"]
    _train(opt, params, range(3, 4))  # still steps (it refuses in eval mode)


def test_schedule_rules() -> None:
    free = TrainConfig(optimizer="schedulefree_adamw", warmup_steps=3, steps=10)
    assert [lr_factor(s, free) for s in range(5)] == [1.0] * 5
    opt = make_optimizer(_params(), free)
    assert opt.param_groups[0]["warmup_steps"] == 3  # its own warm-up instead
    prodigy = TrainConfig(optimizer="prodigy", lr=1.0, scheduler="cosine", steps=10)
    assert lr_factor(5, prodigy) == pytest.approx(0.5)
    relative = TrainConfig(optimizer="adafactor", optimizer_args={"relative_step": True})
    params = _params()
    opt = make_optimizer(params, relative)
    _train(opt, params, range(1))
    assert lr_factor(0, relative) == 1.0 and step_lr(opt) == pytest.approx(1e-2)
    lion = make_optimizer(_params(), TrainConfig(optimizer="lion"))
    assert lion.param_groups[0]["betas"] == (0.9, 0.99)  # Lion's own, train.betas unset
    lion = make_optimizer(_params(), TrainConfig(optimizer="lion", betas=(0.8, 0.9)))
    assert lion.param_groups[0]["betas"] == (0.8, 0.9)


@pytest.mark.parametrize(("fields", "message"), [
    ({"optimizer": "prodigy", "optimizer_args": {"dcoef": 1}},
     'train.optimizer_args.dcoef: prodigy has no option "dcoef"; its options: d_coef'),
    ({"optimizer": "adamw", "optimizer_args": {"d_coef": 1}}, "its options: none"),
    ({"optimizer": "came", "optimizer_args": {"clip_threshold": "high"}},
     "train.optimizer_args.clip_threshold: Input should be a valid number"),
    ({"optimizer": "prodigy", "optimizer_args": {"d_coef": True}},
     "train.optimizer_args: d_coef: write a number, not true/false"),
    ({"optimizer": "prodigy", "optimizer_args": {"use_bias_correction": 1}},
     "use_bias_correction: write true or false"),
    ({"optimizer": "came", "optimizer_args": {"betas": [0.9, 0.999, 1.5]}},
     "train.optimizer_args.betas.2: Input should be less than 1"),
    ({"optimizer": "adafactor", "optimizer_args": {"warmup_init": True}},
     "warmup_init needs relative_step = true"),
    ({"optimizer": "adafactor", "lr": 1e-3, "optimizer_args": {"relative_step": True}},
     "train.lr: adafactor"),
    ({"optimizer": "schedulefree_adamw", "scheduler": "cosine"},
     'train.scheduler = "cosine": schedulefree_adamw replaces'),
    ({"optimizer": "lion", "fused_backward": True}, "fused_backward works with"),
])
def test_bad_options_refused_at_load(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        TrainConfig(**fields)


def test_every_optimizer_has_a_builder_and_a_library() -> None:
    from difftune.train.optimizers.build import BUILDERS

    assert set(BUILDERS) == set(OPTIMIZERS)
    assert {s.name for s in OPTIMIZERS.values() if s.cuda_only} == {"adamw8bit", "lion8bit"}


def test_fields_an_optimizer_ignores_are_warned() -> None:
    assert warnings(TrainConfig(optimizer="adamw", betas=(0.8, 0.9))) == []
    came = warnings(TrainConfig(optimizer="came", betas=(0.8, 0.9), weight_decay=0.1))
    assert came == ['train.betas is ignored by optimizer = "came" (it does not take it; set '
                    'its own in train.optimizer_args)']
    assert warnings(TrainConfig(optimizer="lion", eps=1e-6)) == [
        'train.eps is ignored by optimizer = "lion" (it does not take it)']
    assert "far below the lr prodigy's library recommends (1.0)" in \
        warnings(TrainConfig(optimizer="prodigy", lr=1e-4))[0]
    assert warnings(TrainConfig(optimizer="prodigy", lr=1.0)) == []


def test_damaged_plain_state_is_refused() -> None:
    from difftune.errors import CheckpointError

    params = _params()
    opt = make_optimizer(params, _cfg("adafactor", {}))
    names = {id(p): f"w{i}" for i, p in enumerate(params)}
    _train(opt, params, range(1))
    groups = optimizer_groups(opt, names)
    groups[0]["state"]["w9"] = {"step": 1}
    with pytest.raises(CheckpointError, match="'w9', not a parameter of its group"):
        load_optimizer(opt, names, groups, optimizer_tensors(opt, names))
