"""Output preservation: how far a trigger-word LoRA moves prompts without the trigger.

    OMP_NUM_THREADS=1 python bench/preservation.py [--steps 120] [--weight 1.0] [--device cpu]

Trains the tiny-flavor FLUX.1 LoRA (rank 16, all linear layers, AdamW lr 1e-3, batch 2, seed 0)
twice on the bundled demo images captioned "zqx <caption>": once plain, once with
`[preservation] trigger = "zqx"`. Everything else (seed, data order, noise) is the same. Then,
for three prompt sets, the denoiser's prediction with the LoRA is compared with the base
model's (the same model, its adapters switched off) on fixed draws: the demo latents noised at
fixed timesteps from a fixed generator. The figure is the mean squared difference per element,
and its ratio to the plain run's:
  - "captions, no trigger": the training captions without the trigger (what preservation
    trains on);
  - "unseen, no trigger": prompts the run never saw;
  - "captions + trigger": the training captions (the concept: it must still move).
And "fit": the training objective's error on the demo images with their trigger captions, for
the base model and both LoRAs (the concept is learned when it drops below the base model's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from difftune.config import RunConfig
    from difftune.train.setup import Run

TRIGGER = "zqx"
UNSEEN = ["a green tree on a white background", "a blue car", "two black dots on a red square",
          "a photo of a cat", "yellow text on a dark wall", "a gray cloud over the sea"]


def data(folder: Path) -> list[str]:
    """The demo images captioned with the trigger in `folder`; their captions without it."""
    from difftune.verbs.demo import demo_dir

    captions = []
    for png in sorted(demo_dir().glob("*.png")):
        caption = png.with_suffix(".txt").read_text().strip()
        (folder / png.name).write_bytes(png.read_bytes())
        (folder / png.with_suffix(".txt").name).write_text(f"{TRIGGER} {caption}")
        captions.append(caption)
    return captions


def config(images: Path, out: Path, steps: int, weight: float | None,
           device: str) -> "RunConfig":
    """The tiny-flavor run, with output preservation at `weight` (None: without)."""
    from difftune.config import parse_config

    raw = {
        "model": {"flavor": "tiny"},
        "adapter": {"type": "lora", "rank": 16, "alpha": 16, "targets": "all_linear"},
        "datasets": [{"path": str(images), "resolution": 64, "min_side": 32, "max_side": 128}],
        "train": {"steps": steps, "batch_size": 2, "lr": 1e-3, "device": device, "seed": 0},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "overwrite": True},
    }
    if weight is not None:
        raw["preservation"] = {"trigger": TRIGGER, "weight": weight}
    return parse_config(raw, out)


def trained(cfg: "RunConfig", prompts: list[str]) -> "Run":
    """Prepare, cache (the measured prompts too) and train `cfg`; the run, in eval mode."""
    from difftune.train.loop import train_plain
    from difftune.train.setup import fill_caches, prepare

    run = prepare(cfg, show_progress=False)
    fill_caches(run, prompts, show_progress=False)
    train_plain(run)
    return run


@torch.no_grad()
def distance(run: "Run", prompts: list[str], draws: int = 4) -> float:
    """Mean squared difference, per element, of the LoRA's predictions from the base model's
    for every prompt on `draws` fixed noisings of each demo latent."""
    from difftune.train.preservation import adapters_off
    from difftune.train.step import predict

    n = len(run.data.items)
    latents = torch.stack([run.latents.get(i, False) for i in range(n)])
    generator = torch.Generator().manual_seed(1234)
    total, count = 0.0, 0
    for _ in range(draws):
        draw = run.objective.draw(latents, generator)
        for prompt in prompts:
            rows = (list(range(n)), [None] * n, [prompt] * n, [()] * n, draw.noisy, draw.t)
            tuned = predict(run, *rows).float()
            with adapters_off([run.comps.denoiser]):
                base = predict(run, *rows).float()
            total += float((tuned - base).pow(2).mean())
            count += 1
    return total / count


@torch.no_grad()
def fit(run: "Run", captions: list[str], base: bool = False, draws: int = 4) -> float:
    """The training objective's error (MSE to the target) on the demo images with their
    trigger captions, on fixed draws: how well the concept is learned (`base`: adapters off)."""
    from contextlib import nullcontext

    from difftune.train.preservation import adapters_off
    from difftune.train.step import predict

    n = len(run.data.items)
    latents = torch.stack([run.latents.get(i, False) for i in range(n)])
    generator = torch.Generator().manual_seed(4321)
    total = 0.0
    for _ in range(draws):
        draw = run.objective.draw(latents, generator)
        with adapters_off([run.comps.denoiser]) if base else nullcontext():
            pred = predict(run, list(range(n)), [None] * n, captions, [()] * n, draw.noisy,
                           draw.t)
        total += float((pred.float() - draw.target.float()).pow(2).mean())
    return total / draws


def main(argv: list[str] | None = None) -> int:
    """Train both runs and print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        images = Path(tmp) / "images"
        images.mkdir()
        captions = data(images)
        sets = {"captions, no trigger": captions, "unseen, no trigger": UNSEEN,
                "captions + trigger": [f"{TRIGGER} {c}" for c in captions]}
        every = [p for v in sets.values() for p in v]
        figures: dict = {}
        for name, weight in (("plain", None), ("preservation", args.weight)):
            run = trained(config(images, Path(tmp) / name, args.steps, weight, args.device),
                          every)
            figures[name] = {k: distance(run, v) for k, v in sets.items()}
            figures[name]["fit"] = fit(run, [it.caption for it in run.data.items])
            figures["base fit"] = fit(run, [it.caption for it in run.data.items], base=True)
            print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures[name].items()),
                  flush=True)
    print(f"tiny FLUX.1, LoRA rank 16, AdamW lr 1e-3, batch 2, {args.steps} steps, "
          f"preservation weight {args.weight}, device {args.device}, torch {torch.__version__}")
    print("MSE of the LoRA's denoiser prediction from the base model's (fixed draws)")
    print(f"{'prompts':<24}{'plain':>12}{'preservation':>14}{'ratio':>8}")
    for k in sets:
        a, b = figures["plain"][k], figures["preservation"][k]
        print(f"{k:<24}{a:>12.3g}{b:>14.3g}{b / a:>8.2f}")
    a, b = figures["plain"]["fit"], figures["preservation"]["fit"]
    print("training loss on the trigger captions (fixed draws); base model "
          f"{figures['base fit']:.4g}")
    print(f"{'fit':<24}{a:>12.4g}{b:>14.4g}{b / a:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
