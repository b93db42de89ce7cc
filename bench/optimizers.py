"""Seconds per step and memory of each optimizer, as ratios to LoRA + AdamW in the same run.

    OMP_NUM_THREADS=1 python bench/optimizers.py [--steps 60] [--warmup 10] [--rounds 2]
        [--optimizers adamw,prodigy,...] [--device cpu]

Every run is difftune's real loop (`train.loop.train`) on the tiny-flavor FLUX.1 transformer
with a rank-16 LoRA on all linear layers, batch 2, on the bundled demo images, changing only
`train.optimizer`. Seconds per step (from the loop's metrics, after warm-up) are measured in
one process on one loaded model, the optimizers alternating within each round; memory in one
fresh process per optimizer: the bytes of optimizer state its last checkpoint holds (per-weight
tensors) and the process's peak resident memory (on the CPU the tiny model's LoRA state is a
small part of it). Each figure is also given as a ratio to AdamW's ("paired": the median over
rounds of each round's ratio of step times, the figure least moved by the machine's load).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from difftune.config import RunConfig
    from difftune.train.setup import Run

CPU_OPTIMIZERS = ("adamw", "prodigy", "adafactor", "schedulefree_adamw", "came", "lion")


def config(name: str, out: Path, steps: int, device: str) -> "RunConfig":
    """The tiny-flavor run with optimizer `name` writing to `out`, no sampling."""
    from difftune.config import parse_config
    from difftune.verbs.demo import demo_dir

    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": {"rank": 16, "targets": "all_linear"},
        "datasets": [{"path": str(demo_dir()), "resolution": 64, "min_side": 32,
                      "max_side": 128}],
        "train": {"steps": steps, "batch_size": 2, "lr": 1e-4, "device": device,
                  "optimizer": name, "log_every": 1},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "overwrite": True},
    }, out)


def train_once(run: "Run", cfg: "RunConfig", warmup: int) -> float:
    """Train `run` with `cfg` (its optimizer) through difftune's loop; seconds per step after
    `warmup` steps, from the loop's metrics."""
    from difftune.train.loop import train_plain

    run = replace(run, cfg=cfg)
    train_plain(run)
    rows = [json.loads(r) for r in (cfg.save.dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows}
    return (times[cfg.train.steps] - times[warmup]) / (cfg.train.steps - warmup)


def one(name: str, out: Path, steps: int, warmup: int, device: str) -> dict[str, float]:
    """Train `steps` steps with optimizer `name` in this process: the optimizer state its last
    checkpoint holds and this process's peak resident memory."""
    from safetensors.torch import load_file

    from difftune.train.setup import fill_caches, prepare

    cfg = config(name, out, steps, device)
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    train_once(run, cfg, warmup)
    state = load_file(str(out / "checkpoints" / f"step-{steps:06d}" / "optimizer.safetensors"))
    return {"state_bytes": sum(v.numel() * v.element_size() for v in state.values()
                               if v.dim() > 0),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def timings(names: list[str], args: argparse.Namespace,
            tmp: Path) -> dict[str, list[float]]:
    """Seconds per step of each optimizer, measured in this one process on one loaded model,
    the optimizers alternating within each round (each round: every optimizer back to back,
    so a round's ratios share the machine's load)."""
    from difftune.train.setup import fill_caches, prepare

    run = prepare(config("adamw", tmp / "load", args.steps, args.device), show_progress=False)
    fill_caches(run, [], show_progress=False)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            cfg = config(n, tmp / f"t{r}-{n}", args.steps, args.device)
            out[n].append(train_once(run, cfg, args.warmup))
            print(f"round {r} {n}: {out[n][-1] * 1e3:.1f} ms/step", flush=True)
    return out


def measure(name: str, args: argparse.Namespace, tmp: Path,
            script: str = __file__) -> dict[str, float]:
    """`script`'s `one` (this file's by default) in a fresh process (peak memory is per
    process)."""
    cmd = [sys.executable, script, "--one", name, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--device", args.device, "--out", str(tmp / name)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse(argv: list[str] | None, doc: str, rounds: tuple[int, int, int], listed: str,
          names: str) -> argparse.Namespace:
    """The arguments every round-alternating bench takes: `rounds` = default steps, warm-up
    steps and rounds; `--<listed>` the comma-separated things compared (default `names`);
    `--one`/`--out` the hidden fresh-process measurement (`measure`)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, default in zip(("--steps", "--warmup", "--rounds"), rounds):
        p.add_argument(flag, type=int, default=default)
    p.add_argument(f"--{listed}", default=names)
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Alternate the optimizers over rounds and print each one's figures and ratios."""
    args = parse(argv, __doc__, (60, 10, 2), "optimizers", ",".join(CPU_OPTIMIZERS))
    if args.one:
        print(json.dumps(one(args.one, Path(args.out), args.steps, args.warmup, args.device)))
        return 0
    names = ["adamw"] + [n for n in args.optimizers.split(",") if n != "adamw"]
    with tempfile.TemporaryDirectory() as tmp:
        times = timings(names, args, Path(tmp))
        memory = {n: measure(n, args, Path(tmp) / "memory") for n in names}
    runs = {n: [{"step_s": t, **memory[n]} for t in times[n]] for n in names}
    med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in runs.items()}
    base = med["adamw"]
    # Each round measures every optimizer, so the median of per-round ratios is the figure
    # least moved by drifting load on the machine.
    paired = {n: statistics.median(x["step_s"] / b["step_s"] for x, b in zip(v, runs["adamw"]))
              for n, v in runs.items()}
    print(f"device {args.device}, torch {torch.__version__}, tiny FLUX.1, LoRA rank 16 all "
          f"linear, batch 2, {args.steps - args.warmup} timed steps x {args.rounds} rounds")
    print(f"{'optimizer':<20}{'ms/step':>9}{'x AdamW':>9}{'paired':>8}{'state KiB':>11}"
          f"{'x AdamW':>9}{'peak RSS MiB':>14}{'x AdamW':>9}")
    for n, m in med.items():
        print(f"{n:<20}{m['step_s'] * 1e3:>9.1f}{m['step_s'] / base['step_s']:>9.2f}"
              f"{paired[n]:>8.2f}"
              f"{m['state_bytes'] / 1024:>11.1f}{m['state_bytes'] / base['state_bytes']:>9.2f}"
              f"{m['peak_rss_mib']:>14.0f}{m['peak_rss_mib'] / base['peak_rss_mib']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
