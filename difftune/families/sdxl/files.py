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
                                                 load_vae, open_clip_state)
from difftune.families.common.folders import (from_folder_or_fail, load_folder,
                                              load_folder_text_encoders, model_folder,
                                              tokenizers)
from difftune.families.common.ldm_unet import (check_ldm_layout, ldm_single_file_layout,
                                               ldm_unet_config, load_ldm_unet)
from difftune.families.common.single_file import (fingerprint, missing_error, prefixed,
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


def load_sdxl_folder(folder: Path, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """All components of a diffusers SDXL folder, keyed as StableDiffusionXLPipeline names them.

    `dtypes` maps "unet", "vae" and "text_encoders" to the dtype each is read in. Adds
    "fingerprint" (path/size/mtime of every component file, so caches follow the files).
    """
    return load_folder(folder, FOLDER_PARTS, dtypes, "SDXL")


def load_sdxl_folder_text_encoders(folder: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Only the two CLIPs of a diffusers SDXL folder (a reload after unloading)."""
    return load_folder_text_encoders(folder, FOLDER_PARTS, dtype, "SDXL")

# ---------------------------------------------------------------------------------------------
# SDXL UNet


def unet_config(sd: dict[str, torch.Tensor], pooled_dim: int | None) -> dict[str, Any]:
    """UNet2DConditionModel config from an SGM UNet state dict (prefix removed).

    `pooled_dim` is CLIP-G's projection width when known: the added-conditioning input is that
    plus 6 time ids, which gives the time-id width; otherwise SDXL-base's 256 is assumed.
    """
    return {**ldm_unet_config(sd, 128, None), **_added_conditioning(sd, pooled_dim)}


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
    check_ldm_layout(sd, path, "SDXL", "sd_xl_base_1.0.safetensors")


def load_sdxl_unet(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   pooled_dim: int | None) -> Any:
    """The SDXL UNet of a whole-checkpoint state dict, via diffusers' SGM converter."""
    check_sdxl_layout(sd, path)
    try:
        config = unet_config(prefixed(sd, UNET_PREFIX), pooled_dim)
    except (KeyError, StopIteration, IndexError) as err:
        raise missing_error(path, "an SDXL UNet", err) from None
    return load_ldm_unet(sd, path, dtype, config, "SDXL")


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


def single_file_layout(unet: torch.nn.Module) -> "Layout":
    """The SDXL UNet in the original checkpoint layout (`model.diffusion_model.input_blocks...`,
    as sd_xl_base_1.0.safetensors holds it; ComfyUI, Forge and diffusers' from_single_file read
    it), one tensor per tensor."""
    return ldm_single_file_layout(unet, "SDXL original checkpoint")
