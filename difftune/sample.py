"""Sample images during training from a prompt file, without ever stopping training.

Prompt files use the kohya option syntax, one prompt a line:
`a red circle --n blurry --w 512 --h 512 --s 20 --d 42 --g 3.5 --l 1.0`
(`--w/--h` size, `--s` steps, `--d` seed, `--g` distilled guidance, `--l` CFG scale, `--n`
negative prompt); `#` starts a comment. The file is read at every sample event. Prompt
embeddings come from the text source (memoized by content, encoded on demand when new).
"""

from __future__ import annotations

import logging
import random
import re
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from difftune.config import SampleConfig

if TYPE_CHECKING:
    from difftune.cache.sources import TextSource
    from difftune.families.base import Components, Family
    from difftune.precision import PrecisionPolicy
    from difftune.report import Reporter

log = logging.getLogger("difftune")

_OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "d": ("seed", int),
            "g": ("guidance", float), "l": ("cfg", float), "n": ("negative", str)}


@dataclass(frozen=True)
class PromptSpec:
    """One prompt to sample, with every option resolved."""

    prompt: str
    negative: str
    width: int
    height: int
    steps: int
    seed: int
    guidance: float
    cfg: float


def parse_line(line: str, default: PromptSpec) -> PromptSpec:
    """Parse one prompt line; raises ValueError naming the bad option."""
    parts = re.split(r"\s--(?=[a-zA-Z])", " " + line)
    spec = replace(default, prompt=parts[0].strip())
    for part in parts[1:]:
        flag, _, value = part.partition(" ")
        if flag not in _OPTIONS:
            raise ValueError(f"unknown option --{flag} (known: --w --h --s --d --g --l --n)")
        field, kind = _OPTIONS[flag]
        try:
            spec = replace(spec, **{field: kind(value.strip())})
        except ValueError:
            raise ValueError(f"--{flag} needs a {kind.__name__}, got {value.strip()!r}") from None
    if not spec.prompt:
        raise ValueError("empty prompt")
    return spec


def read_prompts(path: Path, default: PromptSpec) -> list[PromptSpec]:
    """All valid prompts of a file; bad lines are skipped with a warning naming file and line."""
    if not path.is_file():
        log.warning("sample prompt file %s does not exist; no samples this time", path)
        return []
    specs = []
    for number, raw in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            specs.append(parse_line(line, default))
        except ValueError as err:
            log.warning("%s:%d: skipped prompt line: %s", path, number, err)
    if not specs:
        log.warning("sample prompt file %s holds no prompts; no samples this time", path)
    return specs


def slug(text: str, length: int = 40) -> str:
    """A file-name-safe short form of a prompt."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:length] or "prompt"


def grid(images: list[Image.Image], columns: int = 4) -> Image.Image:
    """Tile images (resized to the first one's size) into a grid."""
    w, h = images[0].size
    cols = min(columns, len(images))
    rows = (len(images) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        sheet.paste(img.resize((w, h)), ((i % cols) * w, (i // cols) * h))
    return sheet


class _RngGuard:
    """Save and restore every RNG (python, numpy, torch CPU and CUDA) around sampling."""

    def __enter__(self) -> None:
        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                       torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def __exit__(self, *exc: Any) -> None:
        py, npy, cpu, cuda = self.states
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class SampleRunner:
    """Generates the sample images of one event; failures are logged, never raised."""

    def __init__(self, family: "Family", comps: "Components", texts: "TextSource",
                 cfg: SampleConfig, out_dir: Path, default_size: tuple[int, int],
                 policy: "PrecisionPolicy", reporter: "Reporter | None" = None) -> None:
        self.family, self.comps, self.texts, self.cfg = family, comps, texts, cfg
        self.out_dir, self.policy, self.reporter = out_dir, policy, reporter
        w, h = default_size
        scale = cfg.cfg if cfg.cfg is not None else family.default_cfg
        self.default = PromptSpec("", "", cfg.width or w, cfg.height or h, cfg.steps, cfg.seed,
                                  cfg.guidance, scale)
        self._pipe: Any = None

    def prompts(self) -> list[PromptSpec]:
        """The prompt file as it is now (re-read at every event)."""
        return read_prompts(self.cfg.prompts, self.default) if self.cfg.prompts else []

    def run(self, step: int, specs: list[PromptSpec] | None = None,
            out_dir: Path | None = None) -> list[Path]:
        """Sample every prompt; returns the PNGs written. Never raises."""
        try:
            specs = self.prompts() if specs is None else specs
            if not specs:
                return []
            with _RngGuard():
                return self._run(step, specs, out_dir or self.out_dir)
        except Exception as err:  # sampling must never stop training
            log.debug("sampling at step %d failed:\n%s", step, traceback.format_exc())
            log.warning("sampling at step %d failed and was skipped (training goes on): %s: %s",
                        step, type(err).__name__, err)
            return []

    def _run(self, step: int, specs: list[PromptSpec], out_dir: Path) -> list[Path]:
        # Every module that may carry a LoRA (denoiser, trained encoders) samples in eval mode
        # and is put back in the mode it was in.
        modules = [self.comps.denoiser, *self.comps.text_encoders.values()]
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        out_dir.mkdir(parents=True, exist_ok=True)
        paths, images = [], []
        try:
            for i, spec in enumerate(specs):
                image = self.generate(spec)
                path = out_dir / f"step-{step:06d}_{i:02d}_{slug(spec.prompt)}.png"
                image.save(path)
                paths.append(path)
                images.append(image)
        finally:
            for m, mode in zip(modules, modes):
                m.train(mode)
        sheet = grid(images)
        sheet.save(out_dir / f"step-{step:06d}_grid.png")
        if self.reporter is not None:
            self.reporter.image("samples", np.asarray(sheet), step)
        return paths

    def _size(self, spec: PromptSpec) -> tuple[int, int]:
        step = self.family.bucket_step
        w, h = max(step, spec.width // step * step), max(step, spec.height // step * step)
        if (w, h) != (spec.width, spec.height):
            log.warning("sample size %dx%d is not a multiple of %d; using %dx%d",
                        spec.width, spec.height, step, w, h)
        return w, h

    @torch.no_grad()
    def generate(self, spec: PromptSpec) -> Image.Image:
        """One image for one prompt, through the family's diffusers pipeline."""
        if self._pipe is None:
            self._pipe = self.family.pipeline(self.comps)
        device, dtype = self.policy.device, self.comps.denoiser.dtype
        embeds = self.texts.get([spec.prompt]).to(device, dtype)
        negative = self.texts.get([spec.negative]).to(device, dtype) if spec.cfg > 1.0 else None
        kwargs = self.family.pipeline_inputs(embeds, negative, spec.guidance, spec.cfg)
        width, height = self._size(spec)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        with self.policy.autocast():
            result = self._pipe(**kwargs, width=width, height=height,
                                num_inference_steps=spec.steps, generator=generator)
        return result.images[0]
