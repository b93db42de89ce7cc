"""What a masked run learns inside its masks compared with the background.

    OMP_NUM_THREADS=1 python bench/masks.py [--steps 40] [--lr 1e-3] [--floors 0,0.1]
        [--device cpu]

Six 64x64 images share a subject (a red square with a white cross, the centre 32x32) on
backgrounds that differ (colours and noise); their masks are the centre square. The same tiny
FLUX.1 LoRA run (rank 8, all linear layers, batch 2, AdamW) is trained from the same seed with
the masks at each `unmasked_weight` of --floors, and without masks. Before and after training
the transformer's velocity prediction is taken on a fixed draw (each training latent noised to
t = 0.3, 0.6 and 0.9 with fixed noise, its own caption). Per region of the latent grid (the
centre 4x4 = the masked area, the rest = background) the table gives how much the prediction
moved from the base model (mean |change|) and how much of its error to the true velocity target
(mean squared) the run removed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    from difftune.config import RunConfig
    from difftune.train.setup import Run

TIMES = (0.3, 0.6, 0.9)


def make_data(root: Path) -> tuple[Path, Path]:
    """The images (shared subject, varied backgrounds) and their centre-square masks."""
    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True), masks.mkdir()
    rng = np.random.default_rng(0)
    for n in range(6):
        base = rng.integers(0, 256, size=3)
        arr = np.clip(base + rng.normal(0, 40, size=(64, 64, 3)), 0, 255).astype(np.uint8)
        arr[16:48, 16:48] = (210, 30, 30)
        arr[30:34, 20:44] = arr[20:44, 30:34] = 255
        Image.fromarray(arr).save(images / f"im{n}.png")
        (images / f"im{n}.txt").write_text("a red square with a white cross", encoding="utf-8")
        mask = np.zeros((64, 64), dtype=np.uint8)
        mask[16:48, 16:48] = 255
        Image.fromarray(mask).save(masks / f"im{n}.png")
    return images, masks


def config(images: Path, masks: Path | None, floor: float, out: Path,
           args: argparse.Namespace) -> "RunConfig":
    from difftune.config import parse_config

    subset = {"path": str(images), "resolution": 64, "min_side": 32, "max_side": 128}
    if masks is not None:
        subset |= {"mask_path": str(masks), "unmasked_weight": floor}
    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": {"rank": 8, "alpha": 8, "targets": "all_linear"},
        "datasets": [subset],
        "train": {"steps": args.steps, "batch_size": 2, "lr": args.lr, "seed": 3,
                  "device": args.device},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "dtype": "fp32"},
    }, out)


@torch.no_grad()
def predictions(run: "Run") -> tuple[torch.Tensor, torch.Tensor]:
    """The velocity predictions on the fixed draw and their targets: (times, images, C, h, w)."""
    from difftune.train.objectives.flow import noisy_and_target
    from difftune.train.step import conditioning

    idx = list(range(len(run.data.items)))
    latents = torch.stack([run.latents.get(i, False) for i in idx])
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1234))
    embeds = run.texts.get([run.data.items[i].caption for i in idx], [()] * len(idx))
    cond = conditioning(run, idx, [None] * len(idx))
    out, targets = [], []
    for time in TIMES:
        t = torch.full((len(idx),), time)
        noisy, target = noisy_and_target(latents, noise, t)
        out.append(run.family.predict(run.comps, noisy, embeds, t, cond).float())
        targets.append(target)
    return torch.stack(out), torch.stack(targets)


def one(images: Path, masks: Path | None, floor: float, out: Path, args: argparse.Namespace
        ) -> list[float]:
    """Train one run: [change inside, change outside, error removed inside, error removed
    outside] (the last two as fractions of the base model's error)."""
    from difftune.train.loop import train_plain
    from difftune.train.setup import fill_caches, prepare

    cfg = config(images, masks, floor, out, args)
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    before, target = predictions(run)
    train_plain(run)
    after, _ = predictions(run)
    inside = torch.zeros(after.shape[-2:], dtype=torch.bool)
    inside[2:6, 2:6] = True  # pixels 16..48 of 64, the VAE's factor 8

    def region(x: torch.Tensor, where: torch.Tensor) -> float:
        return float(x.mean(dim=(0, 1, 2))[where].mean())

    change = (after - before).abs()
    err0, err1 = (before - target).pow(2), (after - target).pow(2)
    return [region(change, inside), region(change, ~inside),
            1 - region(err1, inside) / region(err0, inside),
            1 - region(err1, ~inside) / region(err0, ~inside)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--floors", default="0,0.1")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    floors = [float(f) for f in args.floors.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        images, masks = make_data(Path(tmp) / "data")
        rows = {f"masked, unmasked_weight {f:g}": one(images, masks, f, Path(tmp) / f"m{f}", args)
                for f in floors}
        rows["no masks"] = one(images, None, 1.0, Path(tmp) / "plain", args)
    print(f"tiny FLUX.1, {args.steps} steps, lr {args.lr:g}; velocity prediction on a fixed "
          "draw, per region of the latent grid")
    print(f"{'run':<28} {'|change| mask':>14} {'|change| bg':>12} {'error removed mask':>19} "
          f"{'error removed bg':>17}")
    for name, (ci, co, ei, eo) in rows.items():
        print(f"{name:<28} {ci:>14.4f} {co:>12.4f} {ei:>19.1%} {eo:>17.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
