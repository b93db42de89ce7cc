"""Sample images during training from a prompt file, without ever stopping training.

The prompt file (`prompts.py`: kohya-style `.txt` or `.toml`) is read at every sample event, so
edits reach the next event. Prompt embeddings come from the text source: memoized by content,
encoded on demand when new (reloading unloaded text encoders once per event). A prompt that
fails is logged with its traceback in the run log and named once on the console; the others of
the event still render, and training goes on. A sample that comes out not finite (NaN) is named
in a warning and never written (cast to 8 bits it would be a black image). RNG states, module
modes and the VAE's device are put back afterwards, so a run with samples trains exactly as one
without.
"""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from difftune.cache.text_images import from_pil
from difftune.config import SampleConfig
from difftune.data.images import load_rgb
from difftune.report.sample_metrics import PROMPT_KEY, SEED_KEY
from difftune.data.video import round_frames
from difftune.sample.prompts import PromptSpec, parse_line, read_prompts  # noqa: F401 (re-exported)
from difftune.sample.video import write_clip
from difftune.train.rng import GlobalRngs

if TYPE_CHECKING:
    from difftune.cache.sources import TextSource
    from difftune.families.base import Components, Family
    from difftune.precision.policy import PrecisionPolicy
    from difftune.report.metrics import Reporter

log = logging.getLogger("difftune")


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
        self.states = GlobalRngs.capture()

    def __exit__(self, *exc: Any) -> None:
        self.states.restore()


