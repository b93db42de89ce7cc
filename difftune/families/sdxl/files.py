"""Load SDXL from local files only: a diffusers folder or one original-layout checkpoint.

Folder: `model.path` in the stable-diffusion-xl-base-1.0 layout (`load_sdxl_folder`).
Single file: `model.transformer` is one SGM-layout file such as `sd_xl_base_1.0.safetensors`
(`model.diffusion_model.*` UNet, `first_stage_model.*` VAE, `conditioner.embedders.0.
transformer.*` CLIP-L, `conditioner.embedders.1.model.*` OpenCLIP-G). Names are converted with
diffusers' own converters; the configs those need are derived here from tensor shapes (the
released model's values where shapes are silent). Missing parts come from `model.vae`, else from
the `model.path` diffusers folder, which must also hold the tokenizers (they are not stored in
checkpoints and are never downloaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import (UNET_PREFIX, VAE_PREFIX, clip_from_state,
                                                 head_width, load_vae, norm_groups,
                                                 open_clip_state)
from difftune.families.common.folders import (check_folder, folder_files, from_folder,
                                              from_folder_or_fail, model_folder, tokenizers)
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  fingerprint, missing_error, prefixed,
                                                  read_safetensors)

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

SDXL_CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
SDXL_CLIP_G_PREFIX = "conditioner.embedders.1.model."
SDXL_VAE_SCALE = {"scaling_factor": 0.13025, "shift_factor": None}
SDXL_TIME_ID_WIDTH = 256  # SDXL-base's addition_time_embed_dim, used when CLIP-G is not bundled
# stabilityai/stable-diffusion-xl-base-1.0 scheduler_config.json (the training-relevant part).
SDXL_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
}
# stable-diffusion-xl-base-1.0 layout: (subfolder, class name, holds weights).
FOLDER_PARTS: tuple[tuple[str, str, bool], ...] = (
    ("unet", "diffusers.UNet2DConditionModel", True),
    ("vae", "diffusers.AutoencoderKL", True),
    ("text_encoder", "transformers.CLIPTextModel", True),
    ("text_encoder_2", "transformers.CLIPTextModelWithProjection", True),
    ("tokenizer", "transformers.CLIPTokenizer", False),
    ("tokenizer_2", "transformers.CLIPTokenizer", False),
    ("scheduler", "diffusers.EulerDiscreteScheduler", False),
)


def _class(qualified: str) -> Any:
    """The class named "module.Class" (imported lazily: diffusers/transformers are slow to load)."""
    import importlib

    module, name = qualified.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def load_sdxl_folder(folder: Path, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """All components of a diffusers SDXL folder, keyed as StableDiffusionXLPipeline names them.

    `dtypes` maps "unet", "vae" and "text_encoders" to the dtype each is read in. Adds
    "fingerprint" (path/size/mtime of every component file, so caches follow the files).
    """
    check_folder(folder, "SDXL")
    parts: dict[str, Any] = {}
    for sub, cls, weights in FOLDER_PARTS:
        dtype = dtypes.get(sub, dtypes["text_encoders"]) if weights else None
        parts[sub] = from_folder(_class(cls), folder, sub, dtype, "SDXL")
    parts["fingerprint"] = fingerprint(folder_files(folder, [p[0] for p in FOLDER_PARTS]))
    parts["name"] = folder.name
    return parts


def load_sdxl_folder_text_encoders(folder: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Only the two CLIPs of a diffusers SDXL folder (a reload after unloading)."""
    return {sub: from_folder(_class(cls), folder, sub, dtype, "SDXL")
            for sub, cls, _ in FOLDER_PARTS if sub.startswith("text_encoder")}

# ---------------------------------------------------------------------------------------------
# SDXL UNet


def _level_starts(n_levels: int, per_level: int) -> list[int]:
    """SGM input-block index of each level's first resnet (block 0 is conv_in)."""
    return [1 + level * (per_level + 1) for level in range(n_levels)]


def _depth(sd: dict[str, torch.Tensor], block: str) -> int:
    """Transformer depth of the SGM attention block `block` (0 when it has no attention)."""
    return count_blocks(sd, f"{block}.1.transformer_blocks.")


