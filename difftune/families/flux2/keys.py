"""FLUX.2 LoRA names: the diffusers layout, the original (BFL) kohya layout, and the names
other tools give the model.

diffusers names (`transformer.<module>.lora_A/B.weight`, Flux2Transformer2DModel's modules) are
read by Flux2LoraLoaderMixin. The kohya layout names BFL's original modules
(`lora_unet_double_blocks_0_img_attn_qkv`, `lora_unet_single_blocks_0_linear1`, ...), which
ComfyUI reads for any model through its generic `lora_unet_<diffusion_model key>` map and
diffusers through `_convert_kohya_flux2_lora_to_diffusers`. FLUX.2 differs from FLUX.1 here:
its single blocks' `linear1` is one diffusers module (`attn.to_qkv_mlp_proj`), its MLPs are
`ff.linear_in/linear_out` (gated: `linear_in` emits 2 x 3 x the width), and its modulation
layers are shared by all blocks (`double_stream_modulation_img.lin`, ...).

The original layout (`diffusion_model.<BFL module>.lora_A/lora_B.weight`, scale folded, no
alpha: `to_original`) is the default: ComfyUI reads every module of it through its generic
`diffusion_model.<state-dict name>` map, and diffusers through
`_convert_non_diffusers_flux2_lora_to_diffusers`, the modulation layers included (which
ComfyUI's FLUX table, for diffusers names, and diffusers' kohya converter both lack). Read
besides: the diffusers names under `diffusion_model.` (ai-toolkit's PEFT files, without alpha)
with `lora_down`/`lora_up` factors and `.alpha` entries.
"""

from __future__ import annotations

import re

import torch

from difftune.families.common.block_table import BlockTable, Row
from difftune.families.common.kohya import (
    KOHYA_PREFIX,
    ORIGINAL_PREFIXES,
    KohyaNames,
    fused_from_kohya,
    fused_to_kohya,
    group_kohya,
    original_to_kohya,
)

# Model-spec architecture / implementation and kohya's base-model names, per variant.
ARCHITECTURE = {"klein": "flux-2-klein", "dev": "flux-2-dev"}
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"
BASE_VERSION = {"klein": "flux2_klein", "dev": "flux2_dev"}
NETWORK_MODULE = "networks.lora_flux2"
NAMES = KohyaNames("FLUX.2", "a", "BFL")
GATED = 6  # ff.linear_in's output width as a multiple of its input: 2 (gate, up) x mlp_ratio 3
DOUBLE_BLOCK: tuple[Row, ...] = (
    ("img_attn_qkv", (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1))),
    ("img_attn_proj", (("attn.to_out.0", 1),)),
    ("txt_attn_qkv", (("attn.add_q_proj", 1), ("attn.add_k_proj", 1), ("attn.add_v_proj", 1))),
    ("txt_attn_proj", (("attn.to_add_out", 1),)),
    ("img_mlp_0", (("ff.linear_in", GATED),)),
    ("img_mlp_2", (("ff.linear_out", 1),)),
    ("txt_mlp_0", (("ff_context.linear_in", GATED),)),
    ("txt_mlp_2", (("ff_context.linear_out", 1),)),
)
SINGLE_BLOCK: tuple[Row, ...] = (
    ("linear1", (("attn.to_qkv_mlp_proj", 1),)),
    ("linear2", (("attn.to_out", 1),)),
)
NON_BLOCK: tuple[Row, ...] = (
    ("double_stream_modulation_img_lin", (("double_stream_modulation_img.linear", 6),)),
    ("double_stream_modulation_txt_lin", (("double_stream_modulation_txt.linear", 6),)),
    ("single_stream_modulation_lin", (("single_stream_modulation.linear", 3),)),
    ("img_in", (("x_embedder", 1),)),
    ("txt_in", (("context_embedder", 1),)),
    ("final_layer_linear", (("proj_out", 1),)),
    ("time_in_in_layer", (("time_guidance_embed.timestep_embedder.linear_1", 1),)),
    ("time_in_out_layer", (("time_guidance_embed.timestep_embedder.linear_2", 1),)),
    ("guidance_in_in_layer", (("time_guidance_embed.guidance_embedder.linear_1", 1),)),
    ("guidance_in_out_layer", (("time_guidance_embed.guidance_embedder.linear_2", 1),)),
    # BFL's final modulation is (shift, scale) where diffusers' norm_out.linear is (scale, shift)
    ("final_layer_adaLN_modulation_1", (("norm_out.linear", 2),)),
)
TABLE = BlockTable(
    blocks=(("transformer_blocks", "double_blocks", DOUBLE_BLOCK),
            ("single_transformer_blocks", "single_blocks", SINGLE_BLOCK)),
    non_block=NON_BLOCK,
    swap=frozenset({"final_layer_adaLN_modulation_1"}),
)
# The dotted BFL name of each row (kohya's names are these with underscores for dots).
DOTTED = {"img_attn_qkv": "img_attn.qkv", "img_attn_proj": "img_attn.proj",
          "txt_attn_qkv": "txt_attn.qkv", "txt_attn_proj": "txt_attn.proj",
          "img_mlp_0": "img_mlp.0", "img_mlp_2": "img_mlp.2", "txt_mlp_0": "txt_mlp.0",
          "txt_mlp_2": "txt_mlp.2", "linear1": "linear1", "linear2": "linear2",
          "double_stream_modulation_img_lin": "double_stream_modulation_img.lin",
          "double_stream_modulation_txt_lin": "double_stream_modulation_txt.lin",
          "single_stream_modulation_lin": "single_stream_modulation.lin",
          "img_in": "img_in", "txt_in": "txt_in", "final_layer_linear": "final_layer.linear",
          "time_in_in_layer": "time_in.in_layer", "time_in_out_layer": "time_in.out_layer",
          "guidance_in_in_layer": "guidance_in.in_layer",
          "guidance_in_out_layer": "guidance_in.out_layer",
          "final_layer_adaLN_modulation_1": "final_layer.adaLN_modulation.1"}
