"""Load Qwen-Image 2.1 from local files only: a diffusers folder, and the transformer from a
single file.

`model.path` is a diffusers folder as QwenImage21Pipeline.save_pretrained writes it
(transformer/, vae/, text_encoder/ (Qwen3-VL), processor/ (its tokenizer; a tokenizer/ folder
is read where processor/ is absent), scheduler/, model_index.json). `model.transformer` is one
.safetensors file in the layout diffusers' single-file loader converts
(convert_qwen_image21_transformer_checkpoint_to_diffusers: the diffusers module names under
`model.diffusion_model.` or bare, with each block's SwiGLU gate and up projections fused as
`img_mlp.gate_up`, gate rows first, as the original checkpoint keeps them), or in the diffusers
names themselves. No single-file layout of the RGBA autoencoder or of the text encoder is
defined by diffusers or ComfyUI for 2.1, so those come from the folder.

Released configs: the transformer's are QwenImage21Transformer2DModel's defaults, the
autoencoder's AutoencoderKLQwenImage21's, Qwen3-VL-8B-Instruct's text and vision configs. The
scheduler's config is not in the installed diffusers: `SCHEDULER_CONFIG` takes the values
QwenImage21Pipeline falls back to (dynamic shift from 0.5 at 256 tokens to 1.15 at 4096), and
a folder's own scheduler/ is always read instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.folders import check_folder, from_folder
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  missing_error, read_safetensors)
from difftune.families.common.transformer_folder import FolderLayout, load_components
from difftune.families.qwen_image.files import rope_axes

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

log = logging.getLogger(__name__)
WHAT = "Qwen-Image 2.1"
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
    "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 32,
    "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096,
    "mlp_ratio": 3, "axes_dims_rope": (16, 56, 56), "causal_condition": True,
}
# AutoencoderKLQwenImage21's architecture (RGBA in and out, 16x down; the latent statistics
# are the class defaults).
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 96, "decoder_base_dim": 144, "z_dim": 64, "dim_mult": [1, 2, 4, 8, 8],
    "num_res_blocks": 2, "temperal_downsample": [False, True, True, True], "in_channels": 4,
    "out_channels": 4,
}
# Qwen3-VL-8B-Instruct: its language model and vision tower.
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                        "mrope_section": [24, 20, 20], "mrope_interleaved": True},
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
    "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def no_final_norm(model: Any) -> Any:
    """Qwen3-VL with `hidden_states[-1]` the last decoder layer's output before the final
    RMSNorm (transformers' `tie_last_hidden_states` off), the state QwenImage21Pipeline reads
    (its norm hook gives the same on either setting)."""
    model.config.get_text_config().tie_last_hidden_states = False
    return model


def processor(tokenizer: Any, images: Any = None) -> Any:
    """The Qwen3VLProcessor QwenImage21Pipeline takes, over `tokenizer` (its chat template the
    tokenizer's) and `images`, the image processor (None: the Qwen-VL one at Qwen3-VL's
    16-pixel patches), without the video processor (common/vl_processor.py)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    from difftune.families.common.vl_processor import without_video

    images = images if images is not None else Qwen2VLImageProcessorPil(patch_size=16)
    return without_video(Qwen3VLProcessor, images, tokenizer, tokenizer.chat_template)


def image_processor(folder: Path) -> Any:
    """The folder's own image processor (processor/preprocessor_config.json, or nested in its
    processor_config.json as transformers now saves it: its pixel bounds decide whether
    Qwen3-VL sees a reference at the size the autoencoder does), or None."""
    from transformers import Qwen2VLImageProcessorPil

    sub = folder / "processor"
    if not any((sub / name).is_file() for name in ("preprocessor_config.json",
                                                   "processor_config.json")):
        return None
    return Qwen2VLImageProcessorPil.from_pretrained(sub, local_files_only=True)


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """QwenImage21Transformer2DModel config from a diffusers-named state dict's shapes."""
    try:
        inner, patched = sd["img_in.weight"].shape
        head = sd["transformer_blocks.0.attn.norm_q.weight"].shape[0]
        out = sd["proj_out.weight"].shape[0]
        patch = round((patched // TRANSFORMER_CONFIG["in_channels"]) ** 0.5) or 1
        return {**TRANSFORMER_CONFIG, "patch_size": patch, "in_channels": patched // patch ** 2,
                "out_channels": out // patch ** 2,
                "num_layers": count_blocks(sd, "transformer_blocks."),
                "attention_head_dim": head, "num_attention_heads": inner // head,
                "context_in_dim": sd["txt_in.in_layer.weight"].shape[1],
                "mlp_ratio": sd["transformer_blocks.0.img_mlp.proj.weight"].shape[0] // inner,
                "axes_dims_rope": rope_axes(head)}
    except KeyError as err:
        raise missing_error(path, "a Qwen-Image 2.1 transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file: the original layout (fused `img_mlp.gate_up`, under
    `model.diffusion_model.` or not), converted by diffusers' own converter, or the diffusers
    names. Its RoPE tables and timestep frequencies are computed, not stored: they are built
    for real while the weights are left empty."""
    from accelerate import init_empty_weights
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_qwen_image21_transformer_checkpoint_to_diffusers as convert)

    sd = read_safetensors(path, "Qwen-Image 2.1 transformer")
    sd = convert({"model.diffusion_model." + k.removeprefix("model.diffusion_model.")
                  .removeprefix("diffusion_model."): v for k, v in sd.items()})
    config = transformer_config(sd, path)
    with init_empty_weights(include_buffers=False):
        model = QwenImage21Transformer2DModel(**config)
    return assign_state(model, cast_state(sd, dtype), path, "Qwen-Image 2.1 transformer")


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which Qwen-Image 2.1 needs for its processor, VAE and text encoder."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"qwen_image_21\" reads its processor, VAE and "
                             "text encoder from a diffusers folder; set model.path to a folder "
                             "in the Qwen/Qwen-Image-2.1 layout (processor/, vae/, "
                             "text_encoder/; transformer/ unless model.transformer is set)")
    folder = Path(cfg.path).expanduser()
    check_folder(folder, WHAT)
    return folder


def _no_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """Refused (config validation refuses model.vae for this family first): no single-file
    layout of the RGBA autoencoder is defined, by diffusers or ComfyUI."""
    raise ModelFileError(f"model.vae = {path}: no single-file layout of Qwen-Image 2.1's "
                         "autoencoder is defined; remove model.vae, the folder's vae/ is read")


def pipeline_options(folder: Path) -> dict[str, Any]:
    """`sample_sigmas` from the folder's model_index.json (Turbo ships its grid there; the
    base checkpoint has none)."""
    index = folder / "model_index.json"
    data = json.loads(index.read_text(encoding="utf-8")) if index.is_file() else {}
    return {"sample_sigmas": data.get("sample_sigmas") or None}


def load_qwen_image_21_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]
                             ) -> dict[str, Any]:
    """Every component in `dtypes` (the transformer's single file over the folder's), the
    processor, the folder's pipeline options, plus "name" and "fingerprint"."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

    folder = _folder(cfg)
    tokens = "processor" if (folder / "processor").is_dir() else "tokenizer"
    layout = FolderLayout(WHAT, QwenImage21Transformer2DModel, AutoencoderKLQwenImage21,
                          load_transformer_file, _no_vae_file, SCHEDULER_CONFIG,
                          tokenizer=tokens,
                          scheduler_unknown=f"{folder} has no scheduler/; using the dynamic "
                                            "shift QwenImage21Pipeline falls back to")
    parts = load_components(cfg, dtypes, folder, layout, load_qwen_image_21_text_encoders)
    parts["processor"] = processor(parts["tokenizer"], image_processor(folder))
    parts["pipeline_options"] = pipeline_options(folder)
    return parts


def load_qwen_image_21_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """Qwen3-VL from the folder's text_encoder/, read before its final norm."""
    from transformers import Qwen3VLForConditionalGeneration

    if cfg.text_encoder is not None:
        raise ModelFileError(f"model.text_encoder = {cfg.text_encoder}: no single-file layout "
                             "of Qwen-Image 2.1's Qwen3-VL is defined; remove it, the "
                             "folder's text_encoder/ is read")
    return {"text_encoder": no_final_norm(from_folder(Qwen3VLForConditionalGeneration,
                                                      _folder(cfg), "text_encoder", dtype,
                                                      WHAT))}


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The transformer as the original checkpoint keeps it (the inverse of diffusers'
    converter): the diffusers names, each block's `img_mlp.gate_layer` and `img_mlp.proj`
    stacked as `img_mlp.gate_up` (gate rows first)."""
    from difftune.families.qwen_image_21.keys import FUSED, PARTS
    from difftune.files.single import Piece, check_complete

    names = list(model.state_dict())
    layout: "Layout" = {}
    for name in names:
        part = next((p for p in PARTS if name.endswith(f".{p}.weight")), None)
        if part is None:
            layout[name] = Piece((name,))
        elif part == PARTS[0]:
            base = name.removesuffix(f"{part}.weight")
            layout[f"{base}{FUSED}.weight"] = Piece(tuple(f"{base}{p}.weight" for p in PARTS))
    return check_complete(layout, names, "Qwen-Image 2.1")
