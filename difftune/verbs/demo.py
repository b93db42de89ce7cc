"""`difftune demo`: a real training run on the tiny flavor and bundled data, on the CPU.

It writes the usual run outputs plus `before_after.png` (samples before the first step and after
the last, one column per prompt) and `loss.png`, and reports for each prompt whether its final
sample is closer to its own training image than to any other: the evidence that it learned.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

from difftune.verbs.train import run_train
from difftune.config import RunConfig, parse_config
from difftune.errors import ConfigError
from difftune.report.plots import labelled_rows, loss_curve
from difftune.sample.runner import PromptSpec, read_prompts
from difftune.train.rundir import previous_outputs


def demo_dir() -> Path:
    """Folder of the shipped demo dataset (images, same-stem captions, prompts.txt)."""
    return Path(str(resources.files("difftune") / "assets" / "demo"))


def demo_config_path() -> Path:
    """The packaged demo run file."""
    return Path(str(resources.files("difftune") / "assets" / "demo.toml"))


@dataclass
class Learning:
    """Per prompt: which training image its sample is nearest to (mean squared pixel error)."""

    prompts: list[str]
    nearest: list[str]

    @property
    def matched(self) -> int:
        """How many prompts' samples are nearest to their own image."""
        return sum(p == n for p, n in zip(self.prompts, self.nearest))


def _pixels(path: Path, size: tuple[int, int]) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB").resize(size), dtype=np.float32) / 255.0


def nearest_images(samples: list[Path], prompts: list[PromptSpec], data_dir: Path) -> Learning:
    """For each sample (prompt i), the caption of the training image it is closest to."""
    captions = {p.read_text(encoding="utf-8").strip(): p.with_suffix(".png")
                for p in sorted(data_dir.glob("*.txt")) if p.name != "prompts.txt"}
    nearest = []
    for sample in samples:
        with Image.open(sample) as im:
            size = im.size
        own = _pixels(sample, size)
        errors = {cap: float(((own - _pixels(img, size)) ** 2).mean()) for cap, img in captions.items()}
        nearest.append(min(errors, key=errors.__getitem__))
    return Learning([p.prompt for p in prompts], nearest)


def _event_samples(samples_dir: Path, step: int, count: int) -> list[Path]:
    return [next(samples_dir.glob(f"step-{step:06d}_{i:02d}_*.png")) for i in range(count)]


def demo_config(out: Path, steps: int | None = None) -> RunConfig:
    """The demo's run config writing to `out`, with `steps` optimizer steps (any >= 1).

    Built as data, not as TOML text: any folder name works (quotes, backslashes, spaces), and
    it is an absolute path, never resolved against the packaged demo's folder.
    """
    path = demo_config_path()
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    data["save"]["dir"] = str(out.expanduser().resolve())
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps {steps}: the demo needs at least one step")
        train = data["train"]
        train["steps"] = steps
        # The packaged schedule warms up for 20 of 800 steps; keep that share for short runs.
        train["warmup_steps"] = min(train["warmup_steps"], steps // 40)
        data["sample"]["every_n_steps"] = max(1, steps // 3)
    return parse_config(data, path.parent, f"demo config ({path})")


def run_demo(out: Path, steps: int | None = None, show_progress: bool = True) -> str:
    """Train the demo, draw its figures, and return a short report.

    Like `train`, it refuses a folder that holds a previous run's outputs."""
    cfg = demo_config(out, steps)
    found = previous_outputs(cfg.save.dir)
    if found:
        raise ConfigError(f"--out {out}: the folder already holds a run's outputs "
                          f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}); "
                          "difftune never overwrites them: give another --out, or delete it")
    result = run_train(cfg, show_progress=show_progress)
    final = cfg.train.steps
    prompts = read_prompts(cfg.sample.prompts, PromptSpec("", "", 64, 64, 8, 0, 3.5, 1.0))
    samples = out / "samples"
    before = _event_samples(samples, 0, len(prompts))
    after = _event_samples(samples, final, len(prompts))
    rows = [("training", _row([p for p in _training_images(prompts, cfg.datasets[0].subsets[0].path)])),
            ("before", _row(before)), (f"step {final}", _row(after))]
    labelled_rows(rows, out / "before_after.png")
    loss_curve(out / "metrics.jsonl", out / "loss.png")
    learned = nearest_images(after, prompts, cfg.datasets[0].subsets[0].path)
    baseline = nearest_images(before, prompts, cfg.datasets[0].subsets[0].path)
    return (f"LoRA: {result.lora}\n"
            f"loss: first {result.losses[0]:.4f}, last 10 mean "
            f"{sum(result.losses[-10:]) / len(result.losses[-10:]):.4f}\n"
            f"samples nearest to their own training image: before {baseline.matched}/"
            f"{len(prompts)}, after {learned.matched}/{len(prompts)}\n"
            f"figures: {out / 'before_after.png'}, {out / 'loss.png'}")


def _training_images(prompts: list[PromptSpec], data_dir: Path) -> list[Path]:
    by_caption = {p.read_text(encoding="utf-8").strip(): p.with_suffix(".png")
                  for p in data_dir.glob("*.txt") if p.name != "prompts.txt"}
    return [by_caption[p.prompt] for p in prompts]


def _row(paths: list[Path]) -> Image.Image:
    images = [Image.open(p).convert("RGB") for p in paths]
    w, h = images[0].size
    row = Image.new("RGB", (w * len(images), h), "white")
    for i, im in enumerate(images):
        row.paste(im.resize((w, h)), (i * w, 0))
    return row
