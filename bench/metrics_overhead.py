"""Step time with sample metrics on against off, sampling and the measurements excluded.

    OMP_NUM_THREADS=1 python bench/metrics_overhead.py [--pairs 6] [--steps 120] [--every 20]
        [--dino PATH --clip PATH | --sized] [--device cpu]

Each run is difftune's real `train` verb on the tiny-flavor FLUX.1 transformer, batch 2, on
the six bundled demo images, sampling the demo's six prompts every `--every` steps; the two
runs of a pair differ only in `[metrics]` (on: fidelity, memorization, diversity and CLIP
score measured in the metrics process after each event). Without `--dino/--clip` the models
are the tiny random DINOv2 and CLIP the tests use (report/tiny_scorers.py); `--sized` makes
the DINOv2 a random one of dinov2-small's size (ViT-S/14, 224 px input: the work a real one
does per image, nothing downloaded), the CLIP staying tiny.

The machine's load moves from minute to minute, so the runs are interleaved: pair k runs off
then on for even k and on then off for odd k (ABBA...), and what is reported is the median
of the per-pair ratios (with their range) beside the medians of each arm.

A step's time is the difference of consecutive `time` values in metrics.jsonl. Left out: the
first `--every` steps (warm-up) and the sample events themselves: the step after an event is
timed from the event's end (the bench records when each `sample_event` returned), so sampling
is excluded but the step that runs while the metrics process starts measuring is kept. The
measurements' own time is not in the training process at all: they run in a child process
(report/metric_process.py), which reports when each measurement ran (`MetricWorker.busy`,
perf_counter: one monotonic clock for the machine on Linux). Where the two processes find
fewer free cores than they need they slow each other: so each "on" run's steps are also split
into those that overlap a measurement and those that do not, and their medians printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from difftune.config import RunConfig


@dataclass
class Timed:
    """One run's timed steps (start, end, whether it is the step right after a sample event)
    in perf_counter seconds since its start, and the intervals its metrics process spent
    measuring."""

    steps: list[tuple[float, float, bool]]
    busy: list[tuple[float, float]]
    startup: list[tuple[float, float]]

    def seconds(self) -> list[float]:
        """Every timed step's duration."""
        return [b - a for a, b, _ in self.steps]

    def after_events(self) -> list[float]:
        """The durations of the steps right after a sample event (the measurement starts
        with them in an "on" run; the same steps of an "off" run are their control)."""
        return [b - a for a, b, after in self.steps if after]

    def split(self) -> tuple[list[float], list[float], list[float]]:
        """Durations of the steps that overlap a measurement, of those that overlap the
        metrics process's start-up (imports, loading the models) and of the others."""
        over: list[float] = []
        start: list[float] = []
        clear: list[float] = []
        for a, b, _ in self.steps:
            hit = any(s < b and e > a for s, e in self.busy)
            up = any(s < b and e > a for s, e in self.startup)
            (over if hit else start if up else clear).append(b - a)
        return over, start, clear


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


def timed_run(out: Path, args: argparse.Namespace, metrics: dict[str, Any]) -> Timed:
    """Train once; its timed steps and the metrics process's busy intervals, both in seconds
    since the run's reporter started (the clock of metrics.jsonl's `time`)."""
    from difftune.report import metric_worker, metrics as report
    from difftune.train import loop
    from difftune.verbs import train as train_verb
    from difftune.verbs.train import run_train

    starts: list[float] = []
    busy: list[tuple[float, float]] = []
    startup: list[tuple[float, float]] = []
    ended: dict[int, float] = {}
    event = loop.sample_event

    def timed_event(run: Any, hooks: Any, state: Any, step: int, *a: Any, **kw: Any) -> None:
        """The real sample event; when it ended kept."""
        event(run, hooks, state, step, *a, **kw)
        ended[step] = time.perf_counter()

    class Clocked(report.Reporter):
        """The real reporter; its start time kept."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            starts.append(self.start_time)

    class Recorded(metric_worker.MetricWorker):
        """The real worker; when each measurement ran (in its child process, on the same
        monotonic perf_counter clock) kept."""

        def close(self) -> None:
            super().close()
            busy.extend(self.busy)
            startup.extend([self.startup] if self.startup else [])

    real = train_verb.Reporter, train_verb.MetricWorker
    train_verb.Reporter, train_verb.MetricWorker = Clocked, Recorded  # type: ignore[misc]
    loop.sample_event = timed_event  # type: ignore[assignment]
    try:
        run_train(config(out, args, metrics), show_progress=False)
    finally:
        train_verb.Reporter, train_verb.MetricWorker = real  # type: ignore[misc]
        loop.sample_event = event  # type: ignore[assignment]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r["time"] for r in rows if "loss" in r}
    zero = starts[0]
    # The interval (s-1, s] holds the sample event taken after step s-1 when an event ended
    # in it: that step is timed from the event's end.
    steps = [((ended[s - 1] - zero) if s - 1 in ended else at[s - 1], at[s], s - 1 in ended)
             for s in sorted(at) if s - 1 in at and s > args.every]
    return Timed(steps, [(a - zero, b - zero) for a, b in busy],
                 [(a - zero, b - zero) for a, b in startup])


def save_sized_dino(folder: Path) -> Path:
    """A random `Dinov2Model` of dinov2-small's size (ViT-S/14, 12 layers, width 384) with a
    224 px processor, saved as a local folder."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    Dinov2Model(Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                             intermediate_size=1536, patch_size=14, image_size=518)
                ).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                      do_center_crop=True, image_mean=[0.485, 0.456, 0.406],
                      image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}" if values else "-"