_BLOCK = re.compile(r"^(double_blocks|single_blocks)_(\d+)_(\w+)$")
_DOTTED_BLOCK = re.compile(r"^(?:double_blocks|single_blocks)\.\d+\.")


def diffusers_to_kohya(state: dict[str, torch.Tensor], alpha: float, rank: int,
                       prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """A diffusers-named FLUX.2 LoRA in kohya names (qkv fused as `block_table` fuses them); a
    module with no original name raises `CheckpointError` rather than being dropped."""
    return fused_to_kohya(state, alpha, rank, prefix, NAMES, TABLE.entries_for,
                          lambda entry, pairs, r: TABLE.fuse(entry, pairs, r, float(alpha)))


def kohya_to_diffusers(state: dict[str, torch.Tensor], prefix: str = "transformer"
                       ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A kohya/ComfyUI FLUX.2 LoRA back in diffusers names, with each module's alpha; keys that
    are not FLUX.2 transformer LoRA keys raise `CheckpointError`."""
    return fused_from_kohya(state, prefix, NAMES, TABLE.table_for, TABLE.split)
FOREIGN_PREFIXES = ("diffusion_model.", "model.diffusion_model.")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def dotted(kohya: str) -> str:
    """The dotted BFL module name of a kohya one without `lora_unet_`
    (`double_blocks_0_img_attn_qkv` -> `double_blocks.0.img_attn.qkv`); KeyError if unknown."""
    m = _BLOCK.match(kohya)
    if m is None:
        return DOTTED[kohya]
    return f"{m.group(1)}.{m.group(2)}.{DOTTED[m.group(3)]}"


def to_original(state: dict[str, torch.Tensor], rank: int, alpha: float,
                prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """diffusers-named LoRA -> `diffusion_model.<BFL module>.lora_A/B.weight` (q, k, v fused as
    the kohya layout fuses them), each module's alpha / rank folded into its up factor and no
    `.alpha` entry: diffusers' converter refuses any key besides the factors, and both readers
    then apply scale 1."""
    pairs = group_kohya(diffusers_to_kohya(state, alpha, rank, prefix), NAMES)
    out: dict[str, torch.Tensor] = {}
    for name, pair in pairs.items():
        base = f"diffusion_model.{dotted(name)}"
        out[f"{base}.lora_A.weight"] = pair.down.contiguous()
        out[f"{base}.lora_B.weight"] = (pair.up * (pair.alpha / pair.rank)).contiguous()
    return out


def _original(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a file names BFL's modules under `diffusion_model.` (our default layout,
    ComfyUI's and ai-toolkit's BFL files) rather than diffusers' modules."""
    originals = set(DOTTED.values())
    for key in tensors:
        start = next((p for p in ORIGINAL_PREFIXES if key.startswith(p)), None)
        if start is None:
            continue
        rest = key[len(start):]
        module = rest.rsplit(".", 2 if ".lora_" in rest else 1)[0]
        if _DOTTED_BLOCK.match(module) or module in originals:
            return True
    return False


def diffusers_names(tensors: dict[str, torch.Tensor], prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A FLUX.2 LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the
    alpha of each module (`<prefix>.<module>`) that has an `.alpha` entry: kohya files and
    original-layout ones (read as kohya, alpha = rank where none is given) through
    `kohya_to_diffusers`, the others by their prefixes and factor names."""
    if _original(tensors):
        tensors = original_to_kohya(tensors)
    if any(k.startswith(KOHYA_PREFIX) for k in tensors):
        return kohya_to_diffusers(tensors, prefix)
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in tensors.items():
        name = key
        for foreign in FOREIGN_PREFIXES:
            if name.startswith(foreign):
                name = f"{prefix}.{name[len(foreign):]}"
                break
        for old, new in FACTORS.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        if name.endswith(".alpha"):
            alphas[name[: -len(".alpha")]] = float(value.item())
        else:
            out[name] = value
    return out, alphas

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names its FLUX table (comfy/utils.py flux_to_diffusers) maps under these prefixes
# (comfy/lora.py model_lora_keys_unet, Flux branch), besides its generic original-name map.
COMFYUI_FORMS = ("transformer.", "lycoris_", "lora_transformer_", "")
# diffusers' Flux2LoraLoaderMixin reads PEFT names, the original names under
# `diffusion_model.` (_convert_non_diffusers_flux2_lora_to_diffusers), and kohya's
# (_convert_kohya_flux2_lora_to_diffusers), which skips the shared modulation layers, the
# guidance embedder and the final modulation.
DIFFUSERS_READS = (
    ("transformer.", "diffusers", "", ""),
    ("diffusion_model.", "original", "", ""),
    ("lora_unet_", "original", r"double_stream_modulation_(?:img|txt)\.linear|"
     r"single_stream_modulation\.linear|time_guidance_embed\.guidance_embedder\..*|"
     r"norm_out\.linear", "diffusers' kohya FLUX.2 converter skips it"),
)
