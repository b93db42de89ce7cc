"""`difftune sample`: images from the base model and zero or more LoRAs, without training.

LoRA files are read by diffusers' own loader on the family's pipeline (diffusers/PEFT or kohya
/ComfyUI layouts, denoiser and text encoders), each as a named adapter with its weight, so a
file samples here exactly as it will in diffusers. LoHa, LoKr, DoRA and `lycoris_`-named files,
which diffusers does not read, are applied through the LyCORIS library's own modules. Prompt embeddings are encoded with the
LoRA'd text encoders into a fresh in-memory cache: a disk cache keyed by the base model must
never hold outputs of a LoRA'd encoder.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from difftune import families
from difftune.adapters.dora_comfyui import refuse_comfyui_file
from difftune.adapters.fit import check_fit, component_modules
from difftune.adapters.formats import describe_non_finite, load_lora_file, non_finite
from difftune.cache import MemoryStore
from difftune.cache.sources import TextSource
from difftune.config import RunConfig
from difftune.errors import CheckpointError, ConfigError, NonFiniteError
from difftune.adapters.lycoris_files import apply_file, needs_lycoris
from difftune.families.base import Components, Family
from difftune.families.common.text import EncodeOptions, model_clip_roots
from difftune.files.safe import is_pickle, pickle_refusal
from difftune.precision import lowbit
from difftune.precision.policy import PrecisionPolicy, resolve_device
from difftune.sample.runner import SampleRunner

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

    def check(self) -> None:
        """Refuse a missing, pickle, non-safetensors or non-finite file with the fix."""
        if is_pickle(self.path):
            raise CheckpointError(pickle_refusal(self.path))
        if not self.path.is_file():
            raise CheckpointError(f"--lora {self.path}: no such file; give the path of a "
                                  ".safetensors LoRA (optionally PATH:WEIGHT)")
        if self.path.suffix.lower() != ".safetensors":
            raise CheckpointError(f"--lora {self.path}: not a .safetensors file")
        tensors, meta = load_lora_file(self.path)
        refuse_comfyui_file("--lora", self.path, meta)
        bad = non_finite(tensors)
        if bad:  # it would turn every image black
            raise NonFiniteError(f"--lora {self.path}: {describe_non_finite(bad)}; the LoRA is "
                                 "broken (its training diverged). Use one saved before that "
                                 "(an earlier -stepNNNNNN file or checkpoint)")


def run_sample(cfg: RunConfig, loras: list[LoraArg], prompts: Path | None,
               out: Path | None) -> list[Path]:
    """Load the base model, apply the LoRAs, sample every prompt; returns the PNGs written."""
    for lora in loras:
        lora.check()
    prompts = prompts or cfg.sample.prompts
    if prompts is None:
        raise ConfigError("no prompts: pass --prompts FILE or set sample.prompts in the config")
    family = families.get(cfg.model.family, cfg.model.variant)
    policy = PrecisionPolicy.from_config(cfg.precision, resolve_device(cfg.train.device))
    comps = family.load(cfg.model, policy)
    lowbit.apply_to_components(comps, family, policy, cfg.precision.quantize)
    for lora in loras:
        check_fit(f"--lora {lora.path}", load_lora_file(lora.path)[0], family, comps)
    options = EncodeOptions(t5_mask=cfg.model.t5_mask, clip_skip=cfg.model.clip_skip)
    texts = TextSource(family, comps, MemoryStore(), options)
    res = max(cfg.datasets[0].resolutions)
    settings = cfg.sample.model_copy(update={"prompts": prompts})
    runner = SampleRunner(family, comps, texts, settings, out or cfg.save.dir / "samples",
                          (res, res), policy)
    lycoris = [lora for lora in loras if needs_lycoris(load_lora_file(lora.path)[0])]
    networks = [net for lora in lycoris for net in _apply_lycoris(family, comps, lora)]
    runner.use_pipeline(_pipeline_with(family.pipeline(comps),
                                       [lora for lora in loras if lora not in lycoris]))
    log.debug("%d LyCORIS network(s) applied", len(networks))
    specs = runner.prompts()
    label = time.strftime("sample-%Y%m%d-%H%M%S")
    return runner.run(0, specs, label=label) if specs else []


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


def _pipeline_with(pipe: object, loras: list[LoraArg]) -> object:
    """The pipeline with each LoRA loaded by diffusers as an adapter, at its weight."""
    names = []
    for i, lora in enumerate(loras):
        name = f"lora{i}"
        try:
            pipe.load_lora_weights(str(lora.path), adapter_name=name)  # type: ignore[attr-defined]
        except (ValueError, KeyError, RuntimeError, OSError) as err:
            raise CheckpointError(
                f"--lora {lora.path} could not be loaded for this model ({type(err).__name__}: "
                f"{err}); check that it was trained for this family and base model") from None
        names.append(name)
        log.info("loaded LoRA %s at weight %g", lora.path, lora.weight)
    if names:
        pipe.set_adapters(names, [lora.weight for lora in loras])  # type: ignore[attr-defined]
    return pipe
