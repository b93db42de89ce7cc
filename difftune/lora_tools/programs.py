"""What each program users load LoRAs in reads: ComfyUI and diffusers, as rules over a file's
modules (`keys.Module`).

The program-wide facts are here; the per-family facts are data in each family's keys.py:
- `COMFYUI_UNKNOWN` (where ComfyUI has no model of the family): why it reads no key.
- `COMFYUI_FORMS`: the prefixes (or (prefix, skipped names, why)) ComfyUI's model branch (comfy/lora.py `model_lora_keys_unet`)
  puts before the diffusers names its conversion table maps (comfy/utils.py
  `flux_to_diffusers`, `mmdit_to_diffusers`, `unet_to_diffusers`, `z_image_to_diffusers`,
  `krea2_to_diffusers`, or the model's own names); a prefix ending in "_" underscores them.
  The table's names are the diffusers modules the family's single-file layout maps, less
  those its `lora_unread` says ComfyUI drops in the "diffusers" layout.
- `COMFYUI_LOADS_NOTHING` (optional): why ComfyUI loads no model of the family (none of its
  LoRA keys can apply then).
- `DIFFUSERS_READS`: (prefix, naming, modules skipped (regex over diffusers names), why) for
  each spelling the family's diffusers LoRA loader (its `lora_state_dict` and the converter it
  calls) reads; other spellings it refuses or loads nothing of.
ComfyUI's rules were read from silveroxides/ComfyUI at 4f874c5e (tracking Comfy-Org/ComfyUI
master, 2026-07-29): its generic map reads `diffusion_model.<weight name>` and
`lora_unet_<weight name, dots as underscores>` over the model's own (original) names, and
`load_lora` with comfy/weight_adapter reads the tensor names in `COMFYUI_TENSORS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from difftune.families import registry
from difftune.lora_tools.keys import TENSOR_NAMES
from difftune.lora_tools.names import DIFFUSERS, ORIGINAL, family_keys

COMFYUI_VERSION = "4f874c5e: comfy/lora.py, comfy/weight_adapter"
COMFYUI_TENSORS = frozenset(TENSOR_NAMES) - {"lora_magnitude_vector"}  # PEFT's DoRA name
COMFYUI_GENERIC = (("diffusion_model.", ORIGINAL), ("lora_unet_", ORIGINAL))
# The tensors diffusers' loaders turn into PEFT LoRA layers (PEFT's names, and kohya's which
# its converters rename): LoRA factors, alphas and DoRA magnitudes.
DIFFUSERS_TENSORS = frozenset(("lora_A.weight", "lora_B.weight", "lora_down.weight",
                               "lora_up.weight", "alpha", "dora_scale",
                               "lora_magnitude_vector"))
DIFFUSERS_FACTORS = (("lora_A.weight", "lora_B.weight"), ("lora_down.weight", "lora_up.weight"))


@dataclass(frozen=True)
class ReadRule:
    """One spelling a program reads: prefix and naming, the modules it skips, and why."""

    prefix: str
    naming: str
    skips: str = ""
    why: str = ""


@dataclass(frozen=True)
class Program:
    """What one program reads of a family's files."""

    name: str
    rules: tuple[ReadRule, ...]
    tensors: frozenset[str]
    counts: str  # "keys" (ComfyUI reports each key) or "modules" (layers diffusers adapts)
    # Why the program loads no model of the family ("": it does); every key is dropped then.
    absent: str = ""


def comfyui_loads_nothing(family: str) -> str:
    """Why ComfyUI loads no model of `family` (its keys.py `COMFYUI_LOADS_NOTHING`); "" where
    it does. Messages naming the programs that read a layout say so instead of naming it."""
    return str(getattr(family_keys(family), "COMFYUI_LOADS_NOTHING", ""))


def comfyui(family: str) -> Program:
    """ComfyUI's rules for `family`: its generic map over original names, and its model
    branch's forms over the diffusers names (minus `lora_unread`'s ComfyUI entries, and a
    form's own skips: an entry of `COMFYUI_FORMS` is a prefix or (prefix, skipped, why))."""
    unread = [(pattern, why) for layout, reader, pattern, why in registry.spec(family).lora_unread
              if layout == DIFFUSERS and reader == "ComfyUI"]
    rules = [ReadRule(p, n) for p, n in COMFYUI_GENERIC]
    absent = comfyui_loads_nothing(family)
    for form in family_keys(family).COMFYUI_FORMS:
        prefix, *own = (form,) if isinstance(form, str) else form
        skips = unread + ([tuple(own)] if own else [])
        rules.append(ReadRule(prefix, DIFFUSERS, "|".join(f"(?:{p})" for p, _ in skips),
                              "; ".join(w for _, w in skips)))
    return Program(f"ComfyUI ({COMFYUI_VERSION})", tuple(rules), COMFYUI_TENSORS, "keys",
                   absent)


def diffusers(family: str) -> Program:
    """diffusers' rules for `family` (its keys.py `DIFFUSERS_READS`)."""
    rules = tuple(ReadRule(*rule) for rule in getattr(family_keys(family), "DIFFUSERS_READS"))
    return Program("diffusers", rules, DIFFUSERS_TENSORS, "modules")


def programs(family: str) -> list[Program]:
    """Every program whose rules the family declares (ComfyUI, diffusers; Forge/A1111 where
    its keys.py has `FORGE_READS`)."""
    found = [comfyui(family), diffusers(family)]
    forge = getattr(family_keys(family), "FORGE_READS", None)
    if forge is not None:
        found.append(Program("Forge/A1111", tuple(ReadRule(*r) for r in forge),
                             COMFYUI_TENSORS, "keys"))
    return found
