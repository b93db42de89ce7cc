"""Validation pieces on small inputs: the held-out split, the loss options' formulas, the
objectives' fixed draws, and the `[validation]` config checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from difftune.config import RunConfig, TrainConfig
from difftune.data.discover import DataSet, Item
from difftune.data import holdout
from difftune.train import losses
from difftune.train.objectives.ddpm import DDPMObjective, DDPMSchedule
from difftune.train.objectives.flow import FlowMatching


def _cfg(folders: list[Path], **validation: object) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"flavor": "tiny"}, "datasets": [{"path": str(f)} for f in folders],
        "train": {"steps": 100}, "save": {"dir": "/tmp/out"}, "validation": validation})


def _items(folder: Path, n: int, dataset: int = 0) -> list[Item]:
    return [Item(folder / f"sub/{k:03d}.png", "c", (64, 64), (64, 64), dataset, 0, 1, False,
                 "center") for k in range(n)]


def test_split_is_stable_per_dataset_and_never_takes_all() -> None:
    a, b = Path("/data/a"), Path("/data/b")
    items = _items(a, 30) + _items(b, 2, dataset=1)
    cfg = _cfg([a, b], fraction=0.1)
    held = holdout.held_out(items, cfg)
    assert len([i for i in held if items[i].dataset == 0]) == 3  # round(0.1 * 30)
    assert len([i for i in held if items[i].dataset == 1]) == 1  # at least 1, never all
    # The same paths elsewhere (another root, another order) hold out the same images.
    moved = list(reversed(_items(Path("/else/a"), 30) + _items(Path("/else/b"), 2, 1)))
    again = holdout.held_out(moved, _cfg([Path("/else/a"), Path("/else/b")], fraction=0.1))
    assert {moved[i].path.name for i in again} == {items[i].path.name for i in held}
    other = holdout.held_out(items, _cfg([a, b], fraction=0.1, seed=5))
    assert other != held  # the seed picks
    assert holdout.held_out(_items(a, 1), cfg) == set()  # a lone image is never held out


def test_split_rule_auto_on_from_twenty_images_and_edit_pairs_stay() -> None:
    a = Path("/data/a")
    cfg = _cfg([a])
    small, large = DataSet(_items(a, 19)), DataSet(_items(a, 20))
    assert holdout.split(cfg, small, 16).held == [] and "19 training images < 20" in holdout.rule(cfg, 19)
    split = holdout.split(cfg, large, 16)
    assert len(split.held) == 2 and len(split.items) == 18
    assert not set(split.held) & set(split.items)
    pairs = [Item(it.path, "c", it.size, it.bucket, 0, 0, 1, False, "center",
                  controls=(Path("/c.png"),)) for it in _items(a, 20)]
    assert holdout.held_out(pairs, cfg) == set()
    assert holdout.split(_cfg([a], enabled=False), large, 16).held == []


@pytest.mark.parametrize("delta", [0.1, 0.5])
def test_huber_and_smooth_l1_against_torch(delta: float) -> None:
    pred, target = torch.randn(3, 4, 5, 5) * 0.4, torch.randn(3, 4, 5, 5) * 0.4
    l2 = losses.elementwise(pred, target)
    assert torch.equal(l2, (pred - target).pow(2))
    hub = losses.elementwise(pred, target, "huber", delta)
    torch.testing.assert_close(hub, 2 * F.huber_loss(pred, target, reduction="none", delta=delta))
    sl1 = losses.elementwise(pred, target, "smooth_l1", delta)
    torch.testing.assert_close(sl1, 2 * F.smooth_l1_loss(pred, target, reduction="none",
                                                         beta=delta))
    per = torch.tensor([delta, 1.0, 2.0])  # one delta per sample
    rows = losses.elementwise(pred, target, "huber", per)
    for k in range(3):
        torch.testing.assert_close(rows[k], 2 * F.huber_loss(pred[k], target[k], reduction="none",
                                                             delta=float(per[k])))


def test_huber_schedules() -> None:
    pos = torch.tensor([0.0, 0.5, 1.0])
    ratio = torch.tensor([0.0, 1.0, 1e6])
    assert torch.allclose(losses.huber_deltas(0.1, "constant", pos, ratio), torch.full((3,), 0.1))
    exp = losses.huber_deltas(0.1, "exponential", pos, ratio)
    assert torch.allclose(exp, torch.tensor([1.0, math.sqrt(0.1), 0.1]))
    snr = losses.huber_deltas(0.1, "snr", pos, ratio)
    assert torch.allclose(snr, torch.tensor([1.0, 0.9 / 4 + 0.1, 0.1]), atol=1e-6)
    flow = FlowMatching(TrainConfig(loss="huber", huber_schedule="exponential"))
    kind, delta = losses.options(flow.cfg, flow, torch.tensor([0.0, 1.0]))
    assert kind == "huber" and torch.allclose(delta, torch.tensor([1.0, 0.1]))
    assert losses.options(TrainConfig(), flow, torch.tensor([0.5])) == ("l2", None)


def test_draw_at_is_the_training_draw_at_those_times() -> None:
    latents = torch.randn(2, 4, 8, 8)
    gen = torch.Generator().manual_seed(1)
    flow = FlowMatching(TrainConfig(timesteps="uniform"))
    drawn = flow.draw(latents, gen)
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(latents.shape, generator=gen)
    fixed = flow.draw_at(latents, noise, drawn.t)
    assert torch.equal(fixed.noisy, drawn.noisy) and torch.equal(fixed.target, drawn.target)
    assert torch.allclose(flow.fixed_timesteps(4), torch.tensor([0.125, 0.375, 0.625, 0.875]))
    ddpm = DDPMObjective(DDPMSchedule.scaled_linear(), "v_prediction", min_snr_gamma=5.0)
    gen = torch.Generator().manual_seed(2)
    drawn = ddpm.draw(latents, gen)
    gen = torch.Generator().manual_seed(2)
    noise = torch.randn(latents.shape, generator=gen)
    fixed = ddpm.draw_at(latents, noise, drawn.t)
    assert torch.equal(fixed.target, drawn.target) and torch.equal(fixed.weights, drawn.weights)
    assert ddpm.fixed_timesteps(4).tolist() == [125, 375, 625, 875]


@pytest.mark.parametrize("fields, named", [
    ({"enabled": False, "early_stop_patience": 3}, "validation.early_stop_patience"),
    ({"enabled": False, "keep_best": True}, "validation.keep_best"),
    ({"enabled": True, "every_n_steps": 500}, "validation.every_n_steps"),
])
def test_config_conflicts_name_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _cfg([Path("/data/a")], **fields)
    assert _cfg([Path("/data/a")], early_stop_patience=0).validation.early_stop_patience is None


def test_loss_plot_draws_the_validation_loss(tmp_path: Path) -> None:
    import json

    from PIL import Image

    from difftune.report.plots import loss_curve

    rows = [{"step": s, "loss": 1.0 / s, "loss_smoothed": 1.0 / s} for s in range(1, 11)]
    for r in rows[4::5]:
        r["val_loss"] = 0.5
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    red = (203, 24, 29)
    with Image.open(loss_curve(metrics, tmp_path / "a.png")) as img:
        assert red in {c for _, c in img.convert("RGB").getcolors(1 << 16)}
    metrics.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "val_loss"})
                               + "\n" for r in rows))
    with Image.open(loss_curve(metrics, tmp_path / "b.png")) as img:
        assert red not in {c for _, c in img.convert("RGB").getcolors(1 << 16)}
