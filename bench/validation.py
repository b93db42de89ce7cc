"""Validation loss against training loss: a sane and a far too high learning rate.

    OMP_NUM_THREADS=1 python bench/validation.py [--steps 300] [--every 25]
        [--lrs 1e-3,1e-2] [--rank 16] [--device cpu]

Each run is difftune's real `train` verb on the tiny-flavor FLUX.1 transformer, batch 2, on
the six bundled demo images with two of them held out (`validation.enabled = true`,
`fraction = 0.34`: the same two in every run), evaluated every `--every` steps at 4 fixed
timesteps with fixed noise. Printed per learning rate: the smoothed training loss (the
loop's 0.9 moving average) at the first and last step, the validation loss at the first
evaluation, its minimum (and step) and at the last evaluation; then each run's validation
loss at every evaluation. Overfitting shows as a
validation loss that rises from its minimum while the training loss falls.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from difftune.config import RunConfig


def config(lr: float, out: Path, args: argparse.Namespace) -> "RunConfig":
    """The tiny-flavor run at learning rate `lr` writing to `out`."""
    from difftune.config import parse_config
    from difftune.verbs.demo import demo_dir

    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": {"rank": args.rank, "targets": "all_linear"},
        "datasets": [{"path": str(demo_dir()), "resolution": 64, "min_side": 32,
                      "max_side": 128}],
        "train": {"steps": args.steps, "batch_size": 2, "lr": lr, "device": args.device,
                  "seed": 1},
        "validation": {"enabled": True, "fraction": 0.34, "every_n_steps": args.every},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "format": "diffusers", "dtype": "fp32",
                 "every_n_steps": None},
    }, Path.cwd())


def figures(out: Path) -> dict[str, float]:
    """First/last smoothed training loss and first/min/last validation loss of a run."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    best = min(val, key=lambda sv: sv[1])
    return {"train_first": rows[0]["loss_smoothed"], "train_last": rows[-1]["loss_smoothed"],
            "val_first": val[0][1], "val_min": best[1], "val_min_step": best[0],
            "val_last": val[-1][1], "curve": " ".join(f"{v:.2f}" for _, v in val)}


def main() -> None:
    """Train once per learning rate and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--lrs", default="1e-3,1e-2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from difftune.verbs.train import run_train

    print("| lr | train loss (smoothed) first -> last | val loss first | val min (step) "
          "| val last |")
    print("|---|---|---|---|---|")
    curves = []
    for lr in (float(x) for x in args.lrs.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            run_train(config(lr, Path(tmp) / "out", args), show_progress=False)
            f = figures(Path(tmp) / "out")
        print(f"| {lr:g} | {f['train_first']:.4f} -> {f['train_last']:.4f} | "
              f"{f['val_first']:.4f} | {f['val_min']:.4f} ({f['val_min_step']}) | "
              f"{f['val_last']:.4f} |", flush=True)
        curves.append(f"lr {lr:g}: validation loss at each evaluation: {f['curve']}")
    print("\n".join(curves))


if __name__ == "__main__":
    main()