def unet_config(sd: dict[str, torch.Tensor], pooled_dim: int | None) -> dict[str, Any]:
    """UNet2DConditionModel config from an SGM UNet state dict (prefix removed).

    `pooled_dim` is CLIP-G's projection width when known: the added-conditioning input is that
    plus 6 time ids, which gives the time-id width; otherwise SDXL-base's 256 is assumed.
    """
    width = sd["input_blocks.0.0.weight"].shape[0]
    n_levels = 1 + sum(1 for k in sd if k.startswith("input_blocks.") and k.endswith(".0.op.weight"))
    per_level = (count_blocks(sd, "input_blocks.") - 1 - (n_levels - 1)) // n_levels
    starts = _level_starts(n_levels, per_level)
    channels = [sd[f"input_blocks.{s}.0.out_layers.3.weight"].shape[0] for s in starts]
    depths = [_depth(sd, f"input_blocks.{s}") for s in starts]
    attn = next(f"input_blocks.{s}.1." for s, d in zip(starts, depths) if d)
    config: dict[str, Any] = {
        "sample_size": 128, "in_channels": sd["input_blocks.0.0.weight"].shape[1],
        "out_channels": sd["out.2.weight"].shape[0],
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depths],
        "up_block_types": ["CrossAttnUpBlock2D" if d else "UpBlock2D" for d in reversed(depths)],
        "mid_block_type": "UNetMidBlock2DCrossAttn" if _depth(sd, "middle_block") else None,
        "block_out_channels": channels, "layers_per_block": per_level,
        "transformer_layers_per_block": [max(d, 1) for d in depths],
        "attention_head_dim": [max(1, c // head_width(c)) for c in channels],
        "norm_num_groups": norm_groups(width),
        "cross_attention_dim": sd[attn + "transformer_blocks.0.attn2.to_k.weight"].shape[1],
        "use_linear_projection": sd[attn + "proj_in.weight"].ndim == 2,
        "flip_sin_to_cos": True, "freq_shift": 0,
    }
    if sd["time_embed.0.weight"].shape[0] != 4 * width:
        config["time_embedding_dim"] = sd["time_embed.0.weight"].shape[0]
    config.update(_reverse_depths(sd, depths, per_level))
    config.update(_added_conditioning(sd, pooled_dim))
    return config


def _reverse_depths(sd: dict[str, torch.Tensor], depths: list[int], per_level: int) -> dict:
    """`reverse_transformer_layers_per_block` when the up path's depths differ from the down path's."""
    up = [_depth(sd, f"output_blocks.{level * (per_level + 1)}") for level in range(len(depths))]
    if up == list(reversed(depths)):
        return {}
    return {"reverse_transformer_layers_per_block": [[max(d, 1)] * (per_level + 1) for d in up]}


def _added_conditioning(sd: dict[str, torch.Tensor], pooled_dim: int | None) -> dict[str, Any]:
    """SDXL's "text_time" added conditioning from `label_emb.0.0`, if the UNet has it."""
    if "label_emb.0.0.weight" not in sd:
        return {}
    total = sd["label_emb.0.0.weight"].shape[1]
    time_width = (total - pooled_dim) // 6 if pooled_dim else SDXL_TIME_ID_WIDTH
    return {"addition_embed_type": "text_time", "addition_time_embed_dim": time_width,
            "projection_class_embeddings_input_dim": total}


def check_sdxl_layout(sd: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse, before any work, a file without an SGM-layout UNet (SD3, diffusers layout, ...)."""
    if not any(k.startswith(UNET_PREFIX + "input_blocks.") for k in sd):
        raise ModelFileError(f"{path} does not look like an SDXL checkpoint: no "
                             f"{UNET_PREFIX}input_blocks.* tensors (expected the original SGM "
                             "layout of sd_xl_base_1.0.safetensors)")


def load_sdxl_unet(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   pooled_dim: int | None) -> Any:
    """The SDXL UNet of a whole-checkpoint state dict, via diffusers' SGM converter."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    check_sdxl_layout(sd, path)
    try:
        config = unet_config(prefixed(sd, UNET_PREFIX), pooled_dim)
        unet_sd = convert_ldm_unet_checkpoint({k: v for k, v in sd.items()
                                               if k.startswith(UNET_PREFIX)}, config)
    except (KeyError, StopIteration, IndexError) as err:
        raise missing_error(path, "an SDXL UNet", err) from None
    with torch.device("meta"):
        model = UNet2DConditionModel(**config)
    return assign_state(model, cast_state(unet_sd, dtype), path, "SDXL UNet")


# ---------------------------------------------------------------------------------------------
# SDXL


def load_sdxl_file(cfg: ModelConfig, dtypes: dict[str, torch.dtype],
                   text_only: bool = False) -> dict[str, Any]:
    """Every SDXL component from `cfg.transformer` (see the module docstring for fallbacks).

    `dtypes` has "unet", "vae", "text_encoders"; returns StableDiffusionXLPipeline's component
    names plus "name" and "fingerprint". `text_only`: the two CLIPs alone (for a reload).
    """
    from diffusers import AutoencoderKL, EulerDiscreteScheduler
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    path, folder = Path(cfg.transformer).expanduser(), model_folder(cfg)
    tok_l, tok_g = tokenizers(folder, ("tokenizer", "tokenizer_2"), CLIPTokenizer, "SDXL")
    sd = read_safetensors(path, "SDXL checkpoint (original SGM layout)")
    check_sdxl_layout(sd, path)
    te = dtypes["text_encoders"]
    files = [path]
    if any(k.startswith(SDXL_CLIP_G_PREFIX) for k in sd):
        clip_g = clip_from_state(open_clip_state(sd, SDXL_CLIP_G_PREFIX), path, te, tok_g,
                                 projection=True, act="gelu")
    else:
        clip_g, more = from_folder_or_fail(folder, "text_encoder_2", CLIPTextModelWithProjection,
                                           te, "SDXL", path, SDXL_CLIP_G_PREFIX + "*")
        files += more
    if any(k.startswith(SDXL_CLIP_L_PREFIX) for k in sd):
        clip_l = clip_from_state(prefixed(sd, SDXL_CLIP_L_PREFIX), path, te, tok_l,
                                 projection=False, act="quick_gelu")
    else:
        clip_l, more = from_folder_or_fail(folder, "text_encoder", CLIPTextModel, te, "SDXL",
                                           path, SDXL_CLIP_L_PREFIX + "*")
        files += more
    if text_only:
        return {"text_encoder": clip_l, "text_encoder_2": clip_g}
    unet = load_sdxl_unet(sd, path, dtypes["unet"], clip_g.config.projection_dim)
    vae, more = load_vae(cfg.vae, sd, path, dtypes["vae"], SDXL_VAE_SCALE) or \
        from_folder_or_fail(folder, "vae", AutoencoderKL, dtypes["vae"], "SDXL", path,
                            VAE_PREFIX + "*; or set model.vae")
    return {"unet": unet, "vae": vae, "text_encoder": clip_l, "text_encoder_2": clip_g,
            "tokenizer": tok_l, "tokenizer_2": tok_g,
            "scheduler": EulerDiscreteScheduler(**SDXL_SCHEDULER_CONFIG),
            "name": path.stem, "fingerprint": fingerprint(files + more)}


def source_parts(cfg: ModelConfig, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """One SGM checkpoint's parts (+ tokenizers in model.path), or a diffusers folder's."""
    if cfg.transformer is not None:
        return load_sdxl_file(cfg, dtypes)
    if cfg.path is not None:
        return load_sdxl_folder(Path(cfg.path), dtypes)
    raise ModelFileError(
        "no SDXL source: set model.transformer to a single SDXL checkpoint "
        "(sd_xl_base_1.0.safetensors layout) or model.path to a diffusers-format folder")


def text_parts(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """CLIP-L and CLIP-G alone, from the checkpoint or the folder (a reload)."""
    if cfg.transformer is not None:
        return load_sdxl_file(cfg, {"text_encoders": dtype}, text_only=True)
    assert cfg.path is not None  # ModelConfig guarantees a source
    return load_sdxl_folder_text_encoders(Path(cfg.path), dtype)


# --- the original (SGM) checkpoint layout, written for a full fine-tune ---------------------

_SGM_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
            "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0",
            "conv_out": "out.2"}
_SGM_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_SGM_MID = {"resnets.0": "middle_block.0", "attentions.0": "middle_block.1",
            "resnets.1": "middle_block.2"}


def sgm_unet_name(key: str, per_level: int, up_attention: list[bool]) -> str:
    """One diffusers UNet tensor name in the SGM numbering of the original checkpoints
    (`input_blocks.<i>.<j>`, `middle_block.<j>`, `output_blocks.<i>.<j>`): each level holds
    `per_level` layers (+1 going up) and then its down- or upsampler."""
    top = next((k for k in _SGM_TOP if key.startswith(k + ".")), None)
    if top is not None:
        return _SGM_TOP[top] + key[len(top):]
    part = key.split(".")
    if part[0] == "mid_block":
        head, rest = _SGM_MID[f"{part[1]}.{part[2]}"], part[3:]
    else:
        level, kind, j, rest = int(part[1]), part[2], int(part[3]), part[4:]
        down = part[0] == "down_blocks"
        sampler = kind in ("downsamplers", "upsamplers")
        index = (1 if down else 0) + level * (per_level + 1) + (per_level if sampler else j)
        slot = ("1" if kind == "attentions" else "0" if down or kind == "resnets"
                else "2" if up_attention[level] else "1")
        head = f"{'input_blocks' if down else 'output_blocks'}.{index}.{slot}"
        if sampler:
            rest = ["op" if down else "conv", rest[-1]]
    if "resnets" in part:
        rest = [_SGM_RESNET.get(".".join(rest[:-1]), ".".join(rest[:-1])), rest[-1]]
    return ".".join([head, *rest])


def single_file_layout(unet: torch.nn.Module) -> "Layout":
    """The SDXL UNet in the original checkpoint layout (`model.diffusion_model.input_blocks...`,
    as sd_xl_base_1.0.safetensors holds it; ComfyUI, Forge and diffusers' from_single_file read
    it), one tensor per tensor."""
    from difftune.files.single import Piece, check_complete

    cfg, names = unet.config, list(unet.state_dict())
    up_attention = ["CrossAttn" in t for t in cfg.up_block_types]
    per_level = cfg.layers_per_block
    layout = {UNET_PREFIX + sgm_unet_name(n, per_level, up_attention): Piece((n,)) for n in names}
    return check_complete(layout, names, "SDXL original checkpoint")
