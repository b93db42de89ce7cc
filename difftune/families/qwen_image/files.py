"""Load Qwen-Image (and Qwen-Image-2512) from local files only: a diffusers folder and/or
single files.

`model.path` is a diffusers folder as Qwen publishes it (transformer/, vae/, text_encoder/
(Qwen2.5-VL-7B), tokenizer/, scheduler/). `model.transformer`, `model.vae` and
`model.text_encoder` are single .safetensors files as ComfyUI users keep them
(`qwen_image_bf16.safetensors`: the diffusers module names, diffusers' own single-file mapping
for this model being the identity, with or without `model.diffusion_model.`;
`qwen_image_vae.safetensors`: the Wan-2.1-style layout, converted by diffusers' Wan VAE
converter, or the diffusers layout; `qwen_2.5_vl_7b.safetensors`: the transformers layout of
Qwen2.5-VL); a single file overrides the folder's component, and the tokenizer always comes from
the folder. Weights are read through safetensors only; a missing or wrong file raises
`ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import pretrained_from_state
from difftune.families.common import frame_vae
from difftune.families.common.folders import check_folder, from_folder
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

WHAT = "Qwen-Image"
# Qwen/Qwen-Image's scheduler/scheduler_config.json: a resolution-dependent (exponential) shift
# from mu = 0.5 at 256 image tokens to 0.9 at 8192, stretched to end at sigma 0.02.
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
    "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
    "shift_terminal": 0.02, "time_shift_type": "exponential", "invert_sigmas": False,
    "stochastic_sampling": False, "use_beta_sigmas": False, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# The released transformer (QwenImageTransformer2DModel's defaults are the 20B model's).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
    "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}
# The released VAE's architecture (its per-channel latents_mean/std are the class defaults).
# Qwen2.5-VL-7B-Instruct, the text encoder (its hidden size is joint_attention_dim).
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                        "mrope_section": [16, 24, 24]},
    "bos_token_id": 151643, "eos_token_id": 151645,
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def text_encoder_config(text: dict[str, Any] | None = None,
                        vision: dict[str, Any] | None = None) -> Any:
    """A Qwen2_5_VLConfig: the released 7B model's, with any entries overridden."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config={**TEXT_CONFIG, **(text or {})},
                            vision_config={**VISION_CONFIG, **(vision or {})},
                            tie_word_embeddings=False)


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """QwenImageTransformer2DModel config from a diffusers-layout state dict's shapes."""
    try:
        inner, in_channels = sd["img_in.weight"].shape
        head = sd["transformer_blocks.0.attn.norm_q.weight"].shape[0]
        return {**TRANSFORMER_CONFIG, "in_channels": in_channels,
                "out_channels": sd["proj_out.weight"].shape[0] // 4,
                "num_layers": count_blocks(sd, "transformer_blocks."),
                "attention_head_dim": head, "num_attention_heads": inner // head,
                "joint_attention_dim": sd["txt_in.weight"].shape[1],
                "guidance_embeds": any(k.startswith("time_text_embed.guidance_embedder")
                                       for k in sd),
                "axes_dims_rope": rope_axes(head)}
    except KeyError as err:
        raise missing_error(path, "a Qwen-Image transformer", err) from None


def rope_axes(head: int) -> tuple[int, int, int]:
    """The (frame, height, width) RoPE dims of a head `head` wide, in the released split
    ((16, 56, 56) of 128; Qwen-Image 2.1 keeps it): the spatial axes share 7/8 of it evenly."""
    side = (head - head // 8) // 2 // 2 * 2
    return (head - 2 * side, side, side)


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file in the diffusers names (ComfyUI's and diffusers' layout
    for this model), with or without ComfyUI's `model.diffusion_model.` prefix."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    sd = strip_prefix(read_safetensors(path, "Qwen-Image transformer"), _ORIGINAL_PREFIXES)
    config = transformer_config(sd, path)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config)
    # The RoPE tables are plain tensor attributes, not weights: built on the meta device they
    # would hold no data, so that module is built again for real, as the class builds it.
    if not config.get("use_layer3d_rope", False):
        model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(config["axes_dims_rope"]),
                                        scale_rope=True)
    return assign_state(model, cast_state(sd, dtype), path, "Qwen-Image transformer")


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """AutoencoderKLQwenImage from one file (Wan-2.1 layout as ComfyUI keeps it, or diffusers')."""
    return frame_vae.load_file(path, dtype, "Qwen-Image VAE")

