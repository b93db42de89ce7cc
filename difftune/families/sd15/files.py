"""Load SD 1.5 from local files only: a diffusers folder or the original single checkpoint.

Folder: `model.path` in the stable-diffusion-v1-5/stable-diffusion-v1-5 layout
(`load_sd15_folder`; the safety checker and feature extractor it also ships are not read).
Single file: `model.transformer` is the original LDM checkpoint ComfyUI and A1111 users keep,
such as `v1-5-pruned-emaonly.safetensors` (`model.diffusion_model.*` UNet,
`first_stage_model.*` VAE, `cond_stage_model.transformer.*` CLIP-L). Names are converted with
diffusers' own converters, the UNet config derived from tensor shapes (SD 1.5's 8 heads per
level, which shapes do not record). Parts the file lacks come from `model.vae`, else from the
`model.path` folder, which must also hold the tokenizer (never in checkpoints, never
downloaded); the scheduler is the folder's when it has one (a v-prediction fine-tune's says
so), else the released one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import (UNET_PREFIX, VAE_PREFIX, clip_from_state,
                                                 load_vae)
from difftune.families.common.folders import (from_folder, from_folder_or_fail, load_folder,
                                              load_folder_text_encoders, model_folder,
                                              tokenizers)
from difftune.families.common.ldm_unet import (check_ldm_layout, derive_config,
                                               ldm_single_file_layout, load_ldm_unet)
from difftune.families.common.single_file import fingerprint, prefixed, read_safetensors

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

WHAT = "SD 1.5"
EXAMPLE = "v1-5-pruned-emaonly.safetensors"
SD15_CLIP_PREFIX = "cond_stage_model.transformer."
SD15_VAE_SCALE = {"scaling_factor": 0.18215, "shift_factor": None}
SD15_HEADS = 8  # attention heads per UNet level (attention_head_dim 8 in the released config)
SD15_SAMPLE_SIZE = 64  # latents of 512 px images
# stable-diffusion-v1-5 scheduler/scheduler_config.json (PNDMScheduler; its "clip_sample": false
# is no PNDM argument and left out; prediction_type is PNDM's default, "epsilon").
SD15_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "prediction_type": "epsilon",
}
# stable-diffusion-v1-5 layout: (subfolder, class name, holds weights).
FOLDER_PARTS: tuple[tuple[str, str, bool], ...] = (
    ("unet", "diffusers.UNet2DConditionModel", True),
    ("vae", "diffusers.AutoencoderKL", True),
    ("text_encoder", "transformers.CLIPTextModel", True),
    ("tokenizer", "transformers.CLIPTokenizer", False),
    ("scheduler", "diffusers.PNDMScheduler", False),
)


def load_sd15_folder(folder: Path, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """All components of a diffusers SD 1.5 folder, keyed as StableDiffusionPipeline names
    them, plus "name" and "fingerprint"."""
    return load_folder(folder, FOLDER_PARTS, dtypes, WHAT)


def _scheduler(folder: Path | None) -> Any:
    """The folder's scheduler when it has one (its prediction type included), else the
    released SD 1.5 one."""
    from diffusers import PNDMScheduler

    if folder is not None and (folder / "scheduler").is_dir():
        return from_folder(PNDMScheduler, folder, "scheduler", None, WHAT)
    return PNDMScheduler(**SD15_SCHEDULER_CONFIG)


def _check_unet(sd: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse an LDM file that is not SD 1.5's UNet: SDXL's (added conditioning)."""
    check_ldm_layout(sd, path, WHAT, EXAMPLE)
    if UNET_PREFIX + "label_emb.0.0.weight" in sd:
        raise ModelFileError(f"{path} is an SDXL checkpoint (its UNet has SDXL's added "
                             "conditioning, label_emb); set model.family = \"sdxl\" for it")


