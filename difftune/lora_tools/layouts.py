"""The model a LoRA's original names are read and written against, for the families whose
original (kohya/ComfyUI) names depend on the model's layout (SDXL's and SD 1.5's block
numbering, SD3's depth): their keys.py lists the released models' denoiser configs
(`RELEASED_LAYOUTS`).

A candidate is the family's tiny flavor with its denoiser swapped for one built from a config
on the meta device (module names and shapes, no weights, under a second even at full size),
so the family's own readers and writers work on it unchanged. Without `--base` the candidates
are the released configs, and the first whose modules and widths fit every module of the file
is used (a file of another model fits none: its widths differ); with `--base` the config is
the given model's (`<folder>/<denoiser part>/config.json`, `config.json` in the denoiser's own
folder, or derived from an original single file's tensor shapes by the family's keys.py
`single_file_config`).
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from difftune.errors import ConfigError
from difftune.families import registry
from difftune.families.base import Components
from difftune.lora_tools.names import family_keys, tiny_components

# Where single files put the denoiser's tensors: a whole checkpoint's, ComfyUI's
# diffusion_models/ files, or at the root.
_ROOTS = ("model.diffusion_model.", "diffusion_model.", "")


def released(family: str) -> dict[str, dict[str, Any]]:
    """{released model: denoiser config} of a family whose original names need a layout
    ({} for the others: their tiny flavor's names serve any model of theirs)."""
    return getattr(family_keys(family), "RELEASED_LAYOUTS", {})


@lru_cache(maxsize=8)
def _model(family: str, config: str) -> Components:
    """The tiny flavor of `family` with a meta-device denoiser of `config` (JSON text)."""
    tiny = tiny_components(family)
    with torch.device("meta"):
        denoiser = type(tiny.denoiser).from_config(json.loads(config))
    return dataclasses.replace(tiny, denoiser=denoiser)


def model(family: str, config: dict[str, Any]) -> Components:
    """Components to read and write `family`'s LoRA names against, with `config`'s denoiser."""
    return _model(family, json.dumps(config, sort_keys=True))


def _file_config(family: str, base: Path) -> dict[str, Any]:
    """The denoiser config of an original-layout single file (the whole checkpoint or the
    denoiser alone), derived by the family's keys.py from the tensors' shapes (read from the
    header: no weights are loaded)."""
    try:
        with safe_open(str(base), framework="pt", device="cpu") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ConfigError(f"--base {base}: not a readable .safetensors file ({err}); give "
                          "the model's single file or its diffusers folder") from None
    root = max(_ROOTS, key=lambda r: sum(k.startswith(r) for k in shapes))
    sd = {k[len(root):]: torch.empty(s, device="meta") for k, s in shapes.items()
          if k.startswith(root)}
    try:
        return family_keys(family).single_file_config(sd)
    except (KeyError, StopIteration, IndexError, ValueError, AttributeError):
        raise ConfigError(f"--base {base}: not a {family} model in its original single-file "
                          "layout; give that, or the model's diffusers folder") from None


def base_config(family: str, base: Path) -> dict[str, Any]:
    """The denoiser config of `base`: a diffusers model folder (or its denoiser's own folder)
    or an original-layout single file; anything else is refused naming what `--base` takes."""
    if base.is_file():
        return _file_config(family, base)
    part = registry.spec(family).denoiser_part
    for path in (base / part / "config.json", base / "config.json"):
        if path.is_file():
            config = json.loads(path.read_text())
            if "_class_name" in config:  # a diffusers model's config
                return {k: v for k, v in config.items() if not k.startswith("_")}
    raise ConfigError(f"--base {base}: not a {family} model folder (no {part}/config.json or "
                      "config.json in it) nor file; give the diffusers folder or the single "
                      "file of the model the LoRA was trained on")


def candidates(family: str, base: Path | None) -> list[tuple[str, Components]]:
    """(where the layout comes from, the model) to try, in order."""
    if base is not None:
        return [(f"--base {base}", model(family, base_config(family, base)))]
    return [(name, model(family, config)) for name, config in released(family).items()]


def misfit(state: dict[str, torch.Tensor], comps: Components, prefix: str) -> str | None:
    """The first of a diffusers-named LoRA's modules that `comps`' denoiser lacks or is
    not as wide as, said in words; None when all fit."""
    layers = dict(comps.denoiser.named_modules())
    for key, value in state.items():
        module, _, factor = key.removeprefix(f"{prefix}.").rpartition(".lora_")
        weight = getattr(layers.get(module), "weight", None)
        if weight is None:
            return f"it has no module {module}"
        axis, want = (1, value.shape[1]) if factor == "A.weight" else (0, value.shape[0])
        if weight.shape[axis] != want:
            return f"{module} is {weight.shape[axis]} wide there, {want} in the file"
    return None