def load_text_encoder_file(path: Path, dtype: torch.dtype) -> Any:
    """Qwen2.5-VL from one file as ComfyUI keeps it (`qwen_2.5_vl_7b.safetensors`), in the
    transformers layout (`model.language_model.*`/`model.visual.*` or the older
    `model.*`/`visual.*`, `lm_head`); sizes of the text model from its shapes."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    sd = read_safetensors(path, "Qwen2.5-VL text encoder")
    sd = {_new_vl_name(k): v for k, v in sd.items()}
    try:
        text, vision = text_sizes(sd), vision_sizes(sd)
    except KeyError as err:
        raise missing_error(path, "a Qwen2.5-VL text encoder", err) from None
    return pretrained_from_state(Qwen2_5_VLForConditionalGeneration,
                                 text_encoder_config(text, vision), cast_state(sd, dtype), dtype,
                                 path, "Qwen2.5-VL", "model.text_encoder")


def text_sizes(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The text model's config entries from its tensors' shapes. Heads are not in the shapes:
    Qwen2.5-VL's are 128 wide at every released size (the tiny flavor's half its width, 16),
    with the multimodal RoPE sections in the released proportions."""
    layers = "model.language_model.layers."
    vocab, hidden = sd["model.language_model.embed_tokens.weight"].shape
    head = min(128, hidden // 2)
    ids = {k: v if v < vocab else None for k, v in TEXT_CONFIG.items() if k.endswith("token_id")}
    return {**ids, "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": count_blocks(sd, layers),
            "num_attention_heads": hidden // head,
            "num_key_value_heads": sd[layers + "0.self_attn.k_proj.weight"].shape[0] // head,
            "intermediate_size": sd[layers + "0.mlp.gate_proj.weight"].shape[0],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [head // 8, 3 * head // 16, 3 * head // 16]}}


def vision_sizes(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The vision tower's config entries from its tensors' shapes (heads 80 wide, as released;
    the text encoder never runs it, but its weights are in the files)."""
    blocks = "model.visual.blocks."
    hidden = sd[blocks + "0.norm1.weight"].shape[0]
    return {"depth": count_blocks(sd, blocks), "hidden_size": hidden,
            "num_heads": max(1, hidden // 80),
            "intermediate_size": sd[blocks + "0.mlp.gate_proj.weight"].shape[0],
            "out_hidden_size": sd["model.visual.merger.mlp.2.weight"].shape[0]}


def _new_vl_name(key: str) -> str:
    """A Qwen2.5-VL tensor name in transformers' current layout (`model.language_model.`,
    `model.visual.`), from the older one the released files use (`model.`, `visual.`)."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.",
                                                         "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key


def _folder(cfg: ModelConfig) -> Path:
    """model.path, which Qwen-Image needs for its tokenizer (also with single files)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"qwen_image\" reads its tokenizer from a diffusers "
                             "folder; set model.path to a folder in the Qwen/Qwen-Image layout "
                             "(tokenizer/, and text_encoder/ unless model.text_encoder is set)")
    folder = Path(cfg.path).expanduser()
    if cfg.transformer is None or cfg.vae is None:
        check_folder(folder, WHAT)
    return folder


def _layout() -> FolderLayout:
    """Qwen-Image's classes and single-file loaders."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    return FolderLayout(WHAT, QwenImageTransformer2DModel, AutoencoderKLQwenImage,
                        load_transformer_file, load_vae_file, SCHEDULER_CONFIG)

def load_qwen_image_files(cfg: ModelConfig, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component in `dtypes` (single files over the folder's), plus "name" and
    "fingerprint"."""
    parts = load_components(cfg, dtypes, _folder(cfg), _layout(), load_qwen_image_text_encoders)
    if cfg.variant not in (None, "base"):
        parts["processor"] = load_processor(_folder(cfg))
    return parts


def vl_processor(image_processor: Any, tokenizer: Any) -> Any:
    """Qwen2.5-VL's processor (images and text; the edit pipelines give it no video), as a
    Qwen2VLProcessor without the video processor (common/vl_processor.py)."""
    from transformers import Qwen2VLProcessor

    from difftune.families.common.vl_processor import without_video

    return without_video(Qwen2VLProcessor, image_processor, tokenizer)


def load_processor(folder: Path) -> Any:
    """An edit folder's Qwen2.5-VL processor (processor/: the image processor's settings and
    the tokenizer), read locally."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    sub = folder / "processor"
    if not sub.is_dir():
        raise ModelFileError(f"{folder} has no processor/ folder; Qwen-Image-Edit folders "
                             "hold Qwen2.5-VL's processor there")
    return vl_processor(Qwen2VLImageProcessorPil.from_pretrained(sub, local_files_only=True),
                        AutoTokenizer.from_pretrained(sub, local_files_only=True))


def load_qwen_image_text_encoders(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen2.5-VL text encoder alone: `model.text_encoder` if given, else the folder's."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    if cfg.text_encoder is not None:
        return {"text_encoder": load_text_encoder_file(Path(cfg.text_encoder), dtype)}
    return {"text_encoder": from_folder(Qwen2_5_VLForConditionalGeneration, _folder(cfg),
                                        "text_encoder", dtype, WHAT)}


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The Qwen-Image transformer as ComfyUI keeps it (`qwen_image_bf16.safetensors`): the
    diffusers names themselves (diffusers' single-file mapping for it is the identity)."""
    from difftune.files.single import check_complete, identity_layout

    names = list(model.state_dict())
    return check_complete(identity_layout(names), names, "Qwen-Image")
