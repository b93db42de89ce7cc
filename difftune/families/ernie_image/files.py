"""Load ERNIE-Image (or ERNIE-Image-Turbo) from local files only: a diffusers folder and/or
single files.

`model.path` is a diffusers folder as Baidu publishes it (transformer/, vae/ (FLUX.2's
AutoencoderKLFlux2), text_encoder/ (a Mistral3Model around Ministral 3 3B), tokenizer/,
scheduler/; the optional prompt enhancer pe/ is not read: captions are what is trained on).
`model.transformer`, `model.vae` and `model.text_encoder` are single .safetensors files as
ComfyUI users keep them (Comfy-Org/ERNIE-Image: `ernie-image.safetensors` in the diffusers
names, `flux2-vae.safetensors`, `ministral-3-3b.safetensors`: the language model's `model.*`
tensors); a single file overrides the folder's component, and the tokenizer always comes from
the folder. Weights are read through safetensors only; a missing or wrong file raises
`ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.bn_vae import load_vae_file
from difftune.families.common.components import pretrained_from_state
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

WHAT = "ERNIE-Image"
# The released scheduler_config.json: a fixed shift of 4, not by resolution.
SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 4.0,
                                    "use_dynamic_shifting": False}
# ErnieImagePipeline un-normalizes latents with this epsilon, not the released autoencoder
# config's batch_norm_eps (its TODO: the trained value is 1e-5); latents are normalized alike.
BN_EPS = 1e-5
# The released transformer's config (ComfyUI's ErnieImageModel defaults; 8.03B parameters).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072,
    "rope_theta": 256, "rope_axes_dim": (32, 48, 48), "eps": 1e-6, "qk_layernorm": True,
}
# Ministral 3 3B's language model (ComfyUI's Ministral3_3BConfig); RoPE (YaRN) settings are
# transformers' Ministral3Config defaults, which single files do not record.
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5,
}
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# Where a Ministral 3 language model's tensors sit in the files users have: ComfyUI's
# (`model.`), or a Mistral3 checkpoint's (transformers 5's and 4's names, a bare
# Mistral3Model's); the more specific prefix first.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes (text/row, row, column) for a head size (not in the weights): ERNIE-Image's
    (32, 48, 48) at 128, the same proportions at other sizes."""
    side = head_dim * 3 // 8
    return (head_dim - 2 * side, side, side)


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """ErnieImageTransformer2DModel config from a state dict's shapes."""
    try:
        hidden, in_channels, patch, _ = sd["x_embedder.proj.weight"].shape
        head = sd["layers.0.self_attention.norm_q.weight"].shape[0]
        text = sd["text_proj.weight"].shape[1] if "text_proj.weight" in sd else hidden
        return {**TRANSFORMER_CONFIG, "hidden_size": hidden, "in_channels": in_channels,
                "out_channels": sd["final_linear.weight"].shape[0] // (patch * patch),
                "patch_size": patch, "num_layers": count_blocks(sd, "layers."),
                "num_attention_heads": hidden // head, "text_in_dim": text,
                "ffn_hidden_size": sd["layers.0.mlp.gate_proj.weight"].shape[0],
                "rope_axes_dim": rope_axes(head)}
    except KeyError as err:
        raise missing_error(path, "an ERNIE-Image transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file (diffusers names, bare or under the SGM prefixes that
    diffusers' converter strips)."""
    from diffusers import ErnieImageTransformer2DModel

    sd = strip_prefix(read_safetensors(path, "ERNIE-Image transformer"), _ORIGINAL_PREFIXES)
    with torch.device("meta"):
        model = ErnieImageTransformer2DModel(**transformer_config(sd, path))
    return assign_state(model, cast_state(sd, dtype), path, "ERNIE-Image transformer")


def load_text_encoder_file(path: Path, dtype: torch.dtype) -> Any:
    """Ministral 3's language model (Ministral3Model) from one file, sizes from shapes (the
    head size is Ministral 3's 128, as ComfyUI also assumes): what the pipeline's Mistral3Model
    runs for text (its vision tower reads images only)."""
    from transformers import Ministral3Config, Ministral3Model

    sd = strip_prefix(read_safetensors(path, "Ministral 3 text encoder"), _TEXT_PREFIXES)
    head = TEXT_ENCODER_CONFIG["head_dim"]  # Ministral 3's; no tensor records it
    try:
        vocab, hidden = sd["embed_tokens.weight"].shape
        config = Ministral3Config(**{
            **TEXT_ENCODER_CONFIG, "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": count_blocks(sd, "layers."),
            "num_attention_heads": sd["layers.0.self_attn.q_proj.weight"].shape[0] // head,
            "num_key_value_heads": sd["layers.0.self_attn.k_proj.weight"].shape[0] // head,
            "intermediate_size": sd["layers.0.mlp.gate_proj.weight"].shape[0]})
    except KeyError as err:
        raise missing_error(path, "a Ministral 3 text encoder", err) from None
    return pretrained_from_state(Ministral3Model, config, cast_state(sd, dtype), dtype, path,
                                 "Ministral 3", "model.text_encoder")


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which ERNIE-Image needs for its tokenizer (also with single files)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"ernie_image\" reads its tokenizer from a "
                             "diffusers folder; set model.path to a folder in the "
                             "baidu/ERNIE-Image layout (tokenizer/, text_encoder/, ...)")
    folder = Path(cfg.path).expanduser()
    if cfg.transformer is None or cfg.vae is None or cfg.text_encoder is None:
        check_folder(folder, WHAT)
    return folder


def _layout() -> FolderLayout:
    """ERNIE-Image's classes and single-file loaders."""
    from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel

    return FolderLayout(WHAT, ErnieImageTransformer2DModel, AutoencoderKLFlux2,
                        load_transformer_file, load_vae_file, SCHEDULER_CONFIG)


def load_ernie_image_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]
                           ) -> dict[str, Any]:
    """Every component (single files over the folder's), plus "name" and "fingerprint"."""
    return load_components(cfg, dtypes, _folder(cfg), _layout(), load_ernie_image_text_encoders)


def load_ernie_image_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The text encoder alone: `model.text_encoder` if given, else the folder's
    Mistral3Model."""
    from transformers import Mistral3Model

    if cfg.text_encoder is not None:
        return {"text_encoder": load_text_encoder_file(Path(cfg.text_encoder), dtype)}
    return {"text_encoder": from_folder(Mistral3Model, _folder(cfg), "text_encoder", dtype,
                                        WHAT)}


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The transformer's single file as ComfyUI keeps it: diffusers' names as they are (its
    ErnieImageModel uses them; diffusers' converter only strips a prefix)."""
    from difftune.files.single import identity_layout

    return identity_layout(list(model.state_dict()))
