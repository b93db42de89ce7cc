"""Load Z-Image (Turbo or Base) from local files only: a diffusers folder in the released layout.

`model.path` is a diffusers folder as Tongyi-MAI publishes it (transformer/, vae/,
text_encoder/ (Qwen3), tokenizer/, scheduler/). Weights are read through safetensors only;
a missing or wrong file raises `ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.folders import check_folder, folder_files, from_folder
from difftune.families.common.single_file import fingerprint

if TYPE_CHECKING:
    from difftune.config import ModelConfig

SUBFOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
WHAT = "Z-Image"
# Z-Image-Turbo's scheduler_config.json: a fixed shift of 3, no resolution-dependent shift.
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": False,
}
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


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which Z-Image needs (no single-file source is read yet)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"z_image\" loads from a diffusers folder; set "
                             "model.path to a folder in the Tongyi-MAI/Z-Image layout")
    folder = Path(cfg.path).expanduser()
    check_folder(folder, WHAT)
    return folder


def load_z_image_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component from the diffusers folder in `dtypes`, plus "name" and "fingerprint"."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import AutoTokenizer

    folder = _folder(cfg)
    return {
        "transformer": from_folder(ZImageTransformer2DModel, folder, "transformer",
                                   dtypes["transformer"], WHAT),
        "vae": from_folder(AutoencoderKL, folder, "vae", dtypes["vae"], WHAT),
        "scheduler": from_folder(FlowMatchEulerDiscreteScheduler, folder, "scheduler", None, WHAT),
        "tokenizer": from_folder(AutoTokenizer, folder, "tokenizer", None, WHAT),
        **load_z_image_text_encoders(cfg, dtypes["text_encoders"]),
        "name": folder.name,
        "fingerprint": fingerprint(folder_files(folder, list(SUBFOLDERS))),
    }


def load_z_image_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3 text encoder alone, from the same folder."""
    from transformers import Qwen3Model

    return {"text_encoder": from_folder(Qwen3Model, _folder(cfg), "text_encoder", dtype, WHAT)}
