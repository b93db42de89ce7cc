"""Autoencoders and text encoders (CLIP, T5) from single files or a checkpoint's tensors.

Configs are derived from tensor shapes (the released models' values where shapes are silent:
head width 64, 32 norm groups, standard CLIP-L / T5-XXL settings); LDM and OpenCLIP names are
converted with diffusers' own converters. Shared by every family's `files.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  missing_error, prefixed, read_safetensors,
                                                  strip_prefix)

_CLIP_PREFIXES = ("cond_stage_model.transformer.", "transformer.", "clip_l.", "te1.")
_CLIP_TOWER = ("embeddings", "encoder", "final_layer_norm")
_T5_PREFIXES = ("text_encoders.t5xxl.transformer.", "t5xxl.transformer.", "t5xxl.", "te2.")
# Where original-layout checkpoints keep the denoiser and the autoencoder.
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."

# ---------------------------------------------------------------------------------------------
# Shape rules for what the weights do not record


def norm_groups(width: int) -> int:
    """GroupNorm groups: the released models' 32, or 8 for the narrow test models (tiny flavors)."""
    return 32 if width >= 128 else min(8, width)


def head_width(width: int) -> int:
    """Attention head width: 64 in SDXL, SD3 and both CLIPs; 16 in the narrow tiny models."""
    return 64 if width >= 320 else 16


def vae_config(sd: dict[str, torch.Tensor], ldm: bool) -> dict[str, Any]:
    """AutoencoderKL config from shapes (norm groups and scaling are the caller's: not stored)."""
    down = "encoder.down.{}.block.0.conv1.weight" if ldm else \
        "encoder.down_blocks.{}.resnets.0.conv1.weight"
    n = count_blocks(sd, "encoder.down." if ldm else "encoder.down_blocks.")
    block0 = "encoder.down.0.block." if ldm else "encoder.down_blocks.0.resnets."
    return {
        "in_channels": sd["encoder.conv_in.weight"].shape[1],
        "out_channels": sd["decoder.conv_out.weight"].shape[0],
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "block_out_channels": [sd[down.format(i)].shape[0] for i in range(n)],
        "layers_per_block": count_blocks(sd, block0),
        "latent_channels": sd["encoder.conv_out.weight"].shape[0] // 2,
        "use_quant_conv": "quant_conv.weight" in sd,
        "use_post_quant_conv": "post_quant_conv.weight" in sd,
    }


# ---------------------------------------------------------------------------------------------
# Text encoders from single files


def load_clip_file(path: Path, dtype: torch.dtype, tokenizer: Any) -> Any:
    """CLIP-L text encoder from `clip_l.safetensors`; sizes derived from shapes."""
    from transformers import CLIPTextConfig, CLIPTextModel

    sd = strip_prefix(read_safetensors(path, "CLIP-L text encoder"), _CLIP_PREFIXES)
    # Files name tensors "text_model.*" (transformers 4 / ComfyUI) or without it (transformers
    # 5); keep the text tower under the names without it, dropping projection and logit scale.
    sd = strip_prefix(sd, ("text_model.",))
    sd = {k: v for k, v in sd.items() if k.split(".", 1)[0] in _CLIP_TOWER}
    try:
        vocab, hidden = sd["embeddings.token_embedding.weight"].shape
        config = CLIPTextConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=sd["encoder.layers.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=count_blocks(sd, "encoder.layers."),
            # CLIP-L has 64-wide heads; tiny variants use 16-wide ones.
            num_attention_heads=hidden // 64 if hidden >= 64 else max(1, hidden // 16),
            max_position_embeddings=sd["embeddings.position_embedding.weight"].shape[0],
            projection_dim=hidden, hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a CLIP text encoder: tensor {err} is "
                             "missing") from None
    return pretrained_from_state(CLIPTextModel, config, cast_state(sd, dtype), dtype, path,
                                 "CLIP-L", "model.clip_l")


def load_t5_file(path: Path, dtype: torch.dtype) -> Any:
    """T5 encoder (T5-XXL v1.1) from `t5xxl_*.safetensors`, fp16/bf16/fp8; sizes from shapes."""
    sd = strip_prefix(read_safetensors(path, "T5-XXL text encoder"), _T5_PREFIXES)
    return t5_from_state(sd, path, dtype, "model.t5")


