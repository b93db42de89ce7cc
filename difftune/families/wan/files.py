"""Load Wan from local files only: a diffusers folder and/or the single files ComfyUI users keep.

`model.path` is a diffusers folder as Wan-AI publishes it (transformer/ (and transformer_2/ for
Wan 2.2 A14B), vae/, text_encoder/ (UMT5), tokenizer/, scheduler/, model_index.json; Wan 2.1
I2V's image_encoder/ and image_processor/ too, its CLIP vision encoder, which
`model.image_encoder` = ComfyUI's clip_vision_h.safetensors replaces: wan/clip_vision.py).
`model.transformer`, `model.vae` and `model.text_encoder` are single .safetensors files as
ComfyUI keeps them: the transformer in Wan's original names (`blocks.N.self_attn.q`, converted
with diffusers' own converter) or in diffusers' names, `wan_2.1_vae.safetensors` (Wan's
original VAE names or diffusers'), and `umt5_xxl_fp16` / `umt5_xxl_fp8_e4m3fn_scaled` (the
encoder's transformers names; ComfyUI's fp8 scales applied). A single file overrides the
folder's component; the tokenizer always comes from the folder. A missing or wrong file raises
`ModelFileError` naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common import frame_vae
from difftune.families.common.components import t5_from_state
from difftune.families.common.folders import check_folder, folder_files, from_folder
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  missing_error, read_safetensors, strip_prefix)
from difftune.families.common.transformer_folder import FolderLayout, load_components
from difftune.families.wan.spec import IMAGE_ENCODED

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

WHAT = "Wan"
LOW_NOISE = "2.2-t2v-a14b-low"
BOTH = "2.2-t2v-a14b"  # both experts: transformer/ (high noise) and transformer_2/ (low)
PAIRS = (BOTH, "2.2-i2v-a14b")  # the variants of both experts (T2V and I2V)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (UniPC over flow sigmas,
# shift 3); the 14B and 2.2 A14B releases use the same.
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
    "lower_order_final": True, "final_sigmas_type": "zero", "timestep_spacing": "linspace",
}
# UMT5-XXL's encoder (google/umt5-xxl), what the single file does not record.
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24,
    "num_heads": 64, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "tie_word_embeddings": False,
    "layer_norm_epsilon": 1e-6,
}
# Wan 2.1 T2V 1.3B's transformer (30 blocks of 1536); the 14B kinds: 5120 wide, FFN 13824,
# 40 heads, 40 blocks.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960,
    "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
# diffusers' names of Wan's parameters that are no linear layer's (norms, modulation tables),
# as (diffusers, Wan) module paths; block parts follow `blocks.N.` (convert_wan_transformer_
# to_diffusers' renames: Wan's norm3 is diffusers' norm2, the cross-attention norm).
OTHER_BLOCK = (("attn1.norm_q", "self_attn.norm_q"), ("attn1.norm_k", "self_attn.norm_k"),
               ("attn2.norm_q", "cross_attn.norm_q"), ("attn2.norm_k", "cross_attn.norm_k"),
               ("attn2.norm_added_k", "cross_attn.norm_k_img"), ("norm2", "norm3"))
# ... and outside the blocks: Wan 2.1 I2V's image embedder norms (img_emb.proj.1 and .3, its
# linear layers, are in spec.TOP_NAMES).
OTHER_TOP = {"condition_embedder.image_embedder.norm1": "img_emb.proj.0",
             "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}
HEAD = 128  # every released Wan transformer's head width
TINY_HEAD = 12  # the tiny flavors' (narrower models than any release)
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """WanTransformer3DModel config from a diffusers-layout state dict's shapes (the head
    width is not stored: 128 as released, 12 below 128 wide)."""
    image = sd.get("condition_embedder.image_embedder.ff.net.0.proj.weight")
    try:
        dim, channels = sd["patch_embedding.weight"].shape[:2]
        head = HEAD if dim % HEAD == 0 else TINY_HEAD
        # Wan 2.1 I2V: the image embedder (CLIP features' width in) and its cross-attention
        images = {} if image is None else {"image_dim": image.shape[1], "added_kv_proj_dim": dim}
        return {**TRANSFORMER_CONFIG, **images, "num_attention_heads": dim // head,
                "attention_head_dim": head, "in_channels": channels,
                "out_channels": sd["proj_out.weight"].shape[0] // 4,
                "text_dim": sd["condition_embedder.text_embedder.linear_1.weight"].shape[1],
                "freq_dim": sd["condition_embedder.time_embedder.linear_1.weight"].shape[1],
                "ffn_dim": sd["blocks.0.ffn.net.0.proj.weight"].shape[0],
                "num_layers": count_blocks(sd, "blocks."),
                "rope_max_seq_len": TRANSFORMER_CONFIG["rope_max_seq_len"] if head == HEAD
                else 64}
    except KeyError as err:
        raise missing_error(path, "a Wan transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file: Wan's original names (ComfyUI's files, converted by
    diffusers' converter) or diffusers' names."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sd = strip_prefix(read_safetensors(path, "Wan transformer"), _ORIGINAL_PREFIXES)
    if "condition_embedder.time_proj.weight" not in sd:
        if "time_projection.1.weight" not in sd:
            raise ModelFileError(f"{path} does not look like a Wan transformer: neither "
                                 "time_projection.1 (Wan's names) nor condition_embedder."
                                 "time_proj (diffusers') is in it")
        sd = convert_wan_transformer_to_diffusers(dict(sd))
    with torch.device("meta"):
        model = WanTransformer3DModel(**transformer_config(sd, path))
    return assign_state(model, cast_state(sd, dtype), path, "Wan transformer")


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """AutoencoderKLWan from `wan_2.1_vae.safetensors` (Wan's names or diffusers')."""
    from diffusers import AutoencoderKLWan

    return frame_vae.load_file(path, dtype, "Wan autoencoder (wan_2.1_vae.safetensors)",
                               AutoencoderKLWan)


def load_text_encoder_file(path: Path, dtype: torch.dtype) -> Any:
    """UMT5-XXL's encoder from `umt5_xxl_*.safetensors` (fp16, bf16 or ComfyUI's scaled fp8);
    sizes from shapes."""
    sd = strip_prefix(read_safetensors(path, "UMT5 text encoder"), ("text_encoders.umt5xxl.",
                                                                     "umt5xxl.transformer."))
    return t5_from_state(sd, path, dtype, "model.text_encoder", umt5=True)


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which Wan needs for its tokenizer (and whatever no single file gives)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"wan\" reads UMT5's tokenizer from a diffusers "
                             "folder; set model.path to a folder in the Wan-AI/Wan2.1-T2V-1.3B-"
                             "Diffusers layout (tokenizer/, and text_encoder/ unless "
                             "model.text_encoder names umt5_xxl_*.safetensors)")
    folder = Path(cfg.path).expanduser()
    if cfg.transformer is None or cfg.vae is None:
        check_folder(folder, WHAT)
    return folder


def _check_expert(folder: Path, variant: str | None) -> None:
    """A Wan 2.2 A14B folder holds two experts: refuse to read its `transformer/` (the
    high-noise expert) as a Wan 2.1 model, naming the variants that train them."""
    index = folder / "model_index.json"
    if variant == LOW_NOISE or variant in PAIRS or not index.is_file():
        return
    try:
        experts = json.loads(index.read_text(encoding="utf-8")).get("transformer_2")
    except (OSError, ValueError, AttributeError):
        return  # the folder's own reader reports a bad index
    if isinstance(experts, list) and experts[0] is not None:
        raise ModelFileError(f"{folder} holds Wan 2.2 A14B's two experts (transformer/ and "
                             f"transformer_2/); set model.variant = \"{BOTH}\" to train "
                             f"both (one LoRA each), or \"{LOW_NOISE}\" for its low-noise "
                             "expert alone")


def _layout(variant: str | None) -> FolderLayout:
    """Wan's classes and single-file loaders (the low-noise expert is the folder's
    transformer_2/; both experts: transformer/ and transformer_2/)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    return FolderLayout(WHAT, WanTransformer3DModel, AutoencoderKLWan, load_transformer_file,
                        load_vae_file, SCHEDULER_CONFIG, UniPCMultistepScheduler,
                        "transformer_2" if variant == LOW_NOISE else "transformer",
                        others=("transformer_2",) if variant in PAIRS else ())


