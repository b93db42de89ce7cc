"""`difftune sample`: images from the base model and zero or more LoRAs, without training.

LoRA files are loaded by diffusers' own loader on the family's pipeline (denoiser and text
encoders), each as a named adapter with its weight. A file in a layout the family converts
(kohya/ComfyUI, FLUX.2's original names) is first read into diffusers names by the family's own
reader, the exact inverse of what difftune writes (`Family.lora_from_format`): diffusers'
converters assume the full-size models' shapes and skip or refuse some modules (its FLUX kohya
converter asserts on a fused `linear1` of another width and drops the non-block layers), so a
file would sample otherwise than it trained. Files in diffusers names, and layouts only
diffusers' converters read, go to diffusers as they are. LoHa, LoKr, DoRA and `lycoris_`-named
files, which diffusers does not read, are applied through the LyCORIS library's own modules.
A LoRA difftune trained for another family that this one reads (Chroma: FLUX.1's) is read by
its own family's reader and renamed first (`adapters.across`); other families' are refused.
Prompt embeddings are encoded with the LoRA'd text encoders into a fresh in-memory cache: a
disk cache keyed by the base model must never hold outputs of a LoRA'd encoder.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from difftune import families
from difftune.adapters.dora_comfyui import refuse_comfyui_file
from difftune.adapters.fit import check_fit, component_modules
from difftune.adapters.across import layout_source, lora_source, module_names, read_across
from difftune.adapters.formats import (LORA_B, describe_non_finite, load_lora_file, non_finite,
                                       split_lora_key)
from difftune.cache import MemoryStore
from difftune.cache.sources import TextSource
from difftune.config import RunConfig
from difftune.errors import CheckpointError, ConfigError, NonFiniteError
from difftune.adapters.lycoris_files import apply_file, needs_lycoris
from difftune.families import registry
from difftune.families.base import Components, Family
from difftune.families.specs import LoraSource
from difftune.families.common.text import EncodeOptions, model_clip_roots
from difftune.files.safe import is_pickle, pickle_refusal
from difftune.precision import lowbit
from difftune.precision.policy import PrecisionPolicy, resolve_device
from difftune.sample.runner import SampleRunner
from difftune.train.experts import expert_part, set_boundary

log = logging.getLogger("difftune")


@dataclass(frozen=True)
class LoraArg:
    """One `--lora PATH[:WEIGHT]` argument."""

    path: Path
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "LoraArg":
        """`PATH` or `PATH:WEIGHT`; a colon not followed by a number belongs to the path."""
        head, sep, tail = text.rpartition(":")
        if sep:
            try:
                return cls(Path(head).expanduser(), float(tail))
            except ValueError:
                pass
        return cls(Path(text).expanduser())

    def check(self, family: str) -> LoraSource | None:
        """Refuse a missing, pickle, non-safetensors or non-finite file, or one difftune
        trained for another family than `family` that `family` does not read, with the fix;
        returns the declared source of a file of another family (None: `family`'s own)."""
        if is_pickle(self.path):
            raise CheckpointError(pickle_refusal(self.path))
        if not self.path.is_file():
            raise CheckpointError(f"--lora {self.path}: no such file; give the path of a "
                                  ".safetensors LoRA (optionally PATH:WEIGHT)")
        if self.path.suffix.lower() != ".safetensors":
            raise CheckpointError(f"--lora {self.path}: not a .safetensors file")
        tensors, meta = load_lora_file(self.path)
        refuse_comfyui_file("--lora", self.path, meta)
        source = lora_source("--lora", self.path, meta, registry.spec(family))
        bad = non_finite(tensors)
        if bad:  # it would turn every image black
            raise NonFiniteError(f"--lora {self.path}: {describe_non_finite(bad)}; the LoRA is "
                                 "broken (its training diverged). Use one saved before that "
                                 "(an earlier -stepNNNNNN file or checkpoint)")
        return source


def run_sample(cfg: RunConfig, loras: list[LoraArg], prompts: Path | None,
               out: Path | None) -> list[Path]:
    """Load the base model, apply the LoRAs, sample every prompt; returns the PNGs written."""
    sources = {lora: lora.check(cfg.model.family) for lora in loras}
    prompts = prompts or cfg.sample.prompts
    if prompts is None:
        raise ConfigError("no prompts: pass --prompts FILE or set sample.prompts in the config")
    family = families.get(cfg.model.family, cfg.model.variant)
    policy = PrecisionPolicy.from_config(cfg.precision, resolve_device(cfg.train.device))
    comps = family.load(cfg.model, policy)
    set_boundary(cfg, comps.denoiser)
    lowbit.apply_to_components(comps, family, policy, cfg.precision.quantize)
    across = _read_across(comps, family, sources)
    for lora in loras:
        tensors, metadata = load_lora_file(lora.path)
        tensors = across.get(lora, tensors)  # another family's file: its translated factors
        check_fit(f"--lora {lora.path}", tensors, family, comps, metadata)
    options = EncodeOptions(t5_mask=cfg.model.t5_mask, clip_skip=cfg.model.clip_skip)
    texts = TextSource(family, comps, MemoryStore(), options)
    res = max(cfg.datasets[0].resolutions)
    settings = cfg.sample.model_copy(update={"prompts": prompts})
    runner = SampleRunner(family, comps, texts, settings, out or cfg.save.dir / "samples",
                          (res, res), policy)
    lycoris = [lora for lora in loras
               if lora not in across and needs_lycoris(load_lora_file(lora.path)[0])]
    networks = [net for lora in lycoris for net in _apply_lycoris(family, comps, lora)]
    plain = [(lora, across[lora] if lora in across else _converted(family, comps, lora.path))
             for lora in loras if lora not in lycoris]
    runner.use_pipeline(_pipeline_with(family, family.pipeline(comps), plain))
    log.debug("%d LyCORIS network(s) applied", len(networks))
    specs = runner.prompts()
    label = time.strftime("sample-%Y%m%d-%H%M%S")
    return runner.run(0, specs, label=label) if specs else []


def _read_across(comps: Components, family: Family,
                 sources: dict[LoraArg, LoraSource | None]
                 ) -> dict[LoraArg, dict[str, torch.Tensor]]:
    """{LoRA: its tensors in this family's diffusers names} of the files of another family
    that this one reads (`FamilySpec.lora_sources`; by their metadata, or by a layout only
    such a family's reader reads), the modules this model lacks named in warnings and left
    out."""
    present = module_names(component_modules(family, comps))
    out = {}
    for lora, source in sources.items():
        tensors, meta = load_lora_file(lora.path)
        source = source or layout_source(family, comps, tensors)
        if source is not None:
            out[lora] = read_across("--lora", lora.path, tensors, meta, source, comps, present)
    return out


def _apply_lycoris(family: Family, comps: Components, lora: LoraArg) -> list[object]:
    """A LoHa/LoKr/DoRA/LyCORIS-named file applied through the LyCORIS library (diffusers
    reads none of them), on the denoiser and text encoders, at the argument's weight."""
    try:
        networks = apply_file(family, component_modules(family, comps),
                              model_clip_roots(family, comps), load_lora_file(lora.path)[0],
                              lora.weight)
    except (RuntimeError, KeyError, ValueError) as err:  # what `check_fit` cannot foresee
        raise CheckpointError(f"--lora {lora.path} could not be applied to this model "
                              f"({type(err).__name__}: {err}); check that it was trained for "
                              "this family and base model") from None
    if not networks:
        raise CheckpointError(f"--lora {lora.path}: none of its modules is in this model; check "
                              "that it was trained for this family and base model")
    log.info("applied LyCORIS file %s at weight %g", lora.path, lora.weight)
    return networks


def _converted(family: Family, comps: Components, path: Path) -> dict[str, torch.Tensor] | None:
    """A file in a layout the family reads into diffusers names (kohya, original) as those
    tensors, each module's alpha / rank folded into its up factor (diffusers then takes alpha
    = rank, the same update); None for a file already in diffusers names (diffusers reads it
    and its metadata) or in a layout the family's reader does not know."""
    tensors = load_lora_file(path)[0]
    try:
        state, alphas = family.lora_from_format(comps, tensors)
    except CheckpointError:
        return None
    if state.keys() == tensors.keys():
        return None
    out = {}
    for key, value in state.items():
        module, suffix = split_lora_key(key)
        scale = alphas[module] / value.shape[1] if suffix == LORA_B and module in alphas else 1.0
        out[key] = value * scale if scale != 1.0 else value
    return out


def _pipeline_with(family: Family, pipe: object,
                   loras: list[tuple[LoraArg, dict[str, torch.Tensor] | None]]) -> object:
    """The pipeline with each LoRA loaded by diffusers as an adapter, at its weight: from the
    tensors our reader made of it where there are some (`_converted`), else from its file."""
    names = []
    for i, (lora, tensors) in enumerate(loras):
        name = f"lora{i}"
        source = tensors if tensors is not None else str(lora.path)
        part = expert_part(family, lora.path)
        try:
            family.load_pipeline_lora(pipe, source, name, part)
        except (ValueError, KeyError, RuntimeError, OSError, AssertionError) as err:
            # AssertionError: diffusers' converters assert on shapes they do not expect
            raise CheckpointError(
                f"--lora {lora.path} could not be loaded for this model ({type(err).__name__}: "
                f"{err}); check that it was trained for this family and base model") from None
        names.append(name)
        log.info("loaded LoRA %s at weight %g", lora.path, lora.weight)
    if names:
        pipe.set_adapters(names, [lora.weight for lora, _ in loras])  # type: ignore[attr-defined]
    return pipe