def t5_from_state(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                  field: str | None = None, umt5: bool = False) -> Any:
    """T5 encoder from transformers-layout tensors (prefix removed); `path` names the source,
    `field` the config field that gave it (None: a part of a checkpoint). `umt5` builds a
    UMT5EncoderModel (UMT5's tensors have T5's names, with a relative attention bias in every
    layer rather than the first only)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else \
        (T5Config, T5EncoderModel)

    if "shared.weight" not in sd and "encoder.embed_tokens.weight" in sd:
        sd["shared.weight"] = sd["encoder.embed_tokens.weight"]
    sd = {k: v for k, v in sd.items() if not k.startswith("decoder.") and k != "lm_head.weight"}
    try:
        vocab, d_model = sd["shared.weight"].shape
        heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape
        gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in sd
        wi = "wi_0" if gated else "wi"
        config = config_class(
            vocab_size=vocab, d_model=d_model, num_heads=heads[1],
            relative_attention_num_buckets=heads[0],
            d_kv=sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads[1],
            d_ff=sd[f"encoder.block.0.layer.1.DenseReluDense.{wi}.weight"].shape[0],
            num_layers=count_blocks(sd, "encoder.block."),
            feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=False)
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a T5 encoder: tensor {err} is "
                             "missing") from None
    sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])
    return pretrained_from_state(model_class, config, cast_state(sd, dtype), dtype, path,
                                 "UMT5" if umt5 else "T5", field)


def pretrained_from_state(cls: Any, config: Any, sd: dict, dtype: torch.dtype, path: Path,
                           what: str, field: str | None = None) -> Any:
    """A transformers model from an in-memory state dict (meta init, buffers handled).

    The config comes from a few tensors' shapes; a file whose other tensors are missing or of
    other shapes (damaged, or parts of another model) is refused here, naming `field` (the
    config field that gave the file, e.g. "model.text_encoder"), the file and the shapes,
    before transformers would fail on it with a traceback about `ignore_mismatched_sizes`."""
    source = f"{field} = {path}" if field else str(path)
    expected = _expected_shapes(cls, config)
    missing = sorted(k for k in expected if k not in sd)
    if missing:
        raise ModelFileError(f"{source} is not a complete {what} text encoder: "
                             f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    wrong = [f"{k} is {tuple(sd[k].shape)}, expected {expected[k]}" for k in expected
             if tuple(sd[k].shape) != expected[k]]
    if wrong:
        raise ModelFileError(
            f"{source}: {len(wrong)} tensor(s) have other shapes than the {what} text encoder "
            f"its other tensors describe ({'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}"
            "); the file is damaged or mixes parts of different models: give the encoder's "
            "file as released")
    model = cls.from_pretrained(None, config=config, state_dict=sd, torch_dtype=dtype)
    return model.eval()


def _expected_shapes(cls: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """Persistent parameter/buffer names and shapes of a model class, without allocating its
    weights."""
    with torch.device("meta"):
        model = cls(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Autoencoder and CLIP encoders from inside a checkpoint


def vae_from_state(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   scale: dict[str, Any]) -> Any:
    """An AutoencoderKL from LDM-layout tensors (prefix removed); `scale`: the family's factors."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    try:
        config = vae_config(sd, ldm=True)
        width = sd["encoder.conv_in.weight"].shape[0]
        config.update(scale, norm_num_groups=norm_groups(width), force_upcast=width >= 128)
        vae_sd = convert_ldm_vae_checkpoint(sd, config)
    except KeyError as err:
        raise missing_error(path, "an autoencoder", err) from None
    with torch.device("meta"):
        model = AutoencoderKL(**config)
    return assign_state(model, cast_state(vae_sd, dtype), path, "autoencoder")


def load_vae(file: Path | None, sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
             scale: dict[str, Any]) -> tuple[Any, list[Path]] | None:
    """`model.vae` if given, else the checkpoint's bundled one; None when neither exists."""
    if file is not None:
        own = strip_prefix(read_safetensors(Path(file), "autoencoder"), (VAE_PREFIX, "vae."))
        if not any(k.startswith("encoder.down.") for k in own):
            raise ModelFileError(f"{file} does not look like an LDM-layout autoencoder: no "
                                 "encoder.down.* tensors")
        return vae_from_state(own, Path(file), dtype, scale), [Path(file)]
    bundled = prefixed(sd, VAE_PREFIX)
    return (vae_from_state(bundled, path, dtype, scale), []) if bundled else None


def clip_from_state(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, tokenizer: Any,
                    projection: bool, act: str) -> Any:
    """A CLIP text encoder from transformers-layout tensors; sizes from shapes.

    `projection` builds CLIPTextModelWithProjection (identity projection when the file has none,
    as SD3 uses CLIP-L's pooled output unprojected); `act` is not recorded in the weights:
    "quick_gelu" for CLIP-L, "gelu" for OpenCLIP-G.
    """
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tower = {k.removeprefix("text_model."): v for k, v in sd.items() if k != "text_projection.weight"
             and k.removeprefix("text_model.").split(".", 1)[0] in ("embeddings", "encoder",
                                                                     "final_layer_norm")}
    try:
        vocab, hidden = tower["embeddings.token_embedding.weight"].shape
        proj = sd.get("text_projection.weight", torch.eye(hidden, dtype=torch.float32))
        config = CLIPTextConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=tower["encoder.layers.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=count_blocks(tower, "encoder.layers."),
            num_attention_heads=hidden // head_width(hidden),
            max_position_embeddings=tower["embeddings.position_embedding.weight"].shape[0],
            projection_dim=proj.shape[0], hidden_act=act,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
    except KeyError as err:
        raise missing_error(path, "a CLIP text encoder", err) from None
    if projection:
        state = {f"text_model.{k}": v for k, v in tower.items()}
        state["text_projection.weight"] = proj
        cls: Any = CLIPTextModelWithProjection
    else:
        state, cls = tower, CLIPTextModel
    expected = _expected_shapes(cls, config)
    state = {k: v for k, v in state.items() if k in expected}
    return pretrained_from_state(cls, config, cast_state(state, dtype), dtype, path, "CLIP")


def open_clip_state(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """OpenCLIP-layout tensors under `prefix` renamed to transformers' CLIP names (diffusers' map)."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    return convert_open_clip_checkpoint(None, sd, prefix=prefix)