def report(pairs: list[dict[str, Timed]]) -> None:
    """The per-pair table and the summary lines."""
    print("| pair | order | off ms/step | on ms/step | on / off | on, steps beside a "
          "measurement | on, beside its start-up | on, other steps | measuring s/event |\n"
          "|---|---|---|---|---|---|---|---|---|")
    ratios, offs, ons = [], [], []
    for k, pair in enumerate(pairs):
        off, on = (statistics.median(pair[n].seconds()) for n in ("off", "on"))
        over, start, clear = pair["on"].split()
        events = [e - s for s, e in pair["on"].busy] or [0.0]
        ratios.append(on / off)
        offs.append(off)
        ons.append(on)
        print(f"| {k} | {'off, on' if k % 2 == 0 else 'on, off'} | {1000 * off:.1f} | "
              f"{1000 * on:.1f} | {on / off:.3f} | {_ms(over)} ({len(over)}) | "
              f"{_ms(start)} ({len(start)}) | {_ms(clear)} ({len(clear)}) | {statistics.mean(events):.2f} |")
    print(f"median step: off {1000 * statistics.median(offs):.1f} ms, on "
          f"{1000 * statistics.median(ons):.1f} ms")
    print(f"median of the {len(ratios)} paired on/off ratios: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    after = {n: statistics.median([x for p in pairs for x in p[n].after_events()])
             for n in ("off", "on")}
    print(f"the step right after each sample event, pooled: off {1000 * after['off']:.1f} ms, "
          f"on {1000 * after['on']:.1f} ms: ratio {after['on'] / after['off']:.3f}")
    over = [x for p in pairs for x in p["on"].split()[0]]
    clear = [x for p in pairs for x in p["on"].split()[2]]
    start = [x for p in pairs for x in p["on"].split()[1]]
    if start:
        print(f"'on' runs, pooled: steps beside the metrics process's start-up {_ms(start)} ms "
              f"({len(start)} steps)")
    if over and clear:
        print(f"'on' runs, pooled: steps overlapping a measurement {_ms(over)} ms "
              f"({len(over)} steps), the others {_ms(clear)} ms ({len(clear)} steps): ratio "
              f"{statistics.median(over) / statistics.median(clear):.3f}")


def main() -> None:
    """Run the interleaved pairs and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--dino", type=Path)
    parser.add_argument("--clip", type=Path)
    parser.add_argument("--sized", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch

    from difftune.report.tiny_scorers import save_tiny_clip, save_tiny_dino

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), "
          f"{args.pairs} pairs of {args.steps} steps, an event every {args.every}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dino = args.dino or (save_sized_dino if args.sized else save_tiny_dino)(
            Path(tmp) / "dino")
        clip = args.clip or save_tiny_clip(Path(tmp) / "clip")
        arms = {"off": {}, "on": {"enabled": True, "dino": str(dino), "clip": str(clip)}}
        pairs = []
        for k in range(args.pairs):
            order = ("off", "on") if k % 2 == 0 else ("on", "off")
            pairs.append({name: timed_run(Path(tmp) / f"{name}-{k}", args, arms[name])
                          for name in order})
            print(f"pair {k} done", flush=True)
        report(pairs)


if __name__ == "__main__":
    main()
