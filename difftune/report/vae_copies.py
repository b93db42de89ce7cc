"""Each training image as the model itself would copy it: through its VAE and back.

What a run trains towards is an image's cached latent, and a sample is a decoded latent: the
closest a sample can come to training image T is the decode of T's own latent, its VAE copy.
The memorization rule (report/sample_metrics.py) compares samples with these copies, not with
T: a sample that reproduces T's latent is a copy even where the VAE loses more of T than a
JPEG would (the tiny flavor's VAE keeps a demo image only to 0.92-0.975 of itself under the
tiny DINOv2, below every degraded copy's similarity; docs/training-signal.md). For a real
model's VAE the copy is close to T and the rule is nearly the one against T itself.

The copies are made once in the training process (where the VAE is), from the pixels the
latent cache encodes (the item's bucket and crop, unflipped), and kept as PNG files under
`cache.dir/vae_copies`, named by the latent entry's key (the image's bytes, the model, its
dtype, the bucket and crop); `<save.dir>/vae_copies.json` lists them for `difftune runs rank`,
which measures a run's samples without loading its model.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from difftune.cache.keys import entry_key, latent_fields
from difftune.data.images import load_pixels

if TYPE_CHECKING:
    from difftune.train.setup import Run

log = logging.getLogger("difftune")

INDEX = "vae_copies.json"  # in the run's folder: training image -> its VAE copy


@torch.no_grad()
def round_trip(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 3, H, W) in [-1, 1] -> the VAE's decode of their encoding's mode, (B, 3,
    H, W) in [-1, 1] on the CPU in float32. Any diffusers autoencoder: a video one gets a
    one-frame axis, an RGBA one an opaque alpha channel; an fp16 one runs in float32 (SDXL's
    overflows in fp16), its weights cast back afterwards."""
    param = next(vae.parameters())
    half = param.dtype == torch.float16
    if half:
        vae.float()
    try:
        dtype = next(vae.parameters()).dtype
        x = pixels.to(param.device, dtype)
        if getattr(vae.config, "in_channels", 3) == 4:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        frames = _has_frame_axis(vae)
        if frames:
            x = x.unsqueeze(2)
        z = vae.encode(x).latent_dist.mode()
        y = vae.decode(z, return_dict=False)[0]
    finally:
        if half:
            vae.half()
    y = y[:, :, 0] if frames else y
    return y[:, :3].float().clamp(-1, 1).cpu()


def _has_frame_axis(vae: torch.nn.Module) -> bool:
    """A video autoencoder (Wan's, Qwen-Image's): 3D convolutions or a temporal scale in its
    config; it encodes (B, C, F, H, W)."""
    config = getattr(vae, "config", {})
    return (any(k in config for k in ("temperal_downsample", "scale_factor_temporal"))
            or any(isinstance(m, torch.nn.Conv3d) for m in vae.modules()))


def to_image(pixels: torch.Tensor) -> Image.Image:
    """(3, H, W) in [-1, 1] -> an RGB image (as the pipelines round to 8 bits)."""
    array = ((pixels.permute(1, 2, 0).numpy() + 1) * 127.5).round().clip(0, 255)
    return Image.fromarray(array.astype(np.uint8))


def _copy_file(run: "Run", index: int, folder: Path) -> Path:
    """The VAE copy of item `index` (made and stored unless its file exists)."""
    item, latents = run.data.items[index], run.latents
    box = latents.box(index)
    fields = latent_fields(family=run.family.name, fingerprint=run.comps.fingerprint,
                           dtype=latents.dtype, image=item.path, bucket=item.bucket, box=box,
                           flip=False)
    path = folder / f"{entry_key({**fields, 'kind': 'vae_copy'})}.png"
    if not path.is_file():
        pixels = load_pixels(item.path, item.bucket, box, False)
        image = to_image(round_trip(run.comps.vae, pixels[None])[0])
        folder.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        image.save(part, format="PNG")
        os.replace(part, path)
    return path


def make_copies(run: "Run", training: list[Path]) -> list[Path]:
    """The VAE copy of each of `training` (the run's distinct training images, in order; a
    video clip is its own reference), stored under `cache.dir/vae_copies` (`write_index`
    lists them in the run folder). The VAE is on the run's device meanwhile."""
    assert run.cfg.cache.dir is not None  # set when the config loads
    first: dict[Path, int] = {}
    for i, it in enumerate(run.data.items):
        if not it.regularization and it.clip is None:
            first.setdefault(it.path, i)
    started, vae = time.perf_counter(), run.comps.vae
    home = next(vae.parameters()).device
    vae.to(run.policy.device)
    try:
        folder = run.cfg.cache.dir / "vae_copies"
        copies = [_copy_file(run, first[p], folder) if p in first else p for p in training]
    finally:
        vae.to(home)
    log.info("metrics: VAE copies of %d training images ready in %.2f s (what a copy by this "
             "model is compared with)", len(first), time.perf_counter() - started)
    return copies


def run_copies(run: "Run", training: list[Path]) -> list[Path] | None:
    """A training run's VAE copies (`make_copies`), listed in its folder; None, with a
    warning, when they cannot be made (the VAE failing on an image, a full disk): memorization
    then compares with the images themselves, and the run goes on."""
    try:
        copies = make_copies(run, training)
        write_index(run.cfg.save.dir, training, copies)
    except (OSError, RuntimeError, ValueError) as err:
        log.warning("metrics: the training images' VAE copies could not be made (%s: %s); "
                    "memorization compares samples with the images themselves",
                    type(err).__name__, err)
        return None
    return copies


def write_index(run_dir: Path, training: list[Path], copies: list[Path]) -> None:
    """List each training image's VAE copy in the run folder (for `difftune runs rank`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({str(t): str(c) for t, c in zip(training, copies)}, indent=1)
    part = run_dir / f".{INDEX}.part"
    part.write_text(text, encoding="utf-8")
    os.replace(part, run_dir / INDEX)


def read_index(run_dir: Path, training: list[Path]) -> list[Path] | None:
    """The VAE copies a run listed for `training`, or None where the run kept none (a run
    without metrics) or one is missing (then the training images themselves are the
    reference)."""
    try:
        listed = json.loads((run_dir / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    copies = [Path(listed[str(t)]) if isinstance(listed, dict) and str(t) in listed else None
              for t in training]
    if any(c is None or not c.is_file() for c in copies):
        return None
    return [c for c in copies if c is not None]
