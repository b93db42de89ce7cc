"""Disk-cache figures on the tiny flavor, each against a baseline measured in the same run.

    python bench/cache.py [--items 200] [--read-items 1000] [--rounds 5] [--steps 60]

(a) fill: `difftune cache`'s fill (disk latents and text) against a bare loop that loads and
    encodes the same items with no cache at all. Goal: within 10%.
(b) read: one epoch of `--read-items` tiny latents (16x8x8 fp32, the tiny FLUX.1 latent of a
    64x64 image) read from difftune's disk cache against the same tensors as `.npz` files read
    with numpy (page cache warm for both). Goal: at least 5x faster.
(c) share: with both caches warm on disk, the time the real training loop spends getting latents
    and text embeddings, as a share of its step time. Goal: under 5%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from difftune.cache.disk import DiskStore
from difftune.cache.keys import entry_key
from difftune.config import RunConfig, parse_config
from difftune.data.images import load_pixels
from difftune.train.loop import train_plain
from difftune.train.setup import fill_caches, prepare


def make_data(folder: Path, n: int) -> Path:
    """`n` distinct 64x64 images with distinct captions."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        pixels = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:04d}.png")
        (folder / f"img_{i:04d}.txt").write_text(f"a noisy picture, number {i}, tiny")
    return folder


def config(data: Path, out: Path, steps: int = 1, cache: str = "disk") -> RunConfig:
    """A tiny-flavor run over `data` with both caches on disk under `out`."""
    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": {"rank": 16, "targets": "all_linear"},
        "datasets": [{"path": str(data), "resolution": 64, "min_side": 32, "max_side": 128}],
        "cache": {"latents": cache, "text": cache, "dir": str(out / "cache")},
        "train": {"steps": steps, "batch_size": 2, "device": "cpu"},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "overwrite": True},
    }, out)


def bare_fill(cfg: RunConfig) -> float:
    """Seconds to load and encode every item with no cache: the work a fill cannot avoid."""
    run = prepare(cfg, show_progress=False)
    start = time.perf_counter()
    with torch.no_grad():
        for i, item in enumerate(run.data.items):
            pixels = load_pixels(item.path, item.bucket, run.latents.box(i), False)
            run.family.encode_images(run.comps, pixels[None])
            for spec in run.family.text_encoders:
                run.texts._run(spec.name, [item.caption])
    return time.perf_counter() - start


def difftune_fill(cfg: RunConfig) -> tuple[float, float]:
    """(seconds of difftune's fill into an empty disk cache, seconds of it spent encoding).

    The second figure times the same VAE and text-encoder calls inside the fill, so the
    difference is the cache's own cost (keys, hashing, queueing, waiting for the writes)
    measured in one run, whatever the load on the machine.
    """
    run = prepare(cfg, show_progress=False)
    encoding = [0.0]
    run.family.encode_images = _timed(run.family.encode_images, encoding)  # type: ignore
    run.texts._run = _timed(run.texts._run, encoding)  # type: ignore[method-assign]
    start = time.perf_counter()
    fill_caches(run, [], show_progress=False)
    return time.perf_counter() - start, encoding[0]


def _timed(method: Callable, spent: list[float]) -> Callable:
    """`method`, adding the seconds each call takes to `spent[0]`."""
    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return wrapper


def read_epoch(folder: Path, n: int, rounds: int) -> tuple[float, float]:
    """Median seconds to read `n` cached latents: difftune's disk store, then `.npz` files."""
    store, npz = DiskStore(folder, "latents"), folder / "npz"
    npz.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    keys = []
    for i in range(n):
        latent = torch.randn(16, 8, 8, generator=gen)
        key = entry_key({"i": i})
        store.put(key, {"latent": latent}, {"i": str(i)})
        np.savez(npz / f"{key}.npz", latent=latent.numpy())
        keys.append(key)
    ours = _median(lambda: [store.get(k)["latent"] for k in keys], rounds)
    theirs = _median(lambda: [torch.from_numpy(np.load(npz / f"{k}.npz")["latent"])
                              for k in keys], rounds)
    return ours, theirs


def _median(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def data_share(cfg: RunConfig) -> tuple[float, float]:
    """(seconds per step, seconds per step spent getting latents and text) with warm caches."""
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    spent = [0.0]
    run.latents.get = _timed(run.latents.get, spent)  # type: ignore[method-assign]
    run.texts.get = _timed(run.texts.get, spent)  # type: ignore[method-assign]
    start = time.perf_counter()
    train_plain(run)
    total = time.perf_counter() - start
    return total / cfg.train.steps, spent[0] / cfg.train.steps


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--read-items", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data(root / "data", args.items)
        fills, bares, inside = [], [], []
        for r in range(args.rounds):
            bares.append(bare_fill(config(data, root / f"bare{r}")))
            total, encoding = difftune_fill(config(data, root / f"fill{r}"))
            fills.append(total)
            inside.append(total / encoding)
            print(f"    fill round {r}: bare {bares[-1]:.3f} s, difftune {total:.3f} s "
                  f"(of which encoding {encoding:.3f} s)", flush=True)
        b, f = statistics.median(bares), statistics.median(fills)
        paired = statistics.median(x / y for x, y in zip(fills, bares))
        print(f"(a) fill of {args.items} items: bare loop {b:.3f} s, difftune {f:.3f} s, "
              f"ratio of medians {f / b:.3f}, median per-round ratio {paired:.3f}; fill time "
              f"over its own encoding time, median {statistics.median(inside):.3f} "
              f"(goal <= 1.10)")
        ours, npz = read_epoch(root / "read", args.read_items, args.rounds)
        print(f"(b) read {args.read_items} cached latents: difftune {ours * 1e3:.1f} ms, "
              f".npz {npz * 1e3:.1f} ms, {npz / ours:.1f}x faster (goal >= 5x)")
        step, spent = data_share(config(data, root / f"fill0", steps=args.steps))
        print(f"(c) {args.steps} steps with warm disk caches: {step * 1e3:.1f} ms/step, data "
              f"{spent * 1e3:.2f} ms/step = {100 * spent / step:.1f}% of the step (goal < 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
