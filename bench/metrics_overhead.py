"""Step time with sample metrics on against off, sampling excluded.

    OMP_NUM_THREADS=1 python bench/metrics_overhead.py [--steps 120] [--every 20] [--rounds 2]
        [--dino PATH --clip PATH] [--device cpu] [--window 5]

Each run is difftune's real `train` verb on the tiny-flavor FLUX.1 transformer, batch 2, on
the six bundled demo images, sampling the demo's six prompts every `--every` steps; the two
runs of a round differ only in `[metrics]` (on: fidelity, memorization, diversity and CLIP
score measured in the metrics thread after each event). Without `--dino/--clip` the models
are the tiny random DINOv2 and CLIP the tests use (report/tiny_scorers.py). A step's time is
the difference of consecutive `time` values in metrics.jsonl; the steps whose interval holds a
sample event (sampling itself) and the first `--every` steps (warm-up) are left out, so what
remains is the training step, with the metrics thread working beside it in the "on" run.
Printed: the median step time of each run and their ratio, per round, and the median ratio.

On a machine whose load changes from one run to the next, the paired figure is steadier:
one run with `[metrics]` on in which only every other event is measured (the others are
handed to no one), comparing the `--window` steps after a measured event (the thread busy
beside them) with those after an unmeasured one, in the same process and minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from difftune.config import RunConfig


def config(out: Path, args: argparse.Namespace, metrics: dict[str, Any]) -> "RunConfig":
    """The tiny-flavor run writing to `out`, sampling every `--every` steps."""
    from difftune.config import parse_config
    from difftune.verbs.demo import demo_dir

    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": {"rank": 16, "targets": "all_linear"},
        "datasets": [{"path": str(demo_dir()), "resolution": 64, "min_side": 32,
                      "max_side": 128}],
        "train": {"steps": args.steps, "batch_size": 2, "lr": 3e-3, "device": args.device,
                  "seed": 1},
        "sample": {"prompts": str(demo_dir() / "prompts.txt"), "every_n_steps": args.every,
                   "at_end": False, "guidance": 1.0},
        "metrics": metrics,
        "save": {"dir": str(out), "format": "diffusers", "dtype": "fp32"},
    }, Path.cwd())


def step_times(out: Path, every: int) -> list[float]:
    """Seconds of each training step, leaving out warm-up and the steps holding an event."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows if "loss" in r}
    # The interval (s, s+1] holds the sample event taken after step s when s % every == 0.
    return [times[s] - times[s - 1] for s in sorted(times)
            if s - 1 in times and s > every and (s - 1) % every != 0]


def paired(args: argparse.Namespace, on: dict[str, Any], out: Path) -> tuple[float, float]:
    """Median step time in the windows after measured and after unmeasured events of one run
    that measures every other event."""
    from difftune.report import metric_worker
    from difftune.verbs import train as train_verb
    from difftune.verbs.train import run_train

    measured: list[int] = []

    class EveryOther(metric_worker.MetricWorker):
        """The real worker, handed every other event."""

        def submit(self, step: int, samples: list[Path]) -> None:
            if (step // args.every) % 2 == 0:
                measured.append(step)
                super().submit(step, samples)

    real = train_verb.MetricWorker
    train_verb.MetricWorker = EveryOther  # type: ignore[misc]
    try:
        run_train(config(out, args, on), show_progress=False)
    finally:
        train_verb.MetricWorker = real  # type: ignore[misc]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows if "loss" in r}
    busy, idle = [], []
    for event in range(args.every, args.steps, args.every):
        # Steps event+2 .. event+1+window: after the interval that holds the event itself.
        window = [times[s] - times[s - 1] for s in range(event + 2, event + 2 + args.window)
                  if s in times and s - 1 in times]
        (busy if event in measured else idle).extend(window)
    return statistics.median(busy), statistics.median(idle)


def main() -> None:
    """Train off/on in each round and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dino", type=Path)
    parser.add_argument("--clip", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()
    from difftune.report.tiny_scorers import save_tiny_clip, save_tiny_dino
    from difftune.verbs.train import run_train

    with tempfile.TemporaryDirectory() as tmp:
        dino = args.dino or save_tiny_dino(Path(tmp) / "dino")
        clip = args.clip or save_tiny_clip(Path(tmp) / "clip")
        on = {"enabled": True, "dino": str(dino), "clip": str(clip)}
        print("| round | step off (s) | step on (s) | on / off |\n|---|---|---|---|")
        ratios = []
        for r in range(args.rounds):
            med = {}
            for name, metrics in (("off", {}), ("on", on)):
                out = Path(tmp) / f"{name}-{r}"
                run_train(config(out, args, metrics), show_progress=False)
                med[name] = statistics.median(step_times(out, args.every))
            ratios.append(med["on"] / med["off"])
            print(f"| {r} | {med['off']:.4f} | {med['on']:.4f} | {ratios[-1]:.3f} |",
                  flush=True)
        print(f"median on/off ratio over {args.rounds} rounds: {statistics.median(ratios):.3f}")
        busy, idle = paired(args, on, Path(tmp) / "paired")
        print(f"paired, one run: {args.window} steps after a measured event {busy:.4f} s, "
              f"after an unmeasured one {idle:.4f} s: ratio {busy / idle:.3f}")


if __name__ == "__main__":
    main()
