"""Load Z-Image (Turbo or Base) from local files only: a diffusers folder and/or single files.

`model.path` is a diffusers folder as Tongyi-MAI publishes it (transformer/, vae/,
text_encoder/ (Qwen3), tokenizer/, scheduler/). `model.transformer`, `model.vae` and
`model.text_encoder` are single .safetensors files as ComfyUI users keep them (the transformer
in the original layout, fused qkv, converted with diffusers' own converter, or in the diffusers
layout; the FLUX.1 `ae` autoencoder in the LDM layout; `qwen_3_4b.safetensors`); a single file
overrides the folder's component, and the tokenizer always comes from the folder. Weights are read through safetensors only; a
missing or wrong file raises `ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import VAE_PREFIX, vae_from_state
from difftune.families.common.folders import check_folder, from_folder
from difftune.families.common.qwen3 import load_qwen3_file
from difftune.families.common.single_file import (
    assign_state,
    cast_state,
    count_blocks,
    missing_error,
    read_safetensors,
    strip_prefix,
)
from difftune.families.common.transformer_folder import FolderLayout, load_components

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

SUBFOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
WHAT = "Z-Image"
# The two releases share the architecture and differ in their scheduler_config.json: a fixed
# shift of 6 for Z-Image (Base), of 3 for the step-distilled Z-Image-Turbo; neither shifts by
# resolution. The shift is how a loaded model is told apart (its weights cannot tell).
BASE_SHIFT, TURBO_SHIFT = 6.0, 3.0
BASE_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": BASE_SHIFT,
    "use_dynamic_shifting": False,
}
TURBO_SCHEDULER_CONFIG: dict[str, Any] = {**BASE_SCHEDULER_CONFIG, "shift": TURBO_SHIFT}
# Said when model.path has no scheduler/ (single files over a tokenizer-only folder): the
# release is then unknown and Turbo's settings, what ComfyUI users most often keep, are used.
SCHEDULER_UNKNOWN = (
    "model.path has no scheduler/scheduler_config.json, which is how Z-Image (Base, shift 6) "
    "and Z-Image-Turbo (shift 3) are told apart (their weights cannot tell); Turbo's settings "
    "are assumed. For Base, copy the scheduler/ folder of Tongyi-MAI/Z-Image into model.path")


def is_turbo(scheduler_config: Any) -> bool:
    """Whether a loaded scheduler's config is Turbo's (its shift nearer 3 than Base's 6)."""
    shift = float(scheduler_config.get("shift", TURBO_SHIFT))
    return abs(shift - TURBO_SHIFT) < abs(shift - BASE_SHIFT)
# The released transformer's config (ZImageTransformer2DModel's defaults are the 6B model's).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 3840,
    "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5,
    "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0,
    "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512],
}
# Qwen3-4B, the text encoder (its hidden size is the transformer's cap_feat_dim).
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
VAE_SCALE = {"scaling_factor": 0.3611, "shift_factor": 0.1159}  # the FLUX.1 ae (not in the file)
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def rope_axes(head_dim: int) -> list[int]:
    """RoPE axes for a head size (not in the weights): Z-Image's [32, 48, 48] at 128, the same
    proportions at other sizes ([8, 12, 12] at 32)."""
    side = head_dim * 3 // 8
    return [head_dim - 2 * side, side, side]


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """ZImageTransformer2DModel config from a diffusers-layout state dict's shapes."""
    try:
        dim, patch_in = sd["all_x_embedder.2-1.weight"].shape
        head = sd["layers.0.attention.norm_q.weight"].shape[0]
        return {**TRANSFORMER_CONFIG, "in_channels": patch_in // 4, "dim": dim,
                "n_layers": count_blocks(sd, "layers."),
                "n_refiner_layers": count_blocks(sd, "noise_refiner."),
                "n_heads": dim // head,
                "n_kv_heads": sd["layers.0.attention.to_k.weight"].shape[0] // head,
                "cap_feat_dim": sd["cap_embedder.1.weight"].shape[1], "axes_dims": rope_axes(head)}
    except KeyError as err:
        raise missing_error(path, "a Z-Image transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file: original layout (converted by diffusers' converter) or
    diffusers layout."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_z_image_transformer_checkpoint_to_diffusers,
    )

    sd = strip_prefix(read_safetensors(path, "Z-Image transformer"), _ORIGINAL_PREFIXES)
    if "all_x_embedder.2-1.weight" not in sd:
        sd = convert_z_image_transformer_checkpoint_to_diffusers(dict(sd))
    with torch.device("meta"):
        model = ZImageTransformer2DModel(**transformer_config(sd, path))
    return assign_state(model, cast_state(sd, dtype), path, "Z-Image transformer")


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """The FLUX.1-style autoencoder from an LDM-layout file (`ae.safetensors`)."""
    sd = strip_prefix(read_safetensors(path, "Z-Image autoencoder (ae.safetensors)"),
                      (VAE_PREFIX, "vae."))
    if not any(k.startswith("encoder.down.") for k in sd):
        raise ModelFileError(f"{path} does not look like an LDM-layout autoencoder: no "
                             "encoder.down.* tensors")
    return vae_from_state(sd, path, dtype, VAE_SCALE)


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which Z-Image needs for its text encoder and tokenizer (also with single
    files for the transformer and autoencoder)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"z_image\" reads its Qwen3 text encoder and "
                             "tokenizer from a diffusers folder; set model.path to a folder in "
                             "the Tongyi-MAI/Z-Image layout (text_encoder/, tokenizer/)")
    folder = Path(cfg.path).expanduser()
    if cfg.transformer is None or cfg.vae is None:
        check_folder(folder, WHAT)
    return folder