def _clip(sd: dict[str, torch.Tensor], path: Path, folder: Path | None, dtype: torch.dtype,
          tokenizer: Any) -> tuple[Any, list[Path]]:
    """CLIP-L from the checkpoint, else from the folder's text_encoder/."""
    from transformers import CLIPTextModel

    if any(k.startswith(SD15_CLIP_PREFIX) for k in sd):
        return clip_from_state(prefixed(sd, SD15_CLIP_PREFIX), path, dtype, tokenizer,
                               projection=False, act="quick_gelu"), []
    return from_folder_or_fail(folder, "text_encoder", CLIPTextModel, dtype, WHAT, path,
                               SD15_CLIP_PREFIX + "*")


def load_sd15_unet(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   context_width: int) -> Any:
    """The SD 1.5 UNet of a whole-checkpoint state dict; its cross-attention must read
    `context_width` (the text encoder's width: 768 for CLIP-L; an SD 2.x UNet reads 1024)."""
    config = derive_config(sd, path, WHAT, SD15_SAMPLE_SIZE, SD15_HEADS)
    if config["cross_attention_dim"] != context_width:
        raise ModelFileError(
            f"{path}: its UNet reads {config['cross_attention_dim']}-wide text, but SD 1.5's "
            f"CLIP-L gives {context_width}; this is not an SD 1.5 checkpoint (SD 2.x reads "
            "1024) or its text encoder does not belong to it")
    return load_ldm_unet(sd, path, dtype, config, WHAT)


def load_sd15_file(cfg: ModelConfig, dtypes: dict[str, torch.dtype],
                   text_only: bool = False) -> dict[str, Any]:
    """Every SD 1.5 component from `cfg.transformer` (see the module docstring for fallbacks).

    `dtypes` has "unet", "vae", "text_encoders"; returns StableDiffusionPipeline's component
    names plus "name" and "fingerprint". `text_only`: CLIP-L alone (for a reload).
    """
    from diffusers import AutoencoderKL
    from transformers import CLIPTokenizer

    path, folder = Path(cfg.transformer).expanduser(), model_folder(cfg)
    (tokenizer,) = tokenizers(folder, ("tokenizer",), CLIPTokenizer, WHAT)
    sd = read_safetensors(path, f"{WHAT} checkpoint (original LDM layout)")
    _check_unet(sd, path)
    clip, files = _clip(sd, path, folder, dtypes["text_encoders"], tokenizer)
    if text_only:
        return {"text_encoder": clip}
    unet = load_sd15_unet(sd, path, dtypes["unet"], clip.config.hidden_size)
    vae, more = load_vae(cfg.vae, sd, path, dtypes["vae"], SD15_VAE_SCALE) or \
        from_folder_or_fail(folder, "vae", AutoencoderKL, dtypes["vae"], WHAT, path,
                            VAE_PREFIX + "*; or set model.vae")
    return {"unet": unet, "vae": vae, "text_encoder": clip, "tokenizer": tokenizer,
            "scheduler": _scheduler(folder), "name": path.stem,
            "fingerprint": fingerprint([path, *files, *more])}


def source_parts(cfg: ModelConfig, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """The original checkpoint's parts (+ the tokenizer in model.path), or a diffusers folder's."""
    if cfg.transformer is not None:
        return load_sd15_file(cfg, dtypes)
    if cfg.path is not None:
        return load_sd15_folder(Path(cfg.path), dtypes)
    raise ModelFileError(
        f"no {WHAT} source: set model.transformer to a single SD 1.5 checkpoint ({EXAMPLE} "
        "layout) or model.path to a diffusers-format folder")


def text_parts(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """CLIP-L alone, from the checkpoint or the folder (a reload)."""
    if cfg.transformer is not None:
        return load_sd15_file(cfg, {"text_encoders": dtype}, text_only=True)
    assert cfg.path is not None  # ModelConfig guarantees a source
    return load_folder_text_encoders(Path(cfg.path), FOLDER_PARTS, dtype, WHAT)


def single_file_layout(unet: torch.nn.Module) -> "Layout":
    """The SD 1.5 UNet in the original checkpoint layout (`model.diffusion_model.input_blocks...`,
    as v1-5-pruned-emaonly.safetensors holds it), for a full fine-tune's single file."""
    return ldm_single_file_layout(unet, "SD 1.5 original checkpoint")
