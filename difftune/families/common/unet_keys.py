"""kohya LoRA files of the UNet families (SD 1.5, SDXL): the parts that are the same for both.

A kohya file stores per module `<name>.lora_down.weight` (A), `.lora_up.weight` (B) and a
scalar `.alpha` (scale = alpha / rank). UNet modules are named `lora_unet_<name>` where the
family's `UNetNamer` says what `<name>` is (SDXL: the SGM numbering; SD 1.5: the diffusers
module name with dots as underscores); CLIP modules are `<prefix>text_model_encoder_layers_...`
behind each encoder's prefix (`lora_te_` for SD 1.5's one CLIP; `lora_te1_`, `lora_te2_` for
SDXL's two). Every entry is a rename, so conv factors (4-D) pass through unchanged.

Text encoders: kohya always writes `text_model_`. transformers 5's CLIPTextModel has no
`text_model.` level (CLIPTextModelWithProjection still has), so diffusers names from it lack
the root; writing accepts both, and reading writes the root each loaded model uses
(`families.common.text.clip_root`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

import torch

from difftune.adapters.formats import LORA_A, LORA_B, split_lora_key
from difftune.errors import CheckpointError
from difftune.families.common.kohya import ALPHA, DOWN, UP

KOHYA_UNET = "lora_unet_"
UNET_PREFIX = "unet"
# CLIP modules inside the text transformer, as kohya (and transformers 4) spell them under
# `text_model.`; "{n}" stands for a layer index.
TEXT_LAYERS: tuple[tuple[str, str], ...] = tuple(
    (p, p) for p in (f"encoder.layers.{{n}}.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
        "mlp.fc1", "mlp.fc2")))
TEXT_ROOT = "text_model."
# CLIPTextModelWithProjection's projection sits beside the text transformer, not under it.
TEXT_PROJECTION = "text_projection"


class UNetNamer(Protocol):
    """How a family names its UNet's modules in kohya files (after `lora_unet_`)."""

    def kohya(self, module: str) -> str:
        """The kohya name (underscored, without `lora_unet_`) of a diffusers UNet module."""
        ...

    def from_kohya(self, name: str) -> str:
        """The diffusers UNet module of a kohya name without `lora_unet_`."""
        ...


def pattern(template: str, sep: str) -> re.Pattern[str]:
    """A full-match regex of a dotted name template, written with `sep` between its parts."""
    escaped = re.escape(template.replace(".", sep)).replace(re.escape("{n}"), r"(\d+)")
    return re.compile(f"^{escaped}$")


def translate(name: str, table: tuple[tuple[str, str], ...], src: int, dst: int, sep: str
              ) -> str | None:
    """Map `name` (written with `sep`) from column `src` to the dotted form of column `dst`."""
    for row in table:
        match = pattern(row[src], sep).match(name)
        if match:
            return row[dst].replace("{n}", "{}").format(*match.groups())
    return None


def lora_to_kohya(state: dict[str, torch.Tensor], alpha: float | dict[str, float], rank: int,
                  unet: UNetNamer, text_encoders: Mapping[str, str], model: str
                  ) -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA (`unet.` / `text_encoder*.` keys) in kohya names.

    `alpha` is one value or a {`prefix.module`: alpha} dict; `text_encoders` maps each
    diffusers text-encoder component to its kohya prefix; `model` names the family in errors.
    Every module must have both factors of rank `rank`; a module with no kohya name raises
    `CheckpointError` rather than being dropped.
    """
    out: dict[str, torch.Tensor] = {}
    for module, (down, up) in _pairs(state).items():
        if down.shape[0] != rank:
            raise CheckpointError(f"LoRA module {module!r} has rank {down.shape[0]}, expected {rank}.")
        base = _kohya_name(module, unet, text_encoders, model)
        module_alpha = alpha[module] if isinstance(alpha, dict) else alpha
        out[f"{base}.{DOWN}"] = down.contiguous()
        out[f"{base}.{UP}"] = up.contiguous()
        out[f"{base}.{ALPHA}"] = torch.tensor(float(module_alpha), dtype=torch.float32)
    return out


def lora_from_kohya(state: dict[str, torch.Tensor], unet: UNetNamer,
                    text_encoders: Mapping[str, str], text_roots: Mapping[str, str] | None,
                    model: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A kohya/ComfyUI LoRA read back into diffusers names.

    Returns the tensors (`<component>.<module>.lora_A/B.weight`) and each module's alpha
    (`<component>.<module>` -> alpha; a missing kohya alpha means alpha = rank). Keys that are
    not LoRA entries of this UNet and these CLIPs raise `CheckpointError`. `text_roots` gives
    each text encoder's root; missing components get `text_model.`, the spelling of diffusers
    files made with transformers 4.
    """
    tensors: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for name, parts in _group_kohya(state).items():
        module = _diffusers_name(name, unet, text_encoders, text_roots or {}, model)
        tensors[f"{module}.{LORA_A}"] = parts[DOWN]
        tensors[f"{module}.{LORA_B}"] = parts[UP]
        alphas[module] = float(parts[ALPHA].item()) if ALPHA in parts else float(parts[DOWN].shape[0])
    return tensors, alphas


