"""Seconds per step and memory of each adapter type, as ratios to LoRA + AdamW in the same run.

    OMP_NUM_THREADS=1 python bench/adapters.py [--steps 40] [--warmup 8] [--rounds 3]
        [--adapters lora,dora,locon,loha,lokr,lokr_full,full] [--device cpu]

Every run is difftune's real loop (`train.loop.train`, AdamW) on the tiny-flavor FLUX.1
transformer, batch 2, on the bundled demo images, changing only the adapter: rank 16 on all
linear layers for the LoRA-like kinds, the whole denoiser for `full`. Seconds per step (from
the loop's metrics, after warm-up) come from the same process, the adapters alternating within
each round (each adapter is attached to a freshly loaded model, since an adapter is injected at
load); memory from one fresh process per adapter: its trained parameters, the bytes of weights
and optimizer state its last checkpoint holds, and the process's peak resident memory. Ratios
are to LoRA's figures; "paired" is the median over rounds of each round's step-time ratio, the
figure least moved by the machine's load.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from optimizers import measure, parse, train_once  # bench/optimizers.py: the shared harness

if TYPE_CHECKING:
    from difftune.config import RunConfig

ADAPTERS: dict[str, dict[str, Any]] = {
    "lora": {"type": "lora"},
    "dora": {"type": "lora", "dora": True},
    "locon": {"type": "locon"},
    "loha": {"type": "loha"},
    "lokr": {"type": "lokr"},
    "lokr_full": {"type": "lokr", "full_matrix": True},
    "full": {"type": "full"},
}


def config(name: str, out: Path, steps: int, device: str) -> "RunConfig":
    """The tiny-flavor run with adapter `name` writing to `out`, no sampling."""
    from difftune.config import parse_config
    from difftune.verbs.demo import demo_dir

    adapter = dict(ADAPTERS[name])
    if adapter["type"] != "full":
        adapter |= {"rank": 16, "targets": "all_linear"}
    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": adapter,
        "datasets": [{"path": str(demo_dir()), "resolution": 64, "min_side": 32,
                      "max_side": 128}],
        "train": {"steps": steps, "batch_size": 2, "lr": 1e-4, "device": device,
                  "log_every": 1},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "overwrite": True},
    }, out)


def seconds_per_step(name: str, out: Path, steps: int, warmup: int, device: str) -> float:
    """Load the tiny model with adapter `name`, fill the caches and train: seconds per step."""
    from difftune.train.setup import fill_caches, prepare

    cfg = config(name, out, steps, device)
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    return train_once(run, cfg, warmup)


def one(name: str, out: Path, steps: int, warmup: int, device: str) -> dict[str, float]:
    """Train adapter `name` in this process: trained parameters, checkpoint weight and
    optimizer bytes, and this process's peak resident memory."""
    from safetensors import safe_open

    seconds_per_step(name, out, steps, warmup, device)
    ckpt = out / "checkpoints" / f"step-{steps:06d}"

    def size(prefix: str) -> tuple[int, int]:
        count = nbytes = 0
        for path in ckpt.glob(f"{prefix}*.safetensors"):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    t = f.get_slice(key)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    if t.get_shape():
                        count += n
                        nbytes += n * {"F32": 4, "F16": 2, "BF16": 2}.get(t.get_dtype(), 4)
        return count, nbytes

    params, weight_bytes = size("trainable")
    _, state_bytes = size("optimizer")
    return {"params": params, "weight_bytes": weight_bytes, "state_bytes": state_bytes,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    """Alternate the adapters over rounds and print each one's figures and ratios."""
    args = parse(argv, __doc__, (40, 8, 3), "adapters", ",".join(ADAPTERS))
    if args.one:
        print(json.dumps(one(args.one, Path(args.out), args.steps, args.warmup, args.device)))
        return 0
    names = ["lora"] + [n for n in args.adapters.split(",") if n != "lora"]
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                times[n].append(seconds_per_step(n, Path(tmp) / f"t{r}-{n}", args.steps,
                                                 args.warmup, args.device))
                print(f"round {r} {n}: {times[n][-1] * 1e3:.1f} ms/step", flush=True)
        memory = {n: measure(n, args, Path(tmp) / "memory", __file__) for n in names}
    step = {n: statistics.median(v) for n, v in times.items()}
    paired = {n: statistics.median(a / b for a, b in zip(v, times["lora"]))
              for n, v in times.items()}
    base = memory["lora"]
    print(f"device {args.device}, torch {torch.__version__}, tiny FLUX.1, AdamW, batch 2, "
          f"{args.steps - args.warmup} timed steps x {args.rounds} rounds")
    print(f"{'adapter':<11}{'params':>10}{'x LoRA':>8}{'ms/step':>9}{'x LoRA':>8}{'paired':>8}"
          f"{'state KiB':>11}{'x LoRA':>8}{'peak RSS MiB':>14}{'x LoRA':>8}")
    for n in names:
        m = memory[n]
        print(f"{n:<11}{m['params']:>10}{m['params'] / base['params']:>8.2f}"
              f"{step[n] * 1e3:>9.1f}{step[n] / step['lora']:>8.2f}{paired[n]:>8.2f}"
              f"{m['state_bytes'] / 1024:>11.1f}{m['state_bytes'] / base['state_bytes']:>8.2f}"
              f"{m['peak_rss_mib']:>14.0f}{m['peak_rss_mib'] / base['peak_rss_mib']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
