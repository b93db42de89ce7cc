"""Load FLUX.3 from local files only: a diffusers folder and/or single files.

`model.path` is a folder in the layout a FLUX.3 modular repository holds (transformer/
(Flux3Transformer2DModel), vae/ (AutoencoderKLFlux2), text_encoder/ (Qwen3-VL), tokenizer/
(Qwen3-VL's processor or tokenizer files), scheduler/ where present, and
modular_model_index.json, or model_index.json). `model.transformer`,
`model.vae` and `model.text_encoder` are single .safetensors files (see `flux3/single.py`); a
single file overrides the folder's component, and the tokenizer always comes from the folder.
Weights are read through safetensors only; a missing or wrong file raises `ModelFileError`
naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.folders import check_folder, from_folder
from difftune.families.common.transformer_folder import FolderLayout, load_components

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

WHAT = "FLUX.3"
# Flux3SetTimestepsStep's scheduler: FlowMatchEulerDiscreteScheduler with the constant shift
# 6.93 (its ComponentSpec config), over sigmas linspace(1, 1/steps, steps).
SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 6.93,
                                    "use_dynamic_shifting": False}
# The released transformer: Flux3Transformer2DModel's defaults (5 per-mode and 28 joint
# blocks, 24 heads of 128, 8 x 2560 text features); the distilled one adds flow_map.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_channels": 128, "cond_in_channels": 128, "num_layers": 5, "num_single_layers": 28,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 20480,
    "timestep_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32)}


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which FLUX.3 needs for its tokenizer (also with single files)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"flux3\" reads its Qwen3-VL tokenizer from a "
                             "diffusers folder; set model.path to a folder in the FLUX.3 layout "
                             "(tokenizer/, text_encoder/, transformer/, vae/)")
    folder = Path(cfg.path).expanduser()
    if (cfg.transformer is None or cfg.vae is None or cfg.text_encoder is None) and not (
            folder / "modular_model_index.json").is_file():
        check_folder(folder, WHAT)  # a modular folder has modular_model_index.json instead
    return folder


def _layout() -> FolderLayout:
    """FLUX.3's classes and single-file loaders."""
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel

    from difftune.families.flux3 import single

    return FolderLayout(WHAT, Flux3Transformer2DModel, AutoencoderKLFlux2,
                        single.load_transformer_file, single.load_vae_file, SCHEDULER_CONFIG)


def load_flux3_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component in `dtypes` (single files over the folder's), plus "name" and
    "fingerprint"."""
    return load_components(cfg, dtypes, _folder(cfg), _layout(), load_flux3_text_encoders)


def load_flux3_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3-VL text encoder alone: `model.text_encoder` if given, else the folder's (as a
    Qwen3VLModel: the pipeline reads hidden states only, so no LM head is held)."""
    from transformers import Qwen3VLModel

    from difftune.families.flux3 import single

    if cfg.text_encoder is not None:
        return {"text_encoder": single.load_text_encoder_file(Path(cfg.text_encoder), dtype)}
    return {"text_encoder": from_folder(Qwen3VLModel, _folder(cfg), "text_encoder", dtype,
                                        WHAT)}


# --- BFL's FLUX.3 single-file layout, written for a full fine-tune ---------------------------

# diffusers prefix -> BFL's (the inverse of the converter's prefix renames).
_PREFIXES = (("x_embedders.", "emb_in."), ("context_embedder.", "txt_in."),
             ("mode_blocks.", "content_mode_blocks."),
             ("single_transformer_blocks.", "single_blocks."))
_EXACT = {"timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
          "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
          "target_timestep_embedder.linear_1.weight": "ref_time_in.in_layer.weight",
          "target_timestep_embedder.linear_2.weight": "ref_time_in.out_layer.weight",
          "proj_out.weight": "final_layer.image.linear.weight"}
_INSIDE = (("attn.to_q.weight", "q_proj.weight"), ("attn.to_k.weight", "k_proj.weight"),
           ("attn.to_v.weight", "v_proj.weight"), ("attn.to_out.0.weight", "attn_out.weight"),
           ("attn.norm_q.weight", "norm.query_norm.scale"),
           ("attn.norm_k.weight", "norm.key_norm.scale"),
           ("ff.linear_in.weight", "mlp_in.weight"), ("ff.linear_out.weight", "mlp_out.weight"))


def original_name(name: str) -> str:
    """BFL's name of a diffusers state-dict name of the FLUX.3 transformer (the inverse of
    diffusers' convert_flux3_transformer_checkpoint_to_diffusers, the final modulation aside)."""
    if name in _EXACT:
        return _EXACT[name]
    for src, dst in _PREFIXES:
        if name.startswith(src):
            name = dst + name[len(src):]
            break
    name = name.replace(".linear.weight", ".lin.weight")
    for src, dst in _INSIDE:
        if name.endswith(src):
            return name[: -len(src)] + dst
    return name


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The FLUX.3 transformer in BFL's layout (what diffusers' from_single_file converts):
    `.lin` modulations, norms as `.scale`, and the final modulation in BFL's (shift, scale)
    order."""
    from difftune.files.single import Piece, check_complete

    names = list(model.state_dict())
    out = {original_name(n): Piece((n,)) for n in names if n != "norm_out.linear.weight"}
    out["final_layer.image.adaLN_modulation.1.weight"] = Piece(("norm_out.linear.weight",), True)
    return check_complete(out, names, "FLUX.3 BFL")