def _layout() -> FolderLayout:
    """Z-Image's classes and single-file loaders."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel

    return FolderLayout(WHAT, ZImageTransformer2DModel, AutoencoderKL, load_transformer_file,
                        load_vae_file, TURBO_SCHEDULER_CONFIG,
                        scheduler_unknown=SCHEDULER_UNKNOWN)

def load_z_image_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component in `dtypes` (single files over the folder's), plus "name" and
    "fingerprint"."""
    return load_components(cfg, dtypes, _folder(cfg), _layout(), load_z_image_text_encoders)

def load_z_image_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3 text encoder alone: `model.text_encoder` if given, else the folder's."""
    from transformers import Qwen3Model

    if cfg.text_encoder is not None:
        return {"text_encoder": load_text_encoder_file(Path(cfg.text_encoder), dtype)}
    return {"text_encoder": from_folder(Qwen3Model, _folder(cfg), "text_encoder", dtype, WHAT)}


def load_text_encoder_file(path: Path, dtype: torch.dtype) -> Any:
    """Qwen3 from one file as ComfyUI keeps it (`qwen_3_4b.safetensors`: the causal LM's
    `model.*` tensors, any `lm_head` dropped) or a bare Qwen3Model state; sizes from shapes."""
    return load_qwen3_file(path, dtype, TEXT_ENCODER_CONFIG)


_Z_RENAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
              (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
              (".attention.norm_q.", ".attention.q_norm."))


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The Z-Image transformer in its original layout (as ComfyUI keeps z_image_turbo_bf16:
    fused `attention.qkv`, `attention.out`, `q_norm`/`k_norm`, `final_layer`, `x_embedder`),
    the inverse of diffusers' single-file converter."""
    from difftune.files.single import Piece, check_complete

    names, out = list(model.state_dict()), {}
    for name in names:
        if ".attention.to_k." in name or ".attention.to_v." in name:
            continue  # stacked into the `to_q` entry's qkv
        if ".attention.to_q." in name:
            out[name.replace(".to_q.", ".qkv.")] = Piece(tuple(
                name.replace(".to_q.", f".to_{x}.") for x in "qkv"))
            continue
        new = name
        for old, original in _Z_RENAMES:
            new = new.replace(old, original)
        out[new] = Piece((name,))
    return check_complete(out, names, "Z-Image original")