def _failed(what: str, err: Exception) -> None:
    """The traceback to the run log, one line to the console."""
    log.debug("%s failed:\n%s", what, traceback.format_exc())
    log.warning("%s failed and was skipped (training goes on): %s: %s", what,
                type(err).__name__, err)


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
        # Polled before each image: a stop request (SIGTERM) ends an event after the
        # current image instead of after all of them.
        self.stop: Callable[[], bool] = lambda: False

    def use_pipeline(self, pipe: Any) -> None:
        """Sample through this pipeline (e.g. one with LoRAs loaded) instead of a new one."""
        self._pipe = pipe

    def prompts(self) -> list[PromptSpec]:
        """The prompt file as it is now (re-read at every event); prompts with more input
        images than the family takes are skipped with a warning."""
        specs = read_prompts(self.cfg.prompts, self.default) if self.cfg.prompts else []
        if self.family.start_image:
            return self._with_start(specs)
        most = self.family.control_images
        for spec in [s for s in specs if len(s.images) > most]:
            log.warning("sample prompt %r skipped: it names %d input image(s), but "
                        "model.family = \"%s\" takes %s", spec.prompt[:40], len(spec.images),
                        self.family.name, f"at most {most}" if most else "none")
        return [s for s in specs if len(s.images) <= most]

    def _with_start(self, specs: list[PromptSpec]) -> list[PromptSpec]:
        """An image-to-video family's prompts: those giving one input image, their start
        frame; the others are skipped with a warning naming the option."""
        for spec in [s for s in specs if len(s.images) != 1]:
            log.warning("sample prompt %r skipped: this model.family = \"%s\" variant "
                        "samples from a start image; give exactly one with --ci PATH "
                        "(\"images\" in a .toml prompt file), not %d", spec.prompt[:40],
                        self.family.name, len(spec.images))
        return [s for s in specs if len(s.images) == 1]

    def run(self, step: int, specs: list[PromptSpec] | None = None,
            out_dir: Path | None = None, label: str | None = None) -> list[Path]:
        """Sample every prompt; returns the PNGs written. Never raises.

        Files are named `<label>_II_<prompt>.png` (label: `step-NNNNNN` by default).
        """
        try:
            specs = self.prompts() if specs is None else specs
            if not specs:
                return []
            with _RngGuard(), self._sampling_state():
                return self._run(step, specs, out_dir or self.out_dir,
                                 label or f"step-{step:06d}")
        except Exception as err:  # sampling must never stop training
            _failed(f"sampling at step {step}", err)
            return []

    @contextlib.contextmanager
    def _sampling_state(self) -> Iterator[None]:
        """Eval mode for every module, the VAE (and an image encoder) on the device; all put
        back afterwards."""
        from difftune.families.base import start_encoders

        modules = [m for m in (self.comps.denoiser, self.comps.vae,
                               *self.comps.text_encoders.values()) if m is not None]
        modes = [m.training for m in modules]
        # offloaded after caching, needed to decode (and to encode a start image)
        moved = [self.comps.vae, *start_encoders(self.comps)]
        devices = [next(m.parameters()).device for m in moved]
        for m in modules:
            m.eval()
        for m in moved:
            m.to(self.policy.device)
        try:
            yield
        finally:
            for m, device in zip(moved, devices):
                m.to(device)
            for m, mode in zip(modules, modes):
                m.train(mode)

    def _run(self, step: int, specs: list[PromptSpec], out_dir: Path, label: str) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        self._prefill(specs)  # every new text of the event at once (one reload at most)
        paths, images = [], []
        for i, spec in enumerate(specs):
            if self.stop():
                log.info("sampling at step %d ends early (stop requested): %d of %d images",
                         step, len(paths), len(specs))
                break
            try:
                inputs = [load_rgb(p) for p in spec.images]
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
                log.warning("sample prompt %r skipped: an input image cannot be read (%s: %s)",
                            spec.prompt[:40], type(err).__name__, err)
                continue
            path = out_dir / f"{label}_{i:02d}_{slug(spec.prompt)}.png"
            try:
                image = self._sample(spec, inputs, path)
            except NonFiniteSample as err:
                log.warning("sample %d at step %d was not written: %s", i, step, err)
                continue
            except Exception as err:  # one bad prompt (a size, memory) spares the others
                _failed(f"sample {i} ({spec.prompt[:40]!r}) at step {step}", err)
                continue
            paths.append(path)
            images.append(image)
        if images:
            sheet = grid(images)
            sheet.save(out_dir / f"{label}_grid.png")
            if self.reporter is not None:
                self.reporter.image("samples", np.asarray(sheet), step)
        return paths

    def _seen(self, inputs: list[Image.Image]) -> tuple[Any, ...]:
        """The images the pipeline's text encoder reads with a prompt's texts (none for
        families whose encoders read no images), as text-cache key parts."""
        return tuple(from_pil(i) for i in self.family.pipeline_text_images(inputs))

    def _prefill(self, specs: list[PromptSpec]) -> None:
        """Encode the event's texts (each with the images its encoder reads) in one go; a
        prompt whose input image cannot be read is left to `_run`, which reports it."""
        texts: list[str] = []
        images: list[tuple[Any, ...]] = []
        for spec in specs:
            try:
                seen = self._seen([load_rgb(p) for p in spec.images]) if spec.images else ()
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
                continue
            for text in [spec.prompt] + ([spec.negative] if spec.cfg > 1.0 else []):
                texts.append(text)
                images.append(seen)
        self.texts.fill(texts, images=images)

    def _size(self, spec: PromptSpec) -> tuple[int, int]:
        step = self.family.bucket_step
        w, h = max(step, spec.width // step * step), max(step, spec.height // step * step)
        if (w, h) != (spec.width, spec.height):
            log.warning("sample size %dx%d is not a multiple of %d; using %dx%d",
                        spec.width, spec.height, step, w, h)
        return w, h

    def _sample(self, spec: PromptSpec, inputs: list[Image.Image], path: Path) -> Image.Image:
        """Sample one prompt and write it at `path` (a clip: also its mp4 and animated WebP
        beside it, sample/video.py); returns the image (a clip's first frame) for the grid."""
        if spec.frames == 1:
            image = self.generate(spec, inputs)
            image.save(path, pnginfo=_sample_info(spec))
            return image
        frames = self.generate_clip(spec, inputs)
        return write_clip(frames, path, self.family.fps or 16.0, _sample_info(spec))

    def _frames(self, spec: PromptSpec) -> int:
        """The prompt's frame count, rounded down to the family's rule (with a warning); 1
        for a family that samples images only (with a warning when the prompt asked more)."""
        rule = self.family.frame_rule
        if rule is None:
            if spec.frames != 1:
                log.warning("sample prompt %r: --f %d ignored, model.family = \"%s\" samples "
                            "images", spec.prompt[:40], spec.frames, self.family.name)
            return 1
        frames = round_frames(max(1, spec.frames), rule)
        if frames != spec.frames:
            log.warning("sample prompt %r: %d frames rounded down to %d (%dN+%d)",
                        spec.prompt[:40], spec.frames, frames, *rule)
        return frames

    @torch.no_grad()
    def generate(self, spec: PromptSpec, inputs: list[Image.Image] | None = None
                 ) -> Image.Image:
        """One image for one prompt (a clip's first frame), through the family's diffusers
        pipeline; `inputs` are the prompt's input images (decoded upright RGB), for an edit
        family's pipeline."""
        return VaeImageProcessor.numpy_to_pil(self.generate_clip(spec, inputs)[0])[0]

    @torch.no_grad()
    def generate_clip(self, spec: PromptSpec, inputs: list[Image.Image] | None = None
                      ) -> np.ndarray:
        """The frames of one prompt's sample, (F, H, W, 3) in [0, 1] (F = 1 for an image),
        through the family's diffusers pipeline (see `generate`)."""
        if self._pipe is None:
            self._pipe = self.family.pipeline(self.comps)
        device, dtype = self.policy.device, self.comps.denoiser.dtype
        # The images the pipeline's text encoder would read (none for most families).
        seen = [self._seen(inputs or [])]
        embeds = self.texts.get([spec.prompt], seen).to(device, dtype)
        negative = (self.texts.get([spec.negative], seen).to(device, dtype) if spec.cfg > 1.0
                    else None)
        kwargs = self.family.pipeline_inputs(embeds, negative, spec.guidance, spec.cfg)
        width, height = self._size(spec)
        kwargs.update(self.family.pipeline_images(inputs or [], width, height))
        kwargs.update(self.family.clip_inputs(self._frames(spec)))
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        with self.policy.autocast(), one_step_safe(self._pipe, spec.steps):
            result = self._pipe(**kwargs, width=width, height=height, output_type="np",
                                num_inference_steps=spec.steps, generator=generator)
        frames = self.family.pipeline_clip(result)
        if not np.isfinite(frames).all():  # cast to 8 bits, NaN would turn into black pixels
            raise NonFiniteSample(f"{spec.prompt[:60]!r} ({spec.width}x{spec.height}, "
                                  f"{spec.steps} steps) came out not finite (NaN or inf)")
        return frames


def _sample_info(spec: PromptSpec) -> PngInfo:
    """The prompt and seed written into a sample PNG (what `runs rank` and the metrics read
    back; the file name keeps only a slug of the prompt)."""
    info = PngInfo()
    info.add_itxt(PROMPT_KEY, spec.prompt)
    info.add_text(SEED_KEY, str(spec.seed))
    return info


class NonFiniteSample(ValueError):
    """A sample whose pixels are not all finite: never written as an image."""


@contextlib.contextmanager
def one_step_safe(pipe: Any, steps: int) -> Iterator[None]:
    """The pipeline with a scheduler that gives a one-step schedule finite sigmas.

    diffusers' FlowMatchEulerDiscreteScheduler with `shift_terminal` set (Qwen-Image's
    released config) stretches the sigmas so that the last one is `shift_terminal`, dividing
    by 1 - (the last sigma) (`stretch_shift_to_terminal`). With one step the only sigma is 1,
    so it divides by zero and every sigma is NaN ("invalid value encountered in divide"), and
    so is the image. One step from pure noise has no terminal sigma to move: the schedule is
    1 -> 0 with or without the stretch, so for one step the scheduler is used without it.
    (Two or more steps end below 1 for any shift the pipelines compute.)"""
    scheduler = getattr(pipe, "scheduler", None)
    if steps != 1 or not getattr(getattr(scheduler, "config", None), "shift_terminal", None):
        yield
        return
    pipe.scheduler = type(scheduler).from_config(scheduler.config, shift_terminal=None)
    try:
        yield
    finally:
        pipe.scheduler = scheduler
