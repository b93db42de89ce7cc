"""Load FLUX.2 (klein or dev) from local files only: a diffusers folder and/or single files.

`model.path` is a diffusers folder as Black Forest Labs publishes it (transformer/, vae/,
text_encoder/, tokenizer/, scheduler/, model_index.json naming Flux2KleinPipeline or
Flux2Pipeline, which picks the variant). `model.transformer`, `model.vae` and
`model.text_encoder` are single .safetensors files as ComfyUI users keep them (see
`flux2/single.py`); a single file overrides the folder's component and the tokenizer always
comes from the folder. Weights are read through safetensors only; a missing or wrong file
raises `ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.bfl import DYNAMIC_SHIFT_SCHEDULER
from difftune.families.common.folders import check_folder, from_folder
from difftune.families.common.transformer_folder import FolderLayout, load_components

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

WHAT = "FLUX.2"
# The released scheduler_config.json (klein and dev): FLUX.1's dynamic shift settings; the
# pipelines pass their own mu (compute_empirical_mu), so the shift is resolution- and
# step-count-dependent as they compute it.
SCHEDULER_CONFIG: dict[str, Any] = {**DYNAMIC_SHIFT_SCHEDULER, "time_shift_type": "exponential"}
# The released transformers' configs (FLUX.2 [klein] 4B and 9B, FLUX.2 [dev]); joint_attention_dim
# is three stacked encoder layers (3 x 2560 Qwen3-4B, 3 x 4096 Qwen3-8B, 3 x 5120 Mistral Small).
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "klein-4b": {"in_channels": 128, "num_layers": 5, "num_single_layers": 20,
                 "attention_head_dim": 128, "num_attention_heads": 24,
                 "joint_attention_dim": 7680, "axes_dims_rope": (32, 32, 32, 32),
                 "guidance_embeds": False},
    "klein-9b": {"in_channels": 128, "num_layers": 8, "num_single_layers": 24,
                 "attention_head_dim": 128, "num_attention_heads": 32,
                 "joint_attention_dim": 12288, "axes_dims_rope": (32, 32, 32, 32),
                 "guidance_embeds": False},
    "dev": {"in_channels": 128, "num_layers": 8, "num_single_layers": 48,
            "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
            "axes_dims_rope": (32, 32, 32, 32), "guidance_embeds": True},
}
# The text encoders' classes per variant (the released folders' text_encoder/config.json).
ENCODER_CLASSES = {"klein": "Qwen3ForCausalLM", "dev": "Mistral3ForConditionalGeneration"}


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which FLUX.2 needs for its tokenizer (also with single files)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"flux2\" reads its tokenizer from a diffusers "
                             "folder; set model.path to a folder in the FLUX.2 layout "
                             "(model_index.json, tokenizer/, text_encoder/, ...)")
    folder = Path(cfg.path).expanduser()
    check_folder(folder, WHAT)
    return folder


def _layout() -> FolderLayout:
    """FLUX.2's classes and single-file loaders."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from difftune.families.flux2 import single

    return FolderLayout(WHAT, Flux2Transformer2DModel, AutoencoderKLFlux2,
                        single.load_transformer_file, single.load_vae_file, SCHEDULER_CONFIG)

def load_flux2_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component (single files over the folder's), plus "name" and "fingerprint"."""
    return load_components(cfg, dtypes, _folder(cfg), _layout(), load_flux2_text_encoders)

def load_flux2_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The variant's text encoder alone: `model.text_encoder` if given, else the folder's."""
    import transformers

    from difftune.families.flux2 import single

    variant = cfg.variant or "klein"
    if cfg.text_encoder is not None:
        return {"text_encoder": single.load_text_encoder_file(Path(cfg.text_encoder), dtype,
                                                              variant)}
    cls = getattr(transformers, ENCODER_CLASSES[variant])
    return {"text_encoder": from_folder(cls, _folder(cfg), "text_encoder", dtype, WHAT)}


# --- BFL's FLUX.2 single-file layout, written for a full fine-tune ---------------------------

_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin"}
_DOUBLE = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
           "attn.norm_added_q": "txt_attn.norm.query_norm",
           "attn.norm_added_k": "txt_attn.norm.key_norm", "attn.to_add_out": "txt_attn.proj",
           "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2",
           "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The FLUX.2 transformer in BFL's layout (as flux-2-klein-4b.safetensors; ComfyUI,
    diffusers' from_single_file): fused qkv, norms as `.scale`, `.lin` modulations, and the
    final modulation in BFL's (shift, scale) order; the inverse of diffusers' converter."""
    from difftune.families.common.single_file import count_blocks
    from difftune.files.single import Piece, check_complete

    names, out = list(model.state_dict()), {}
    have = set(names)

    def put(src: str, dst: str, swap: bool = False) -> None:
        for kind in ("weight", "bias"):
            if f"{src}.{kind}" in have:
                name = "scale" if dst.endswith("_norm") else kind
                out[f"{dst}.{name}"] = Piece((f"{src}.{kind}",), swap)

    for src, dst in _TOP.items():
        put(src, dst)
    put("norm_out.linear", "final_layer.adaLN_modulation.1", swap=True)
    for i in range(count_blocks(dict.fromkeys(names), "transformer_blocks.")):
        p, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for src, dst in _DOUBLE.items():
            put(p + src, b + dst)
        for dst, parts in _QKV.items():
            for kind in ("weight", "bias"):
                if f"{p}{parts[0]}.{kind}" in have:
                    out[f"{b}{dst}.{kind}"] = Piece(tuple(f"{p}{x}.{kind}" for x in parts))
    for i in range(count_blocks(dict.fromkeys(names), "single_transformer_blocks.")):
        for src, dst in _SINGLE.items():
            put(f"single_transformer_blocks.{i}.{src}", f"single_blocks.{i}.{dst}")
    return check_complete(out, names, "FLUX.2 BFL")