def load_wan_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component in `dtypes` (single files over the folder's), plus "name" and
    "fingerprint"."""
    folder = _folder(cfg)
    if cfg.transformer is None:
        _check_expert(folder, cfg.variant)
    image = cfg.variant in IMAGE_ENCODED
    parts = load_components(cfg, dtypes, folder, _layout(cfg.variant), load_wan_text_encoders,
                            tuple(_image_files(cfg, folder)) if image else ())
    _check_task(parts, cfg)
    if image:
        parts.update(_image_parts(cfg, folder, dtypes["text_encoders"]))
    return parts


def _image_files(cfg: "ModelConfig", folder: Path) -> list[Path]:
    """Wan 2.1 I2V's CLIP vision encoder files, part of its identity: `model.image_encoder`
    (ComfyUI's clip_vision_h.safetensors) or the folder's image_encoder/, and its
    image_processor/."""
    if cfg.image_encoder is None:
        return folder_files(folder, ["image_encoder", "image_processor"])[1:]
    return folder_files(folder, ["image_processor"])[1:] + [Path(cfg.image_encoder)]


def _image_parts(cfg: "ModelConfig", folder: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Wan 2.1 I2V's CLIP vision encoder (`model.image_encoder`'s file over the folder's) and
    its image processor (the folder's)."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from difftune.families.wan import clip_vision

    encoder = (from_folder(CLIPVisionModel, folder, "image_encoder", dtype, WHAT)
               if cfg.image_encoder is None else
               clip_vision.load_file(Path(cfg.image_encoder), dtype))
    return {"image_encoder": encoder,
            "image_processor": from_folder(CLIPImageProcessor, folder, "image_processor", None,
                                           WHAT)}


def _check_task(parts: dict[str, Any], cfg: "ModelConfig") -> None:
    """A transformer of another kind than the variant's refused, naming the variant that
    trains it: an image-to-video one (36 input channels: the noisy latents and the start-frame
    condition) given to a text-to-video variant, a T2V one (16) to an I2V variant, and Wan 2.1
    I2V's (with the image embedder of its CLIP features) against Wan 2.2 I2V A14B's."""
    from difftune.families.wan.spec import I2V_14B, I2V_A14B, SPEC

    i2v = SPEC.pick(cfg.variant).start_image
    for part in ("transformer", "transformer_2"):
        model = parts.get(part)
        if model is None:
            continue
        source = getattr(cfg, part, None) or Path(str(cfg.path)) / part
        clip = model.config.image_dim is not None
        if clip != (cfg.variant in IMAGE_ENCODED):
            want = I2V_14B if clip else I2V_A14B
            raise ModelFileError(f"{source} is a Wan {'2.1' if clip else '2.2'} "
                                 f"image-to-video transformer; set model.variant = "
                                 f"\"{want.variant}\" to train it, or give that variant's files")
        channels = int(model.config.in_channels)
        if (channels == 36) != i2v:
            which = I2V_14B if clip else I2V_A14B
            fix = (f'model.variant = "{which.variant}" to train it' if channels == 36 else
                   "a text-to-video variant (model.variant) to train it")
            raise ModelFileError(
                f"{source} is a Wan {'image' if channels == 36 else 'text'}-to-video "
                f"transformer ({channels} input channels), but model.variant = "
                f"\"{SPEC.pick(cfg.variant).variant}\" is "
                f"{'image' if i2v else 'text'}-to-video; set {fix}, or give that variant's "
                "files")


def load_wan_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The UMT5 encoder alone: `model.text_encoder` if given, else the folder's."""
    from transformers import UMT5EncoderModel

    if cfg.text_encoder is not None:
        return {"text_encoder": load_text_encoder_file(Path(cfg.text_encoder), dtype)}
    return {"text_encoder": from_folder(UMT5EncoderModel, _folder(cfg), "text_encoder", dtype,
                                        WHAT)}


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The Wan transformer in Wan's original names (as ComfyUI keeps wan2.1_t2v_*), the
    inverse of diffusers' converter: a one-to-one renaming (`keys.to_wan` for the linear
    layers, and the norms, tables and embedding below)."""
    from difftune.families.wan.keys import to_wan
    from difftune.files.single import Piece, check_complete

    blocks = dict(OTHER_BLOCK)
    names, out = list(model.state_dict()), {}
    for name in names:
        module, _, tensor = name.rpartition(".")
        parts = module.split(".")
        if name == "scale_shift_table":
            wan = "head.modulation"
        elif tensor == "scale_shift_table":  # a block's own table: blocks.N.modulation
            wan = f"{module}.modulation"
        elif module in OTHER_TOP:
            wan = f"{OTHER_TOP[module]}.{tensor}"
        elif len(parts) > 2 and parts[0] == "blocks" and ".".join(parts[2:]) in blocks:
            wan = f"blocks.{parts[1]}.{blocks['.'.join(parts[2:])]}.{tensor}"
        else:
            renamed = to_wan(module)
            wan = f"{renamed}.{tensor}" if renamed is not None else name
        out[wan] = Piece((name,))
    return check_complete(out, names, "Wan original")
