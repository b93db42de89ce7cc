"""`difftune dataset report` on 1,000 images against a bare loop that only decodes them.

    OMP_NUM_THREADS=1 python bench/dataset_report.py [--images 1000] [--size 1024x768]
        [--png-every 10] [--rounds 2] [--folder DIR]

The images are made once (JPEG, one PNG in `--png-every`, smooth gradients with noise and a
few near-copies, captions beside them), in DIR if given (kept between runs), else in a
temporary folder. The bare loop opens each image and decodes it whole to RGB, one after the
other: what any tool that reads the images must at least do. The report's side is
`verbs.dataset_report.folder_report` at resolution 1024: every check, near-duplicates over
all pairs included. Rounds alternate the two; the medians are reported. The goal of issue 34:
the report on 1,000 images under a minute on the project's CPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make(folder: Path, count: int, size: tuple[int, int], png_every: int) -> list[Path]:
    """The images (made only when missing) and a caption file each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    out = []
    for i in range(count):
        path = folder / (f"im{i:04d}.png" if i % png_every == 0 else f"im{i:04d}.jpg")
        out.append(path)
        if path.exists():
            continue
        a, b = rng.random(2) * 0.02
        base = (np.sin(xx * a + i) + np.cos(yy * b)) * 60 + 128
        pixels = np.stack([base, base[::-1], base[:, ::-1]], -1) + rng.normal(0, 12, (h, w, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype("uint8")).save(path, quality=90)
        path.with_suffix(".txt").write_text(f"ohwx, photo {i % 37}, gradient", encoding="utf-8")
    return out


def bare(paths: list[Path]) -> float:
    """Seconds to decode every image whole, one after the other."""
    start = time.perf_counter()
    for p in paths:
        with Image.open(p) as im:
            im.convert("RGB").load()
    return time.perf_counter() - start


def report(folder: Path) -> tuple[float, str]:
    """Seconds of the whole report on the folder, and its summary line."""
    from difftune.dataset_report.checks import Settings
    from difftune.dataset_report.render import summary_line
    from difftune.verbs.dataset_report import folder_report

    start = time.perf_counter()
    found = folder_report(folder, Settings(trigger="ohwx"), 1024)
    return time.perf_counter() - start, summary_line(found)


def main() -> None:
    """Make the images, measure, print the table."""
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--size", default="1024x768")
    p.add_argument("--png-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--folder", type=Path)
    a = p.parse_args()
    size = tuple(int(v) for v in a.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.folder or Path(tmp) / "data"
        paths = make(folder, a.images, size, a.png_every)  # type: ignore[arg-type]
        times: dict[str, list[float]] = {"bare decode": [], "dataset report": []}
        line = ""
        for _ in range(a.rounds):
            times["bare decode"].append(bare(paths))
            seconds, line = report(folder)
            times["dataset report"].append(seconds)
    print(f"{a.images} images of {a.size} ({a.images // a.png_every} PNG, the rest JPEG), "
          f"{a.rounds} rounds\n{line}")
    print("| loop | s (median) | images/s | rounds (s) |\n| --- | ---: | ---: | --- |")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} | {a.images / m:.0f} | {', '.join(f'{t:.2f}' for t in ts)} |")


if __name__ == "__main__":
    main()
