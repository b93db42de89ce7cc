"""The one owner of everything written as a run's result: LoRA files and their metadata.

LoRA files are written atomically (temporary file, then rename) in the configured key layout,
with safetensors metadata saying what they are. Exact-resume state (optimizer, RNG, sampler
position) lives here too as it is added, so no other part of the code writes checkpoints.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from difftune import __version__
from difftune.adapters.formats import merged_adapter_metadata, save_lora
from difftune.adapters.lora import lora_state
from difftune.config import RunConfig
from difftune.errors import ConfigError
from difftune.families.base import Components, Family
from difftune.precision import DTYPES

log = logging.getLogger("difftune")


def refuse_overwrite(cfg: RunConfig) -> None:
    """Stop before anything heavy when save.dir already holds LoRA files we would replace."""
    out = cfg.save.dir
    if cfg.save.overwrite or not out.is_dir():
        return
    existing = sorted(p.name for p in out.glob("*.safetensors"))
    if existing:
        raise ConfigError(
            f"save.dir {out} already holds LoRA files ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); difftune never overwrites what a run made. "
            "Choose a new save.dir, or set save.overwrite = true"
        )


class CheckpointManager:
    """Writes the LoRA (every N steps and at the end) and the resolved config."""

    def __init__(self, cfg: RunConfig, family: Family, comps: Components, targets: list[str],
                 dataset_summary: dict[str, Any]) -> None:
        self.cfg, self.family, self.comps = cfg, family, comps
        self.out: Path = cfg.save.dir
        self.base_name, self.targets = comps.name, targets
        self.dataset_summary = dataset_summary

    def write_config(self) -> Path:
        """The resolved config as JSON (every default filled in)."""
        path = self.out / "config.resolved.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.cfg.model_dump(mode="json"), indent=2), encoding="utf-8")
        return path

    def lora_path(self, step: int, final: bool) -> Path:
        """`<name>.safetensors` at the end, `<name>-step000123.safetensors` before."""
        name = self.cfg.save.name
        return self.out / (f"{name}.safetensors" if final else f"{name}-step{step:06d}.safetensors")

    def metadata(self, step: int) -> dict[str, str]:
        """What the file is: family, base, rank, alpha, targets, steps, data, version."""
        a = self.cfg.adapter
        return {
            "difftune.version": __version__,
            "difftune.family": self.family.name,
            "difftune.base_model": self.base_name,
            "difftune.format": self.cfg.save.format,
            "difftune.rank": str(a.rank),
            "difftune.alpha": str(a.scale_alpha),
            "difftune.targets": json.dumps(self.targets),
            "difftune.text_encoders": json.dumps(a.text_encoders),
            "difftune.steps": str(step),
            "difftune.dataset": json.dumps(self.dataset_summary),
            "ss_network_dim": str(a.rank),
            "ss_network_alpha": str(a.scale_alpha),
        }

    def save_lora(self, model: torch.nn.Module, step: int, final: bool = False) -> Path:
        """Export the LoRA of `model` in the configured format; returns the file."""
        a = self.cfg.adapter
        prefixes = [self.family.denoiser_prefix]
        state = lora_state(model, prefixes[0])
        for name in a.text_encoders:
            prefixes.append(self.family.text_encoder_prefixes[name])
            state.update(lora_state(self.comps.text_encoders[name], prefixes[-1]))
        meta = self.metadata(step)
        if self.cfg.save.format == "diffusers":
            meta.update(merged_adapter_metadata(state, a.rank, a.scale_alpha, prefixes))
        tensors = self.family.lora_to_format(self.comps, state, self.cfg.save.format, a.rank,
                                             a.scale_alpha)
        path = save_lora(self.lora_path(step, final), tensors, meta, DTYPES[self.cfg.save.dtype])
        log.info("saved LoRA %s", path)
        return path