def _pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{`prefix.module`: (A, B)}; linear (2-D) and conv (4-D) factors alike, both required."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, suffix = split_lora_key(key)
        halves.setdefault(module, {})[suffix] = value
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, parts in halves.items():
        if set(parts) != {LORA_A, LORA_B}:
            raise CheckpointError(f"LoRA module {module!r} lacks {({LORA_A, LORA_B} - set(parts)).pop()}.")
        down, up = parts[LORA_A], parts[LORA_B]
        if down.ndim != up.ndim or up.shape[1] != down.shape[0]:
            raise CheckpointError(
                f"LoRA module {module!r} has mismatched factors: A {tuple(down.shape)}, B {tuple(up.shape)}."
            )
        out[module] = (down, up)
    return out


def _kohya_name(module: str, unet: UNetNamer, text_encoders: Mapping[str, str], model: str
                ) -> str:
    """The kohya name (without the `.lora_down.weight` suffix) of a prefixed diffusers module."""
    component, _, inner = module.partition(".")
    if component == UNET_PREFIX:
        return KOHYA_UNET + unet.kohya(inner)
    if component in text_encoders:
        return text_encoders[component] + _kohya_text_name(module, inner)
    known = ", ".join([UNET_PREFIX, *text_encoders])
    raise CheckpointError(f"LoRA module {module!r} belongs to no {model} component ({known}).")


def _kohya_text_name(module: str, inner: str) -> str:
    """The kohya spelling (after the encoder's prefix) of a CLIP module, with or without
    `text_model.`."""
    if inner == TEXT_PROJECTION:
        return TEXT_PROJECTION
    if translate(inner.removeprefix(TEXT_ROOT), TEXT_LAYERS, 0, 1, ".") is None:
        raise CheckpointError(f"text-encoder module {module!r} has no kohya name difftune knows.")
    return (TEXT_ROOT + inner.removeprefix(TEXT_ROOT)).replace(".", "_")


def _diffusers_text_name(name: str, inner: str, root: str) -> str:
    """The CLIP module (under `root`) of a kohya text-encoder name's part after its prefix."""
    if inner == TEXT_PROJECTION:
        return TEXT_PROJECTION
    underscored_root = TEXT_ROOT.replace(".", "_")
    layer = translate(inner.removeprefix(underscored_root), TEXT_LAYERS, 0, 0, "_")
    if not inner.startswith(underscored_root) or layer is None:
        raise CheckpointError(f"kohya entry {name} is not a CLIP text-encoder module difftune knows.")
    return root + layer


def _diffusers_name(name: str, unet: UNetNamer, text_encoders: Mapping[str, str],
                    roots: Mapping[str, str], model: str) -> str:
    """The prefixed diffusers module of a kohya name (without the `.lora_down.weight` suffix)."""
    if name.startswith(KOHYA_UNET):
        return f"{UNET_PREFIX}.{unet.from_kohya(name.removeprefix(KOHYA_UNET))}"
    for component, prefix in text_encoders.items():
        if name.startswith(prefix):
            inner = _diffusers_text_name(name, name.removeprefix(prefix),
                                         roots.get(component, TEXT_ROOT))
            return f"{component}.{inner}"
    known = ", ".join([KOHYA_UNET, *text_encoders.values()])
    raise CheckpointError(f"kohya entry {name} is not an {model} LoRA module ({known}).")


def _group_kohya(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{kohya name: {lora_down/lora_up/alpha: tensor}}; malformed or half entries are errors."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for key, value in state.items():
        base, _, kind = key.partition(".")
        if kind not in (DOWN, UP, ALPHA):
            bad.append(key)
            continue
        groups.setdefault(base, {})[kind] = value
    if bad:
        raise CheckpointError(f"these keys are not kohya LoRA keys (*.lora_down.weight/lora_up.weight/alpha): {sorted(bad)}")
    for base, parts in groups.items():
        if DOWN not in parts or UP not in parts:
            raise CheckpointError(f"kohya LoRA entry {base} lacks its lora_down or lora_up weight.")
    return groups


# `difftune lora verify`'s rules shared by the UNet families (lora_tools.programs). ComfyUI
# (4f874c5e) reads the diffusers UNet names its table (comfy/utils.py unet_to_diffusers) maps
# under these prefixes (comfy/lora.py model_lora_keys_unet, UNet branch), besides its generic
# original-name map; bare and `unet.` names too, but attention projections there only in the
# old processor form (`attn1.processor.to_q`), so `attn1.to_q` under them is not loaded:
# (prefix, skipped, why).
_PROCESSOR_ONLY = (r".*\.to_(?:q|k|v|out\.0)", "ComfyUI reads diffusers' attention names "
                   "without kohya's prefix only in the old processor form (attn1.processor.to_q)")
UNET_COMFYUI_FORMS = ("lora_unet_", "lycoris_", ("", *_PROCESSOR_ONLY),
                      ("unet.", *_PROCESSOR_ONLY))
# Forge and A1111 (extensions-builtin/Lora: network names by the original names, and diffusers'
# names converted by convert_diffusers_name_to_compvis).
UNET_FORGE_READS = (("lora_unet_", "original", "", ""), ("lora_unet_", "diffusers", "", ""))
