"""SD 1.5 LoRA key names: kohya's (the default), and the names other tools give the model.

kohya sd-scripts trains SD 1.5 on a UNet that keeps diffusers' module names, so its LoRA files
(and those ComfyUI, A1111/Forge and diffusers' kohya converter read) name a UNet module
`lora_unet_<diffusers module, dots as underscores>`, e.g.
`lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q`, and CLIP-L's modules
`lora_te_text_model_encoder_layers_<n>_self_attn_q_proj`. Every entry is a rename (conv
factors pass through); the shared conversions are `families.common.unet_keys`. Underscores are
ambiguous (`transformer_blocks` vs `transformer.blocks`), so reading matches the loaded UNet's
own module names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from difftune.errors import CheckpointError
from difftune.families.common.unet_keys import (KOHYA_UNET, UNET_COMFYUI_FORMS,
                                                UNET_FORGE_READS, lora_from_kohya,
                                                lora_to_kohya)

# How kohya sd-scripts names SD 1.5 in its LoRA files' metadata: `ss_base_model_version`
# (library/model_util.py "sd_v1"), `ss_network_module`, and the model-spec architecture and
# implementation (library/sai_model_spec.py ARCH_SD_V1, IMPL_STABILITY_AI).
BASE_VERSION = "sd_v1"
NETWORK_MODULE = "networks.lora"
ARCHITECTURE = "stable-diffusion-v1"
IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
# diffusers component name -> kohya prefix of SD 1.5's one CLIP text encoder.
TEXT_ENCODERS = {"text_encoder": "lora_te_"}


class UnderscoredNames:
    """kohya's SD 1.5 UNet names: the diffusers module name with dots as underscores."""

    def __init__(self, modules: Iterable[str], original: Mapping[str, str] | None = None
                 ) -> None:
        """`modules`: the UNet's module names (reading needs them to undo the underscores);
        `original`: {LDM module name: UNet module} of the same UNet, so files named after the
        original checkpoint's modules (`lora_unet_input_blocks_1_1_proj_in`, as A1111-era
        tools and ComfyUI also write SD 1.5) read too."""
        self.flat = {o.replace(".", "_"): m for o, m in (original or {}).items()}
        self.flat |= {m.replace(".", "_"): m for m in modules if m}

    def kohya(self, module: str) -> str:
        """The kohya name (without `lora_unet_`) of a diffusers UNet module."""
        return module.replace(".", "_")

    def from_kohya(self, name: str) -> str:
        """The diffusers UNet module of a kohya name without `lora_unet_`."""
        if name not in self.flat:
            raise CheckpointError(f"kohya UNet entry {KOHYA_UNET}{name} is not a module of "
                                  "this SD 1.5 UNet.")
        return self.flat[name]


def diffusers_to_kohya(state: dict[str, torch.Tensor], alpha: float | dict[str, float],
                       rank: int) -> dict[str, torch.Tensor]:
    """An SD 1.5 diffusers LoRA (`unet.` / `text_encoder.` keys) in kohya names."""
    return lora_to_kohya(state, alpha, rank, UnderscoredNames(()), TEXT_ENCODERS, "SD 1.5")


def kohya_to_diffusers(state: dict[str, torch.Tensor], unet_modules: Iterable[str],
                       text_roots: Mapping[str, str] | None = None,
                       original: Mapping[str, str] | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A kohya/ComfyUI SD 1.5 LoRA in diffusers names, and each module's alpha;
    `unet_modules` are the loaded UNet's module names, `original` its LDM names' modules."""
    return lora_from_kohya(state, UnderscoredNames(unet_modules, original), TEXT_ENCODERS,
                           text_roots, "SD 1.5")


# `difftune lora verify`'s rules (lora_tools.programs), as SDXL's (the same readers: ComfyUI's
# UNet branch over unet_to_diffusers, diffusers' kohya converter, A1111/Forge's Lora extension).
COMFYUI_FORMS = UNET_COMFYUI_FORMS
# diffusers' StableDiffusionLoraLoaderMixin reads PEFT names, and `lora_unet_` files in either
# naming through _convert_non_diffusers_lora_to_diffusers; but its load_lora_weights passes no
# UNet config, so its SGM remapper never runs and original block names (input_blocks_4_1_...)
# land on modules the UNet lacks: of the original names only conv_in's, the time embedding's
# and conv_out's are read (diffusers 0.42).
DIFFUSERS_READS = (("unet.", "diffusers", "", ""),
                   ("lora_unet_", "original",
                    r"(?:down_blocks|mid_block|up_blocks)\..*",  # (the layers they adapt)
                    "diffusers' SD 1.5 loader does not renumber the original blocks (its "
                    "load_lora_weights passes no UNet config)"),
                   ("lora_unet_", "diffusers", "", ""))
FORGE_READS = UNET_FORGE_READS
# The original (LDM) names depend on the UNet's layout, so `difftune lora convert` reads them
# against a model config: the released one's (stable-diffusion-v1-5 unet/config.json, the
# fields that differ from diffusers' defaults), or `--base`'s.
RELEASED_LAYOUTS: dict[str, dict[str, Any]] = {"stable-diffusion-v1-5": {
    "sample_size": 64, "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "block_out_channels": [320, 640, 1280, 1280], "attention_head_dim": 8,
    "cross_attention_dim": 768}}


def single_file_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The UNet config of an original (LDM) single file's UNet tensors (root removed; only
    shapes are read), for `difftune lora convert --base FILE`."""
    from difftune.families.common.ldm_unet import ldm_unet_config
    from difftune.families.sd15.files import SD15_HEADS, SD15_SAMPLE_SIZE

    return ldm_unet_config(sd, SD15_SAMPLE_SIZE, SD15_HEADS)
